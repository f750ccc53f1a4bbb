"""Console hygiene shared by the command-line tools."""

from __future__ import annotations

import gc
import importlib
import importlib.abc
import logging
import os
import sys
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
    # A CUDA build of torch on a node without a GPU but with a CUDA toolkit (a login node preparing data)
    # logs this when megatron-core imports torch.utils.cpp_extension; nothing here builds an extension, and
    # the line came before a refusal's one line.
    cpp_extension_log = logging.getLogger("torch.utils.cpp_extension")
    if _NoCudaRuntimeNotice not in {type(f) for f in cpp_extension_log.filters}:
        cpp_extension_log.addFilter(_NoCudaRuntimeNotice())
    name_deepspeed_accelerator_at_its_import()


class _NoCudaRuntimeNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


class _NameDeepSpeedAccelerator(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == "deepspeed" and "DS_ACCELERATOR" not in os.environ:
            import torch  # DeepSpeed's first import statement: nothing is imported that it would not

            os.environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else "cpu"
        return None  # the usual finders find it


def name_deepspeed_accelerator_at_its_import() -> None:
    """Naming DeepSpeed's accelerator skips its detection warning ("Setting accelerator to CPU"). The name
    needs torch (is CUDA there?), so it is set when DeepSpeed is first imported, not up front: a command
    that never imports DeepSpeed (`grt-ckpt ls/show`: 0.1 s) then never imports torch either (3 s)."""
    if "DS_ACCELERATOR" in os.environ or "deepspeed" in sys.modules:
        return
    if not any(isinstance(f, _NameDeepSpeedAccelerator) for f in sys.meta_path):
        sys.meta_path.insert(0, _NameDeepSpeedAccelerator())


def collect_nothing_while_importing() -> None:
    """Call first thing in a command that imports torch, megatron-core and DeepSpeed. Those imports make
    ~0.75 M tracked objects, and the collector's automatic full passes over them (7 in a grt-train start,
    ~0.7 s on a 2-core CPU) free little: one full collection after the imports finds 11 k unreachable
    objects, and the resident size stays 406 MB. `freeze_imported_objects` turns it back on."""
    gc.disable()


def freeze_imported_objects() -> None:
    """Call once a command has imported what it runs: the collector is turned back on and no longer walks
    what the imports made, neither in a full collection during the run (~0.27 s each unfrozen on a 2-core
    CPU; a host stall on a GPU) nor in the interpreter's teardown (~1.5 s of grt-train's exit here). What
    the command creates afterwards is collected and finalised as usual. (Megatron-LM's manual GC and
    torchtitan's gc_freq tame the same walks.)"""
    gc.freeze()
    gc.enable()


def import_frozen(*modules: str) -> None:
    """For a command other than grt-train (which splits the two around hydra's start): import the heavy
    packages it is about to use anyway with the collector off, then `freeze_imported_objects`. An export,
    a generation or a report then exits ~1.5 s sooner (teardown no longer walks torch, megatron-core and
    transformers), and a long evaluation's collections walk only what it made. A package left off the list
    is imported later, unfrozen, and collected as usual: slower, never wrong."""
    collect_nothing_while_importing()
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        freeze_imported_objects()
