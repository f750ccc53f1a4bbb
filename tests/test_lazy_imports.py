"""grt_megatron/lazy_imports.py: wandb, which megatron-core imports eagerly, runs its import at its first use;
until then megatron-core sees it installed; once used it is the package a normal import gives."""

import subprocess
import sys

from conftest import REPO, cli_env, json_from_fresh_process


def test_importing_the_trainer_leaves_wandb_unloaded_until_a_run_uses_it():
    script = """
import json, sys
import grt_megatron.training.trainer
import megatron.core.inference.contexts.dynamic_context as context
before = {"loaded": "wandb.sdk" in sys.modules, "have_wandb": context.HAVE_WANDB}
import wandb
run = wandb.init(mode="disabled")
print("@@", json.dumps({**before, "after": "wandb.sdk" in sys.modules, "run": type(run).__name__,
                        "module": type(sys.modules["wandb"]).__name__, "same": context.wandb is sys.modules["wandb"]}))
"""
    got = json_from_fresh_process(script, [], "@@", timeout=300)
    assert got == {"loaded": False, "have_wandb": True, "after": True, "run": "NoopRun", "module": "module",
                   "same": True}


def _package(tmp_path, init_source):
    pkg = tmp_path / "grt_lazy_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(init_source)
    (pkg / "sub.py").write_text("from grt_lazy_probe import VALUE\nDOUBLE = 2 * VALUE\n")
    return tmp_path


def _run(tmp_path, body):
    script = f"""
import sys
sys.path.insert(0, {str(tmp_path)!r})
from grt_megatron.lazy_imports import load_at_first_use
assert load_at_first_use("grt_lazy_probe") and not load_at_first_use("grt_lazy_probe")
assert not load_at_first_use("grt_no_such_package")
{body}
"""
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                          timeout=120)


def test_the_package_runs_once_at_the_first_name_read_and_before_its_submodules(tmp_path):
    root = _package(tmp_path, "import inspect, sys\nprint('ran', flush=True)\nVALUE = 21\n")
    proc = _run(root, """
import inspect, grt_lazy_probe
print("imported", flush=True)
inspect.getmodule(inspect)  # reads __file__ of every module in sys.modules: not a use
print("file", grt_lazy_probe.__file__.endswith("__init__.py"), flush=True)
import grt_lazy_probe.sub  # the package's __init__ runs first, as in a normal import
print(grt_lazy_probe.VALUE, grt_lazy_probe.sub.DOUBLE, type(grt_lazy_probe).__name__)
""")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n") == ["imported", "file True", "ran", "21 42 module", ""]


def test_a_package_whose_import_fails_fails_at_its_first_use_and_again_at_the_next_import(tmp_path):
    root = _package(tmp_path, "raise ImportError('grt_lazy_probe needs libfoo')\n")
    proc = _run(root, """
import grt_lazy_probe
try:
    grt_lazy_probe.VALUE
except ImportError as err:
    print("first:", err, "grt_lazy_probe" in sys.modules)
try:
    import grt_lazy_probe
except ImportError as err:
    print("again:", err)
""")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n") == ["first: grt_lazy_probe needs libfoo False",
                                       "again: grt_lazy_probe needs libfoo", ""]
