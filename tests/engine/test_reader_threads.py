"""The file tier's reader threads at the interpreter's exit: a read still under way is finished, then the threads end,
before the interpreter finalizes. A daemon thread still inside a torch call then (one that let go of the interpreter's
lock) is ended as it takes the lock back, which C++ code cannot unwind through: the process aborted with "terminate
called without an active exception" after its work was done (seen on the CI's Python 3.13 build)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import time, types
    import torch
    from streamwise.runtime.engine.file_reads import FileTier

    source = torch.ones(8 << 20)

    class SlowFile:  # a read that takes a while, in torch calls that let go of the interpreter's lock
        def read_into(self, ranges):
            scratch, end = torch.empty_like(source), time.perf_counter() + 0.4
            while time.perf_counter() < end:
                scratch.copy_(source)

    rows = types.SimpleNamespace(file=SlowFile(), offset=0, nbytes=64 * 16, shape=(64, 4), dtype=torch.float32)
    weight = types.SimpleNamespace(range=rows, dtype=torch.float32)
    tier = FileTier(largest=1 << 20)
    pending = [tier.read_rows_ahead(weight, [(0, 8)]), tier.read_rows_ahead(weight, [(8, 16)])]
    assert all(pending)
    time.sleep(0.05)  # both reader threads inside their read
    print("done", flush=True)
""")


def test_the_interpreter_exits_cleanly_while_a_read_ahead_is_under_way():
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == "done", (done.returncode, done.stderr[-2000:])
        assert "terminate called" not in done.stderr
