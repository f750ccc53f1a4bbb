"""Process-group and model-parallel set-up, the same for one plain `python` process and for torchrun."""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from grt_megatron.cpu_shims import apply_cpu_shims
from grt_megatron.device import configure_cuda, process_group_backend, run_device
from grt_megatron.model.config import ConfigError
from grt_megatron.parallel.layout import data_parallel_size


@dataclass(frozen=True)
class DistributedInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return parallel_state.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return parallel_state.get_data_parallel_world_size()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _from_srun() -> bool:
    """`srun` started us as one of several tasks, without torchrun in between."""
    return "RANK" not in os.environ and "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def world_size_from_env() -> int:
    """The world size the launcher set up: torchrun's WORLD_SIZE, srun's SLURM_NTASKS, else 1."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return int(os.environ["SLURM_NTASKS"]) if _from_srun() else 1


def export_launcher_env() -> None:
    """Set RANK / WORLD_SIZE / LOCAL_RANK (what torch.distributed and DeepSpeed read) from the launcher:
    torchrun sets them itself; under `srun` they come from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID
    (MASTER_ADDR and MASTER_PORT must then be exported by the batch script); without a launcher this is
    a world of one on a free local port."""
    if "RANK" in os.environ:
        return
    if _from_srun():
        if "MASTER_ADDR" not in os.environ:
            raise ConfigError("started by srun without torchrun: export MASTER_ADDR (the first host of "
                              "`scontrol show hostnames $SLURM_JOB_NODELIST`) and MASTER_PORT")
        os.environ.update(RANK=os.environ["SLURM_PROCID"], WORLD_SIZE=os.environ["SLURM_NTASKS"],
                          LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"))
        os.environ.setdefault("MASTER_PORT", "29500")
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def init_distributed(tp: int = 1, pp: int = 1, seed: int = 0, timeout_minutes: int = 30,
                     deterministic: bool = False) -> DistributedInfo:
    """Start the process group (gloo on CPU; NCCL plus gloo for host tensors on GPU) and megatron's
    parallel state; seed all RNGs. `timeout_minutes` bounds every collective, also the waits of the
    ranks while rank 0 alone prepares a corpus or verifies a checkpoint (NCCL's default is 10 min)."""
    apply_cpu_shims()
    export_launcher_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    data_parallel_size(world, tp, pp)  # the layout check's own rule, before megatron asserts it
    configure_cuda(tp, deterministic)
    device = run_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=process_group_backend(), rank=rank, world_size=world,
                                timeout=timedelta(minutes=timeout_minutes))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 distributed_timeout_minutes=timeout_minutes)
    seed_everything(seed)
    return DistributedInfo(rank=rank, world_size=world, local_rank=local_rank, device=device)


def seed_everything(seed: int) -> None:
    """Python, numpy and torch seeds, plus megatron's model-parallel RNG tracker (differs across TP ranks)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def destroy_distributed() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
