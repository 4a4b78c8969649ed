"""The exact-signature CUDA-graph runner's bookkeeping, on the CPU with the capture faked: a shape is
captured the second time it is seen, and the least recently used graph goes past the cap."""

import torch

from transfuse.runtime import cuda_graphs
from transfuse.runtime.cuda_graphs import CudaGraphRunner, GraphPool


class _FakeCaptured:
    made: list = []

    def __init__(self, fn, args, static_indices, pool, written=(), checked=()):
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


class _CopyingCapture:
    """CUDA graphs' semantics on the CPU: inputs not read in place live in buffers of the capture
    (filled at every replay), the warm-up runs on copies of the inputs the graph writes, and a
    replay re-runs the function on the buffers and on the caller's in-place inputs."""

    def __init__(self, fn, args, static_indices, pool, written=(), checked=()):
        self.fn, self.static = fn, list(static_indices)
        self.copied = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in self.static]
        self.args = list(args)
        for i in self.copied:
            self.args[i] = args[i].clone()
        warm = list(self.args)
        for i in written:
            warm[i] = args[i].clone()
        fn(*warm)
        self.ptrs = [args[i].data_ptr() for i in self.static]

    def still_valid(self, args):
        return [args[i].data_ptr() for i in self.static] == self.ptrs

    def replay(self, args):
        for i in self.copied:
            self.args[i].copy_(args[i])
        return self.fn(*self.args)


def test_input_written_in_place_reaches_the_callers_tensor_once_per_call(monkeypatch):
    """A graph that writes into an input (a static KV cache; here `cache += x`, which shows a write
    applied twice) must write the caller's tensor, once per call, captured or not."""
    monkeypatch.setattr(cuda_graphs, "_Captured", _CopyingCapture)

    def step(cache, x):
        cache += x
        return (cache.sum(),)

    runner = CudaGraphRunner(step, [], GraphPool(), max_graphs=2, written=[0])
    cache, x = torch.zeros(3), torch.ones(3)
    for call in range(1, 5):  # eager, capture + replay, replay, replay
        (total,) = runner(cache, x)
        assert torch.equal(cache, torch.full((3,), float(call))) and total.item() == 3 * call
    other = torch.zeros(3)  # a new cache tensor (a new generate call): re-captured, written in place
    runner(other, x)
    assert torch.equal(other, torch.ones(3)) and torch.equal(cache, torch.full((3,), 4.0))


def test_written_inputs_found_through_views():
    from transfuse.passes.graph import written_inputs

    seen = {}

    def backend(gm, example_inputs):
        seen["written"] = written_inputs(gm)
        return gm.forward

    def f(cache, x, pos, y, z):
        cache.index_copy_(1, pos, x)  # a static KV cache update
        y.view(-1)[0] = 1.0  # through a view
        z2 = z * 2
        z2 += 1  # a temporary: not an input
        return cache.sum() + z2.sum()

    torch._dynamo.reset()
    torch.compile(f, backend=backend)(torch.zeros(2, 8), torch.ones(2, 1), torch.tensor([3]), torch.zeros(4, 2),
                                      torch.zeros(3))
    names = ["cache", "pos", "x", "y", "z"]  # Dynamo's placeholder order for this function
    assert {names[i] for i in seen["written"]} == {"cache", "y"}


def test_no_more_captures_once_the_cache_thrashes(monkeypatch):
    """Shapes that come round once per cycle, more of them than the cap (generate() over a dynamic
    cache, called again with the same lengths): after half a cache's worth of graphs was evicted
    unreplayed, the runner stops capturing instead of capturing every call."""
    monkeypatch.setattr(cuda_graphs, "_Captured", _FakeCaptured)
    _FakeCaptured.made = []
    runner = CudaGraphRunner(lambda *args: ("eager",), [], GraphPool(), max_graphs=4)
    shapes = [torch.zeros(n, 3) for n in range(1, 17)]
    for _ in range(2):
        [runner(x) for x in shapes]
    assert runner.too_many and runner.wasted == 3
    assert len(_FakeCaptured.made) == 7  # 4 kept + 3 evicted unreplayed, then none
    results = [runner(x) for x in shapes]
    assert len(_FakeCaptured.made) == 7 and results.count(("replayed",)) <= 4  # the kept graphs still replay
    assert "evicted before a replay" in __import__("transfuse.report", fromlist=["x"])._uncaptured_why(runner)


def test_part_of_callers_graph_runs_the_kernels_directly(monkeypatch):
    """In a step the caller captures whole (the decode loop's), the runner neither captures a graph
    of its own nor copies inputs and clones outputs: it calls the function, however often the
    signature comes; outside such a step it captures on the second sighting as before."""
    monkeypatch.setattr(cuda_graphs, "_Captured", _FakeCaptured)
    _FakeCaptured.made = []
    out = torch.ones(3)
    runner = CudaGraphRunner(lambda *args: (out,), [], GraphPool(), max_graphs=2)
    a = torch.zeros(2, 3)
    with cuda_graphs.part_of_callers_graph():
        for _ in range(3):
            result = runner(a)
            assert result[0] is out  # the function's own output: no clone
        with cuda_graphs.part_of_callers_graph():
            assert runner(a)[0] is out
        assert cuda_graphs.run_directly()
    assert not cuda_graphs.run_directly()
    assert _FakeCaptured.made == [] and not runner.graphs
    runner(a), runner(a)
    assert _FakeCaptured.made == [(2, 3)]


class _RefusedCapture:
    tries = 0

    def __init__(self, fn, args, static_indices, pool, written=(), checked=()):
        _RefusedCapture.tries += 1
        raise cuda_graphs.CaptureFailed("RuntimeError: Cannot copy between CPU and CUDA tensors during capture")


def test_a_refused_capture_runs_the_graph_eagerly_from_then_on(monkeypatch):
    """A graph whose capture CUDA refuses (an op inside syncs with the host: Mixtral's grouped-GEMM
    fallback calls .tolist()) gives the eager result on that call and every later one, is not
    captured again, and the report says why."""
    from transfuse.report import _uncaptured_why

    monkeypatch.setattr(cuda_graphs, "_Captured", _RefusedCapture)
    _RefusedCapture.tries = 0
    runner = CudaGraphRunner(lambda x: (x * 2,), [], GraphPool(), max_graphs=4)
    x = torch.arange(6.0).view(2, 3)
    results = [runner(x)[0] for _ in range(4)] + [runner(torch.ones(5, 3))[0] for _ in range(2)]
    assert all(torch.equal(r, x * 2) for r in results[:4]) and torch.equal(results[-1], torch.full((5, 3), 2.0))
    assert _RefusedCapture.tries == 1 and not runner.graphs
    assert runner.uncaptured_calls == 6
    assert "capture was refused" in _uncaptured_why(runner) and "Cannot copy" in _uncaptured_why(runner)


def test_static_buffers_keep_an_expanded_inputs_strides():
    """A graph input broadcast with expand (stride 0: T5's position bias over the batch when the
    attention probabilities are returned) gets a buffer with the same strides, which load() fills."""
    from transfuse.runtime.static_buffers import load, static_buffer

    g = torch.Generator().manual_seed(0)
    for value in (torch.randn(1, 4, 5, 5, generator=g).expand(3, 4, 5, 5),
                  torch.randn(4, 1, generator=g).expand(4, 6).t(),
                  torch.randn(2, 7, generator=g)[:, 1:6],
                  torch.randn(5, generator=g).as_strided((3, 3), (1, 1))):  # overlapping rows: dense buffer
        buf = static_buffer(value)
        assert buf.shape == value.shape
        overlapping = value.stride() == (1, 1)
        assert (buf.stride() == value.stride()) != overlapping
        load(buf, value)
        assert torch.equal(buf, value)
        again = value.neg()  # dense: load reads one slice of it along the buffer's shared dimensions
        load(buf, again)
        assert torch.equal(buf, again)
