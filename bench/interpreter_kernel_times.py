"""Seconds each Triton kernel spends in the interpreter over a CPU test run: a pytest plugin that times
every interpreted launch and, when its process ends, appends a table to $KERNEL_TIMES (default
/tmp/interpreter-kernel-times.txt). Each xdist worker writes its own table. Dev tool:

    PYTHONPATH=bench TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -n 2 -p interpreter_kernel_times -m "not gpu" tests

Launches are timed whole (the interpreter runs every program of the grid in turn), so a kernel's
time is what CI pays for it, tests of its own and model tests together.
"""

import atexit
import collections
import os
import time

_SECONDS: collections.Counter = collections.Counter()
_LAUNCHES: collections.Counter = collections.Counter()


def pytest_configure(config):
    from triton.runtime import interpreter

    launch = interpreter.GridExecutor.__call__

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return launch(self, *args, **kwargs)
        finally:
            name = getattr(self.fn, "__name__", str(self.fn))
            _SECONDS[name] += time.perf_counter() - start
            _LAUNCHES[name] += 1

    interpreter.GridExecutor.__call__ = timed
    atexit.register(_report)


def _report():
    if not _SECONDS:
        return
    with open(os.environ.get("KERNEL_TIMES", "/tmp/interpreter-kernel-times.txt"), "a") as out:
        out.write(f"total {sum(_SECONDS.values()):.1f}s (seconds, launches, kernel)\n")
        for name, seconds in _SECONDS.most_common(25):
            out.write(f"{seconds:7.2f}s {_LAUNCHES[name]:6d} {name}\n")
