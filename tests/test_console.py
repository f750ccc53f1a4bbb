"""Console hygiene shared by the command-line tools."""

import subprocess
import sys

from conftest import REPO

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
print(frozen)
"""


def test_frozen_imports_leave_what_the_command_makes_to_the_collector(tmp_path):
    out = tmp_path / "written.txt"
    proc = subprocess.run([sys.executable, "-c", _FROZEN_THEN_A_FILE_IN_A_CYCLE, str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) > 100_000  # torch's objects are frozen: no collection walks them again
    assert out.read_text() == "x" * 100
