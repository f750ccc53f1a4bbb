"""grt-megatron: a pretraining framework for Gated Recurrent Transformers on megatron-core and DeepSpeed."""

from grt_megatron.cpu_shims import defer_megatron_kernel_compile_on_cpu
from grt_megatron.lazy_imports import defer_optional_imports

__version__ = "0.1.0"

# Before any module of the package imports megatron-core: see each function's docstring.
defer_megatron_kernel_compile_on_cpu()
defer_optional_imports()
