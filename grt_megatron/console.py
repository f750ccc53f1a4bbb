"""Console hygiene shared by the command-line tools."""

from __future__ import annotations

import os
import warnings


def quiet_known_warnings() -> None:
    """megatron-core and DeepSpeed warn at import about optional CUDA extensions (apex, TE) and
    upcoming API changes; on the portable path these are expected and drown the run's own output."""
    for pattern in (
        ".*Apex is not installed.*",
        ".*Transformer Engine and Apex are not installed.*",
        ".*tp_group is None.*",
        ".*full scope is deprecated.*",
        ".*requires ffn_hidden_size.*",
        ".*CUDA_DEVICE_MAX_CONNECTIONS.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(megatron|deepspeed|torch\.jit).*")
    # Naming DeepSpeed's accelerator up front skips its detection warning ("Setting accelerator to CPU").
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        os.environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else "cpu"
