"""Latency measurement for whole-model calls.

What a user waits for is the time from handing the model its inputs to having the outputs, so each
timed call starts on an idle GPU (synchronize, then record the start event) and ends with an event
recorded after the call returns. Launch overhead is therefore inside the measurement, which is the
point: CUDA graphs exist to remove it.

- warm-up calls first (compilation, autotuning, graph capture and allocator growth happen there);
- many timed calls, each bracketed by its own pair of CUDA events, summarised by the median (robust
  to the odd slow call) with p10 and p90 to show the spread;
- inputs rotate through several sets, so a provider cannot win by finding last call's inputs hot in
  L2 (bert-base weights, 220 MB in fp16, do not fit H100's 50 MB L2 anyway; inputs would).

Without CUDA (the CPU tests) the same code times with `time.perf_counter`.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch


@dataclass
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    n: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(samples_ms: Sequence[float]) -> Timing:
    return Timing(
        median_ms=percentile(samples_ms, 50),
        p10_ms=percentile(samples_ms, 10),
        p90_ms=percentile(samples_ms, 90),
        n=len(samples_ms),
    )


def _call(fn: Callable, args: Any) -> Any:
    if isinstance(args, dict):
        return fn(**args)
    if isinstance(args, (tuple, list)):
        return fn(*args)
    return fn(args)


def _use_cuda(cuda: bool | None) -> bool:
    return torch.cuda.is_available() if cuda is None else cuda


def synchronize(cuda: bool | None = None) -> None:
    if _use_cuda(cuda):
        torch.cuda.synchronize()


def time_first_call(fn: Callable, args: Any, cuda: bool | None = None) -> tuple[float, Any]:
    """Wall seconds of one call, synchronized on both sides (so compilation and capture count), and its result."""
    synchronize(cuda)
    start = time.perf_counter()
    out = _call(fn, args)
    synchronize(cuda)
    return time.perf_counter() - start, out


def measure(
    fn: Callable,
    arg_sets: Sequence[Any],
    *,
    warmup: int = 10,
    iters: int = 100,
    cuda: bool | None = None,
) -> Timing:
    """Median/p10/p90 latency in ms of `fn` over `iters` calls after `warmup` calls.

    `arg_sets` holds one or more inputs (a dict is passed as keywords, a tuple as positionals); call
    i uses arg_sets[i % len(arg_sets)]. Outputs are dropped at once so that no call's memory is held
    across the next one.
    """
    if not arg_sets:
        raise ValueError("measure needs at least one set of inputs")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    use_cuda = _use_cuda(cuda)
    for i in range(warmup):
        _call(fn, arg_sets[i % len(arg_sets)])
    synchronize(use_cuda)

    samples: list[float] = []
    if use_cuda:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            args = arg_sets[i % len(arg_sets)]
            torch.cuda.synchronize()  # start each call on an idle GPU: launch overhead is measured
            starts[i].record()
            _call(fn, args)
            ends[i].record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for i in range(iters):
            args = arg_sets[i % len(arg_sets)]
            t0 = time.perf_counter()
            _call(fn, args)
            samples.append((time.perf_counter() - t0) * 1e3)
    return summarize(samples)


def graph_replay_us(fn: Callable[[], Any], repeat: int = 50, replays: int = 30) -> float:
    """Microseconds per call of `fn` (a few kernel launches) captured `repeat` times into one CUDA
    graph: the median over `replays` replays, each timed between CUDA events. Launch overhead is
    gone, so this is the kernels' own time plus the gaps a graph keeps between them (kernel
    microbenchmarks; whole-model calls use `measure`). Warm-up calls run on a side stream first,
    so that compilation and tuning happen outside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / repeat)
    return percentile(times, 50)
