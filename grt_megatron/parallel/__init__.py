"""Parallelism, applied to the one model from outside it.

- `layout.py`: `validate_layout`, the one check of a layout (and the rules it is made of), pure.
- `parallelize.py`: `parallelize`, the one door: builds the model or its pipeline stage for a layout,
  adds the sequence-parallel gradient hooks and wraps it in the DeepSpeed engine (DP/ZeRO).
- `pipeline.py`: pipeline units cut from `GRTLanguageModel`, built into DeepSpeed's pipeline module.
- `pipeline_stages.py`: which units each stage takes (balanced by FLOPs, or at given split points), pure.
- `deepspeed_engine.py`: the DeepSpeed configuration (ZeRO, precision, clipping, optimizer, schedule).
- `sequence_parallel.py`: the gradient reduction SP needs under DeepSpeed.
- `compile.py`: `train.compile`, torch.compile applied per layer and to the recurrence step.
- `mixed_precision.py`: `train.precision=bf16-mixed`, the forward under autocast over fp32 weights.

Tensor parallelism itself lives in megatron-core's layers (column/row-parallel linears, the
vocab-parallel embedding and loss), switched on by the model config's `tensor_model_parallel_size`.
Only the light, pure layout functions are imported here, so that configuration code can use them
without importing DeepSpeed.
"""

from grt_megatron.parallel.layout import split_global_batch, validate_layout

__all__ = ["split_global_batch", "validate_layout"]
