"""Every RNG a rank draws from, as tensors and strings (safetensors), so resumed dropout repeats.

DeepSpeed's checkpoints do not hold RNG states; without them a resumed run with dropout draws other
masks than the uninterrupted one. Noise and depth draws need no state: they are keyed by (seed, step).
"""

from __future__ import annotations

import json
import random

import numpy as np
import torch
from megatron.core import tensor_parallel
from safetensors import safe_open
from safetensors.torch import save as save_tensors


def capture_rng() -> bytes:
    """This rank's Python, numpy, torch (CPU and CUDA) and megatron tracker states, as safetensors bytes."""
    version, py_state, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tensors = {
        "python": torch.tensor(py_state, dtype=torch.int64, device="cpu"),  # host: written to a file
        "numpy": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        tensors["torch_cuda"] = torch.cuda.get_rng_state()
    for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        tensors[f"tracker/{name}"] = state.clone()
    meta = {"python": json.dumps([version, gauss]), "numpy": json.dumps([np_kind, int(np_pos), int(np_has_gauss),
                                                                          float(np_gauss)])}
    return save_tensors(tensors, metadata=meta)


def rng_fits_this_device(path) -> bool:
    """Whether `path`'s megatron tracker states can be set here. They are the generator states of the device
    that drew them: a CUDA Philox state (16 bytes) on a GPU, a CPU generator's (5,056 bytes) under the CPU
    shim, and neither can be set into the other (torch: "RNG state is wrong size"). A checkpoint written on
    one kind of device and resumed on the other is reseeded instead, as a changed layout is."""
    with safe_open(str(path), framework="pt") as f:
        saved = {k.split("/", 1)[1]: list(f.get_slice(k).get_shape()) for k in f.keys() if k.startswith("tracker/")}
    current = {name: list(state.shape) for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    return all(current.get(name, shape) == shape for name, shape in saved.items())


def restore_rng(path) -> None:
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    version, gauss = json.loads(metadata["python"])
    random.setstate((version, tuple(int(v) for v in tensors["python"].tolist()), gauss))
    np_kind, np_pos, np_has_gauss, np_gauss = json.loads(metadata["numpy"])
    np.random.set_state((np_kind, tensors["numpy"].numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available() and "torch_cuda" in tensors:
        torch.cuda.set_rng_state(tensors["torch_cuda"])
    tracker = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("tracker/")}
    if tracker:
        tensor_parallel.get_cuda_rng_tracker().set_states(tracker)
