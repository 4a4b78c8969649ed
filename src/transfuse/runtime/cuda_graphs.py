"""Replays a whole optimized forward as one CUDA graph per input signature.

* Parameters and buffers (Dynamo's static inputs) are read in place: their addresses are baked into
  the graph and compared before every replay; a moved parameter re-captures.
* Other inputs are copied into static buffers.
* All graphs of one model share one memory pool (`GraphPool`); replays are sequential, so a graph's
  intermediates may reuse another's.
* Outputs are cloned out of the static buffers: a tensor returned to the user is never overwritten by
  a later call.
* The first call of a signature runs eagerly first (Triton compiles and autotunes there, never inside
  capture), then captures.
* A forward that is one part of a step its caller captures whole (the decode loop's, see
  `part_of_callers_graph`) runs its kernels directly: no graph, input copy or output clone of its own.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from typing import Callable

import torch

from transfuse.kernels import split_counters
from transfuse.runtime.static_buffers import load, static_buffer

log = logging.getLogger("transfuse")


class GraphPool:
    """One CUDA-graph memory pool per optimized model, created on first use, and the stream its
    graphs are warmed up and captured on."""

    def __init__(self):
        self.handle = None
        self._streams: dict[int, torch.cuda.Stream] = {}
        self.graphs_captured = 0
        self.capture_seconds = 0.0
        self.bytes_reserved = 0

    def get(self):
        if self.handle is None:
            self.handle = torch.cuda.graph_pool_handle()
        return self.handle

    def stream(self) -> torch.cuda.Stream:
        """This model's capture stream on the current device, with the split-K kernels' arrival
        counters made for it (they cannot be made during capture; one stream per model: two models'
        graphs replayed on two streams at once never share counters)."""
        index = torch.cuda.current_device()
        found = self._streams.get(index)
        if found is None:
            found = self._streams[index] = torch.cuda.Stream()
            split_counters.reserve(found.device, found)
        return found


def capturing() -> bool:
    """Whether the current CUDA stream is being captured (False on a build without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_CALLER = threading.local()


@contextlib.contextmanager
def part_of_callers_graph():
    """Forwards called in this block belong to a step that the caller captures as one CUDA graph of
    its own, now or right after this eager run (the decode loop). A runner's copies of the inputs
    and clones of the outputs would then be graph nodes replayed every token for nothing, and a
    graph of the runner's own, captured before the caller's, memory spent on a graph never replayed."""
    depth = getattr(_CALLER, "depth", 0)
    _CALLER.depth = depth + 1
    try:
        yield
    finally:
        _CALLER.depth = depth


def run_directly() -> bool:
    """Whether a runner should run its kernels as they are: inside a capture (it is part of the
    caller's graph, whatever the caller said) or in a caller's step (part_of_callers_graph)."""
    return getattr(_CALLER, "depth", 0) > 0 or capturing()


# One C call compares every address (torch's CUDA-graph trees use it); not in every build.
_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


class AddressCheck:
    """Whether the tensors at `indices` of an argument list still have the addresses they had.
    `epoch` counts the resets: a graph captured in an epoch has that epoch's addresses."""

    def __init__(self, args, indices: list[int]):
        self.indices = list(indices)
        self.epoch = 0
        self.reset(args)

    def reset(self, args) -> None:
        self.epoch += 1
        self.ptrs: list = [None] * len(args)
        for i in self.indices:
            self.ptrs[i] = args[i].data_ptr()

    def same(self, args) -> bool:
        if _PTRS_EQUAL is not None:
            return _PTRS_EQUAL(list(args), self.ptrs, self.indices)
        ptrs = self.ptrs
        return all(args[i].data_ptr() == ptrs[i] for i in self.indices)


class CaptureFailed(RuntimeError):
    """CUDA or torch refused to capture a graph that runs eagerly: an op inside it synchronises with
    the host (`.tolist()` in a custom op, a copy from unpinned CPU memory)."""


def first_line(exc: BaseException, limit: int = 200) -> str:
    """'Type: first line of the message' (at most `limit` characters of it), for a report line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:limit] if lines else ''}"


class _Captured:
    """One captured graph. `checked`: static inputs whose addresses the caller checks itself before
    every call (the backend's parameter check, see GraphCache.param_check); the graph checks the
    rest (inputs written in place)."""

    def __init__(self, fn, args, static_indices, pool: GraphPool, written=(), checked=()):
        self.static_indices = static_indices
        checked = set(checked)
        self.addresses = AddressCheck(args, [i for i in static_indices if i not in checked])
        self.inputs = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and i not in static_indices:
                buf = static_buffer(a)
                load(buf, a)
                self.inputs.append((i, buf))
        self.args = list(args)
        for i, buf in self.inputs:
            self.args[i] = buf
        start = time.perf_counter()
        before = torch.cuda.memory_reserved()
        stream = pool.stream()
        stream.wait_stream(torch.cuda.current_stream())
        # Inputs the graph writes in place are warmed up on copies: the replay that follows the
        # capture is the call's one write (twice would add twice for `cache += x`).
        warm = list(self.args)
        for i in written:
            warm[i] = args[i].clone()
        with torch.cuda.stream(stream):
            fn(*warm)  # warm-up: compiles and autotunes every kernel outside capture
        del warm
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph, pool=pool.get(), stream=stream):
                self.outputs = fn(*self.args)
        except Exception as exc:  # noqa: BLE001 - the warm-up ran: only capture itself refuses here
            del self.graph
            raise CaptureFailed(first_line(exc)) from exc
        torch.cuda.synchronize()
        pool.graphs_captured += 1
        pool.capture_seconds += time.perf_counter() - start
        pool.bytes_reserved += max(0, torch.cuda.memory_reserved() - before)

    def still_valid(self, args) -> bool:
        return self.addresses.same(args)

    def replay(self, args):
        for i, buf in self.inputs:
            load(buf, args[i])
        self.graph.replay()
        return type(self.outputs)(o.clone() if isinstance(o, torch.Tensor) else o for o in self.outputs)


class GraphCache:
    """Captured graphs by key, least recently used dropped past `max_graphs`, and the count of keys
    seen without a graph: the bookkeeping both runners share (they differ in what a key is)."""

    def __init__(self, max_graphs: int):
        self.max_graphs = max_graphs
        self.graphs: collections.OrderedDict = collections.OrderedDict()
        self.seen: collections.Counter = collections.Counter()
        self.uncaptured_calls = 0
        self.evicted = 0
        self.hits: dict = {}  # replays per kept graph
        self.wasted = 0  # graphs evicted without a replay
        self.too_many = False  # the cache thrashed (see store): no more captures
        self.capture_failed: str | None = None  # why a capture was refused: no more captures
        # The backend's check of the parameters' addresses, run before every call of this runner
        # (backend.py's compiled()): a graph captured in its current epoch reads parameters where
        # they are, so lookup() compares one number instead of every parameter's address again
        # (bert-base: ~200 of them, a second C call over the list per call). None: each graph
        # checks all of its static inputs itself.
        self.param_check: AddressCheck | None = None
        self.epochs: dict = {}  # key -> param_check's epoch when its graph was captured

    def checked_by_caller(self) -> list[int]:
        """The static inputs param_check covers (what _Captured need not check again)."""
        return self.param_check.indices if self.param_check is not None else []

    def lookup(self, key, args):
        """The graph for key, still valid for args (parameters not moved), or None."""
        captured = self.graphs.get(key)
        if captured is None:
            return None
        if self.param_check is not None and self.epochs.get(key) != self.param_check.epoch:
            return None  # parameters moved since its capture (re-captured by the caller)
        if not captured.still_valid(args):
            return None
        self.graphs.move_to_end(key)
        self.hits[key] = self.hits.get(key, 0) + 1
        return captured

    def run_without_graph(self, key) -> bool:
        """Counts a key that has no graph; True when the caller should run it without one: the first
        time a key comes (exact shapes that never repeat, a dynamic KV cache growing every token,
        pay no capture), and always once the cache thrashes (see store)."""
        self.seen[key] += 1
        if len(self.seen) > 4096:  # one-off keys must not grow this forever
            self.seen = collections.Counter({key: self.seen[key]})
        if self.seen[key] < 2 or self.too_many or self.capture_failed:
            self.uncaptured_calls += 1
            return True
        return False

    def capture(self, make: Callable[[], _Captured]) -> _Captured | None:
        """make(), or None when capture is refused. A refused capture (CaptureFailed) is not retried:
        the graph runs eagerly from then on, as it did in its warm-up, and the report says why."""
        if self.capture_failed:
            return None
        try:
            return make()
        except CaptureFailed as exc:
            self.capture_failed = str(exc)
            log.warning("transfuse: a graph runs without CUDA graphs: capture was refused (%s)", exc)
            return None

    def store(self, key, captured: _Captured) -> _Captured:
        self.graphs[key] = captured
        self.graphs.move_to_end(key)
        self.hits[key] = 0
        self.epochs[key] = self.param_check.epoch if self.param_check is not None else None
        while len(self.graphs) > self.max_graphs:
            old, _ = self.graphs.popitem(last=False)
            self.epochs.pop(old, None)
            self.evicted += 1
            # Evicted before its first replay: more distinct shapes come round than the cap holds
            # (generate() called again over a dynamic cache: 128 token lengths, each once per call).
            # Past half a cache's worth of those, capturing costs more than it saves: stop.
            if self.hits.pop(old, 0) == 0:
                self.wasted += 1
                self.too_many = self.too_many or self.wasted > max(2, self.max_graphs // 2)
        return captured


class CudaGraphRunner(GraphCache):
    """Callable for Dynamo: routes each exact input signature to its captured graph (the runner of
    graphs whose dimensions cannot be padded to buckets, see runtime/buckets.py). A signature is
    captured the second time it is seen (GraphCache.run_without_graph)."""

    def __init__(self, fn: Callable, static_indices: list[int], pool: GraphPool, max_graphs: int = 32,
                 written: list[int] = ()):
        super().__init__(max_graphs)
        self.fn = fn
        self.static_indices = static_indices
        # Inputs the graph writes in place: read at their own address like parameters (a copy would
        # take the writes), their shapes still part of the signature.
        self.written = list(written)
        self.in_place = sorted(set(static_indices) | set(written))
        self.pool = pool
        self.dynamic_indices: list[int] | None = None

    def signature(self, args) -> tuple:
        if self.dynamic_indices is None:
            static = set(self.static_indices)
            self.dynamic_indices = [i for i in range(len(args)) if i not in static]
        out = []
        for i in self.dynamic_indices:
            a = args[i]
            out.append((a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else a)
        return tuple(out)

    def __call__(self, *args):
        if run_directly():
            return self.fn(*args)  # part of the caller's own graph (the decode loop's step)
        key = self.signature(args)
        captured = self.lookup(key, args)
        if captured is None:
            if key not in self.graphs and self.run_without_graph(key):
                return self.fn(*args)  # fresh outputs: nothing static to protect
            captured = self.capture(lambda: _Captured(self.fn, args, self.in_place, self.pool, self.written,
                                                      checked=self.checked_by_caller()))
            if captured is None:
                self.uncaptured_calls += 1
                return self.fn(*args)
            self.store(key, captured)
        return captured.replay(args)
