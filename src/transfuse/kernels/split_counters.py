"""Arrival counters for split-K kernels that finish in their last program (gemm_few_rows).

A split launch writes each split's fp32 partials; the program that arrives last at a column block
(an atomic ticket per block) sums them and runs the epilogue, then sets the ticket back to zero.
That saves the separate reduce kernel, whose launch cost more than the split gained (5-15% slower
on every decode shape, bench/results/2026-11-26-*-few-rows-sweep-session15.log).

The counters must be zero when a launch starts, and allocating them must not happen inside CUDA
graph capture (a zeroed tensor made there would live in the graph's pool). So they are made once,
outside capture, per (device, stream): launches on one stream run one after another and each leaves
its counters at zero; launches on two streams never share counters. Capture runs on a stream of its
own (runtime/cuda_graphs.GraphPool.stream reserves its counters first); a capture on a stream that
has none gets None, and the launcher does not split.
"""

from __future__ import annotations

import contextlib

import torch

# Column blocks one split launch may count: a linear with more already has a program per SM.
CAPACITY = 4096
_COUNTERS: dict[tuple, torch.Tensor] = {}
_MAX_STREAMS = 256  # streams made per call in user code must not grow this without bound


def _key(device: torch.device, stream) -> tuple:
    if device.type != "cuda":
        return (device.type, device.index)
    return (device.type, device.index, stream.cuda_stream)


def counters(device: torch.device, blocks: int) -> torch.Tensor | None:
    """Zeroed int32 counters of the current stream for `blocks` column blocks, or None: more blocks
    than CAPACITY, or a stream under capture whose counters were not reserved before."""
    if blocks > CAPACITY:
        return None
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    found = _COUNTERS.get(_key(device, stream))
    if found is not None:
        return found
    if stream is not None and torch.cuda.is_current_stream_capturing():
        return None
    return reserve(device, stream)


def reserve(device: torch.device, stream=None) -> torch.Tensor:
    """Makes (once) the counters of `stream` (the current stream by default) on `device`, outside
    capture."""
    device = torch.device(device)
    if device.type == "cuda" and stream is None:
        stream = torch.cuda.current_stream(device)
    key = _key(device, stream)
    found = _COUNTERS.get(key)
    if found is None:
        if len(_COUNTERS) >= _MAX_STREAMS:
            # The oldest stream's counters go: the caching allocator hands their memory to another
            # tensor only after that stream's queued work, a launch still counting on it included.
            _COUNTERS.pop(next(iter(_COUNTERS)))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            found = _COUNTERS[key] = torch.zeros(CAPACITY, dtype=torch.int32, device=device)
    return found
