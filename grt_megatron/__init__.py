"""grt-megatron: a pretraining framework for Gated Recurrent Transformers on megatron-core and DeepSpeed."""

from grt_megatron.cpu_shims import defer_megatron_kernel_compile_on_cpu

__version__ = "0.1.0"

# Before any module of the package imports megatron-core: see the function's docstring.
defer_megatron_kernel_compile_on_cpu()
