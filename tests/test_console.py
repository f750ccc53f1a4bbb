"""Console hygiene shared by the command-line tools."""

import json
import subprocess
import sys

from conftest import REPO, cli_env, json_from_fresh_process

_FROZEN_THEN_A_FILE_IN_A_CYCLE = """
import gc, sys
import torch
from grt_megatron.console import freeze_imported_objects

freeze_imported_objects()
frozen = gc.get_freeze_count()


class Holder:
    pass


# Made after the freeze and alive in a reference cycle until exit: the teardown's collection must still
# finalise it, or its buffered write is lost.
holder = Holder()
holder.me, holder.file = holder, open(sys.argv[1], "w")
holder.file.write("x" * 100)
print("FROZEN", frozen)
"""


def test_frozen_imports_leave_what_the_command_makes_to_the_collector(tmp_path):
    out = tmp_path / "written.txt"
    frozen = json_from_fresh_process(_FROZEN_THEN_A_FILE_IN_A_CYCLE, [str(out)], "FROZEN ", timeout=120)
    assert frozen > 100_000  # torch's objects are frozen: no collection walks them again
    assert out.read_text() == "x" * 100


_GC_STATE_IN_TRAINING = """
import gc, json, sys
from grt_megatron.training import cli, trainer

seen, step = [], trainer.Trainer._train_step

def recorded(self, *args, **kwargs):
    seen.append([gc.isenabled(), gc.get_freeze_count()])
    return step(self, *args, **kwargs)

trainer.Trainer._train_step = recorded
sys.argv = ["grt-train", *sys.argv[1:]]
cli.main()
print("GC " + json.dumps(seen))
"""


def test_grt_train_trains_with_the_collector_on_and_its_imports_frozen(pydoc_prefix, tmp_path):
    """Off while importing, frozen after: every step runs with the collector on (a run's own garbage is
    collected) and the imported objects out of its walks."""
    seen = json_from_fresh_process(_GC_STATE_IN_TRAINING, [
        "model=tiny", f"data={pydoc_prefix[0]}", "train.iters=2", "train.global_batch_size=2", "train.eval_iters=1",
        "logging.wandb=disabled", "logging.progress=false", f"run.dir={tmp_path}"], "GC ", timeout=300)
    assert len(seen) == 2 and all(enabled and frozen > 100_000 for enabled, frozen in seen), seen


_ACCELERATOR_NAMED_AT_DEEPSPEEDS_IMPORT = """
import json, os, sys
os.environ.pop("DS_ACCELERATOR", None)
from grt_megatron.console import quiet_known_warnings

quiet_known_warnings()
before = {"torch": "torch" in sys.modules, "named": "DS_ACCELERATOR" in os.environ}
import deepspeed
print("@@", json.dumps({**before, "after": os.environ.get("DS_ACCELERATOR")}))
"""


def test_deepspeeds_accelerator_is_named_at_its_import_and_torch_is_not_imported_before():
    """A command that never imports DeepSpeed never imports torch for it (`grt-ckpt show`: 0.1 s, not 3 s);
    one that does gets the accelerator named, so DeepSpeed does not warn that it detected one."""
    # (the script unsets DS_ACCELERATOR itself: this process's own DeepSpeed import may have set it)
    proc = subprocess.run([sys.executable, "-c", _ACCELERATOR_NAMED_AT_DEEPSPEEDS_IMPORT], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.split("@@")[-1]) == {"torch": False, "named": False, "after": "cpu"}
    assert "Setting accelerator" not in proc.stdout + proc.stderr


def test_torchs_no_cuda_runtime_notice_is_dropped_and_its_other_messages_kept():
    """A CUDA build of torch on a node with a CUDA toolkit and no GPU logs "No CUDA runtime is found" from
    torch.utils.cpp_extension when megatron-core imports it; before a refusal's one line, that made two.
    (torch's CPU build never logs it, so the logger is called as torch 2.11's cpp_extension.py:140 calls it.)"""
    import logging

    from grt_megatron.console import quiet_known_warnings

    quiet_known_warnings()
    quiet_known_warnings()  # twice: still one filter
    log = logging.getLogger("torch.utils.cpp_extension")
    assert len(log.filters) == 1
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log.addHandler(handler)
    try:
        log.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local")
        log.warning("Error checking compiler version for %s", "c++")
    finally:
        log.removeHandler(handler)
    assert seen == ["Error checking compiler version for c++"]
