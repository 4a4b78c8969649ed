"""The exact-signature CUDA-graph runner's bookkeeping, on the CPU with the capture faked: a shape is
captured the second time it is seen, and the least recently used graph goes past the cap."""

import torch

from transfuse.runtime import cuda_graphs
from transfuse.runtime.cuda_graphs import CudaGraphRunner, GraphPool


class _FakeCaptured:
    made: list = []

    def __init__(self, fn, args, static_indices, pool):
        _FakeCaptured.made.append(tuple(args[0].shape))

    def still_valid(self, args):
        return True

    def replay(self, args):
        return ("replayed",)


def test_capture_on_second_sighting_and_lru(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "_Captured", _FakeCaptured)
    _FakeCaptured.made = []
    runner = CudaGraphRunner(lambda *args: ("eager",), [], GraphPool(), max_graphs=2)
    a, b, c = torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(5, 3)
    assert runner(a) == ("eager",)  # seen once: no capture for a shape that may never return
    assert runner(a) == ("replayed",) and _FakeCaptured.made == [(2, 3)]
    assert runner(b) == ("eager",) and runner(b) == ("replayed",)
    assert runner(a) == ("replayed",)  # a is now the most recently used
    runner(c), runner(c)
    assert list(runner.graphs) == [runner.signature((a,)), runner.signature((c,))]  # b evicted
    assert runner.evicted == 1 and runner.uncaptured_calls == 3
    assert _FakeCaptured.made == [(2, 3), (4, 3), (5, 3)]
