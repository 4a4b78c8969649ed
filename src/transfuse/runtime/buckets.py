"""Any input shape from a few CUDA graphs: pad dynamic dimensions up to a bucket, slice outputs back.

Dynamo traces the model once with symbolic batch and sequence sizes; passes/padding.py decides which
of those symbols may be padded without touching the real outputs. At each call this runner

1. reads the real size of every symbol from the inputs,
2. rounds each paddable one up to its bucket (powers of two by default, never past the largest value
   the graph's guards allow, e.g. the position table),
3. replays the CUDA graph captured for that bucket (capturing it on first use; an LRU cap bounds how
   many are kept) after copying the inputs into the leading corner of its static buffers and
   writing the real key lengths that attention reads,
4. returns the leading corner of each output, cloned (a later call never overwrites it).

A size beyond the largest bucket runs without a graph at its exact size; so does every call on a
device without CUDA graphs (the interpreter), where the padding is still applied so that CPU tests
exercise exactly what the GPU does. The padded part of the static buffers keeps whatever an earlier
call left there: real values of earlier inputs, never read as keys (attention stops at key_len), and
only ever flowing into padded rows of the outputs, which are sliced away.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable

import torch

from transfuse.passes.padding import PaddingPlan
from transfuse.runtime import precompile
from transfuse.runtime.cuda_graphs import GraphCache, GraphPool, _Captured, run_directly
from transfuse.runtime.static_buffers import load


class BucketPolicy:
    """Bucket sizes for one dimension: the next power of two, or the next size of a given list."""

    def __init__(self, sizes: list[int] | None = None):
        if sizes is not None and (not sizes or any(int(s) < 1 for s in sizes)):
            raise ValueError(f"buckets must be a non-empty list of positive sizes, got {sizes!r}")
        self.sizes = sorted({int(s) for s in sizes}) if sizes is not None else None

    def __call__(self, n: int, upper: int | None) -> int | None:
        """The bucket for size `n`, or None when `n` is beyond the largest bucket."""
        if self.sizes is None:
            bucket = 1 << max(0, n - 1).bit_length()
        else:
            bucket = next((s for s in self.sizes if s >= n), None)
            if bucket is None:
                return None
        return min(bucket, upper) if upper is not None and n <= upper else bucket


@dataclasses.dataclass
class BucketStats:
    calls: int = 0
    real: int = 0    # product of the real sizes, summed over calls
    padded: int = 0  # product of the bucket sizes, summed over calls


class PaddedRunner(GraphCache):
    """Callable for Dynamo: pads to buckets, replays one graph per bucket (see the module docstring)."""

    def __init__(self, fn: Callable, plan: PaddingPlan, static_indices: list[int], pool: GraphPool,
                 policy: BucketPolicy, use_graphs: bool, max_graphs: int):
        super().__init__(max_graphs)
        self.fn = fn
        self.plan = plan
        self.static_indices = static_indices
        self.pool = pool
        self.policy = policy
        self.use_graphs = use_graphs
        self.symbols = sorted(plan.names, key=str)
        self.stats: dict[tuple, BucketStats] = collections.defaultdict(BucketStats)
        self.exact_calls = 0  # calls beyond the largest bucket (run without a graph)
        self._has_exact_sizes = bool(set(plan.names) - plan.paddable)
        self._dims_of_input: dict[int, list] = collections.defaultdict(list)
        for i, d, s in plan.tensor_dims:
            self._dims_of_input[i].append((d, s))
        self._first_input = min(self._dims_of_input) if self._dims_of_input else None
        self.precompiled: dict | None = None  # what the dry run at the second bucket did
        self.precompiled_first: dict | None = None  # the first bucket's (its own kernels only)
        self._key_len_written: dict | None = {}  # symbol -> the length its key_lens buffer holds (None: not kept)

    # ---- sizes
    def _real_sizes(self, args) -> dict:
        real = {}
        for i, s in self.plan.sym_args.items():
            real[s] = int(args[i])
        for i, d, s in self.plan.tensor_dims:
            real.setdefault(s, args[i].shape[d])
        return real

    def _targets(self, real: dict) -> dict | None:
        """Bucket sizes per symbol. Symbols of equal value in this call are padded alike (an
        attention_mask's length and input_ids' are two symbols that the model expects equal): if
        one of them may not be padded, none is; otherwise they share the smallest bucket."""
        target = {}
        for n, (symbols, paddable) in self._equal_groups(real).items():
            size = n
            if paddable:
                buckets = [self.policy(n, self.plan.upper.get(s)) for s in symbols]
                if any(b is None for b in buckets):
                    return None
                size = min(buckets)
            for s in symbols:
                target[s] = size
        return target

    def _equal_groups(self, real: dict) -> dict:
        """value -> (the symbols of that value in this call, whether all of them may be padded)."""
        groups: dict = collections.defaultdict(list)
        for s, n in real.items():
            groups[n].append(s)
        return {n: (symbols, all(s in self.plan.paddable for s in symbols)) for n, symbols in groups.items()}

    # ---- arguments
    def _set_key_lens(self, real: dict, direct: bool) -> None:
        # An asynchronous fill (no host synchronisation), and only when the length changes: the
        # buffers are written here alone, and a call at the length of the one before (a model served
        # at one shape) skips a launch. Not once a fill may have gone into a caller's own CUDA graph
        # (run_directly): its replays write the buffer behind this record's back.
        if direct:
            self._key_len_written = None
        written = self._key_len_written
        for s, buffer in self.plan.key_lens:
            n = real[s]
            if written is None or written.get(s) != n:
                buffer.fill_(n)
                if written is not None:
                    written[s] = n

    def _padded_args(self, args, real: dict, target: dict) -> list:
        def pad(a, shape):
            buf = a.new_zeros(shape)
            if not a.is_floating_point() and a.numel():
                buf.copy_(_first_value(a).expand(shape))  # integer inputs may be indices (token ids)
            buf[self._corner(a.shape)].copy_(a)
            return buf

        return self._resized(args, target, pad)

    def _resized(self, args, target: dict, make) -> list:
        """args with every symbol at its target size; make(tensor, shape) builds a resized input."""
        out = list(args)
        for i, s in self.plan.sym_args.items():
            out[i] = target[s]
        for i, dims in self._dims_of_input.items():
            a = args[i]
            shape = list(a.shape)
            for d, s in dims:
                shape[d] = target[s]
            if shape != list(a.shape):
                out[i] = make(a, shape)
        return out

    @staticmethod
    def _corner(shape) -> tuple:
        return tuple(slice(0, n) for n in shape)

    def _slice_outputs(self, outputs, real: dict, target: dict, clone: bool):
        result = []
        for out, dims in zip(outputs, self.plan.output_dims):
            if isinstance(out, torch.Tensor) and dims is not None:
                index = [slice(None)] * out.dim()
                trimmed = False
                for d, s in dims:
                    if target[s] != real[s]:
                        index[d] = slice(0, real[s])
                        trimmed = True
                if trimmed:
                    out = out[tuple(index)]
                if clone or trimmed:
                    out = out.clone()
            result.append(out)
        return type(outputs)(result) if isinstance(outputs, tuple) else result

    # ---- calls
    def __call__(self, *args):
        real = self._real_sizes(args)
        target = self._targets(real)
        direct = run_directly()
        if target is None:  # beyond the largest bucket: exact size, no graph
            self.exact_calls += 1
            self._set_key_lens(real, direct)
            return self.fn(*args)
        key = tuple(target[s] for s in self.symbols)
        stats = self.stats[key]
        stats.calls += 1
        # Padding overhead counted on the first dynamic input (e.g. input_ids: batch x seq).
        # (.get: indexing the defaultdict would add a None key, and _padded_args would then index args by it)
        dims = self._dims_of_input.get(self._first_input, [])
        stats.real += math.prod(real[s] for _, s in dims)
        stats.padded += math.prod(target[s] for _, s in dims)
        self._set_key_lens(real, direct)
        # Without graphs, or as part of the caller's own graph (the decode loop's step): run the kernels.
        if not self.use_graphs or direct:
            outputs = self.fn(*self._padded_args(args, real, target))
            return self._slice_outputs(outputs, real, target, clone=False)
        captured = self.lookup(key, args)
        if captured is None:
            # Sizes that cannot be padded (a KV cache that grows every step) make one-off keys:
            # those are captured the second time they come. Pure bucket keys are captured at once.
            if self._has_exact_sizes and key not in self.graphs and self.run_without_graph(key):
                outputs = self.fn(*self._padded_args(args, real, target))
                return self._slice_outputs(outputs, real, target, clone=False)
            padded = self._padded_args(args, real, target)
            if self.precompiled is None and not self.capture_failed:  # first bucket's kernels, at the second every bucket's
                self._precompile(args, padded, target, every_bucket=bool(self.graphs))
            captured = self.capture(lambda: _Captured(self.fn, padded, self.static_indices, self.pool,
                                                      checked=self.checked_by_caller()))
            if captured is None:  # capture refused (see GraphCache.capture): the kernels as they are
                self.uncaptured_calls += 1
                return self._slice_outputs(self.fn(*padded), real, target, clone=False)
            self.store(key, captured)
        self._fill(captured, args, real)
        captured.graph.replay()
        return self._slice_outputs(captured.outputs, real, target, clone=True)

    # ---- precompile (runtime/precompile.py)
    def _precompile(self, args, padded: list, target: dict, every_bucket: bool) -> None:
        """Dry-runs the graph at every bucket it may meet (every_bucket) or at this call's bucket
        only, `padded` (the first capture: a model served at one shape compiles nothing more), its
        Triton kernels compiled in parallel."""
        done = {"buckets": 0, "compiles": 0, "failed": 0, "seconds": 0.0, "skipped": ""}
        if not precompile.enabled():
            self.precompiled = dict(done, skipped=f"{precompile.ENV}=0")
            return
        # Symbols of one value are padded alike (_targets): one size per group.
        bucketed = [symbols for symbols, paddable in self._equal_groups(self._real_sizes(args)).values() if paddable]
        sizes = []
        for symbols in bucketed:
            uppers = [self.plan.upper[s] for s in symbols if self.plan.upper.get(s) is not None]
            lower = max(self.plan.lower.get(s, 0) for s in symbols)
            sizes.append(precompile.bucket_sizes(self.policy, min(uppers) if uppers else None,
                                                 cap=max(64, target[symbols[0]]), lower=lower))
        rows_dims = [s for _, s in self._dims_of_input.get(self._first_input, [])]

        def at(combo) -> dict:
            sizes_now = dict(target)
            for symbols, n in zip(bucketed, combo):
                sizes_now.update(dict.fromkeys(symbols, n))
            return sizes_now

        rows = lambda combo: math.prod(at(combo)[s] for s in rows_dims)  # noqa: E731
        combos = precompile.grid(sizes, rows, max(precompile.MAX_ROWS, math.prod(target[s] for s in rows_dims)))
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        marker = precompile.marker(device, precompile.graph_fingerprint(self.fn),
                                   [sorted(map(str, at(c).values())) for c in combos])
        if marker is not None and marker.exists():
            self.precompiled = dict(done, skipped="compiled by an earlier process (Triton's disk cache has them)")
            return
        if not every_bucket:
            combos = [None]  # this call's bucket: the padded arguments themselves
        failures = 0
        # Forked compile processes pay for themselves over every bucket's few dozen compiles, not
        # over one bucket's handful (runtime/precompile.py).
        with precompile.compile_only(processes=every_bucket) as stats:
            for combo in combos:
                try:
                    self.fn(*(padded if combo is None else self._args_at(args, at(combo))))
                except Exception as e:  # noqa: BLE001 - a dry run only saves time; the real call reports errors
                    failures += 1
                    done.setdefault("error", f"sizes {combo}: {type(e).__name__}: {str(e)[:200]}")
        done.update(stats, buckets=len(combos) - failures, failed_buckets=failures)
        if not every_bucket:
            self.precompiled_first = done
            return
        self.precompiled = done
        if not stats["failed"] and not failures:
            precompile.mark(marker)

    def _args_at(self, args, target: dict) -> list:
        """The call's arguments resized to `target` (a dry run's: values never matter, only shapes;
        integer inputs may be indices, so they hold a value the input has)."""
        return self._resized(args, target, lambda a, shape: _first_value(a).expand(shape).contiguous())

    def _fill(self, captured: _Captured, args, real: dict) -> None:
        for i, buf in captured.inputs:
            if i not in self._dims_of_input:
                load(buf, args[i])
            elif buf.shape == args[i].shape:
                buf.copy_(args[i])  # the bucket's own size: the whole buffer, no view to make
            else:
                buf[self._corner(args[i].shape)].copy_(args[i])

    def bucket_report(self) -> list[str]:
        lines = []
        names = [self.plan.names[s] for s in self.symbols]
        for key, st in sorted(self.stats.items()):
            sizes = ", ".join(f"{n}={v}" for n, v in zip(names, key))
            overhead = st.padded / st.real - 1 if st.real else 0.0
            lines.append(f"{sizes}: {st.calls} call(s), padding +{overhead:.0%}")
        return lines


def _first_value(a: torch.Tensor) -> torch.Tensor:
    """a's first element (zero when a is empty), shaped to broadcast over a tensor of a's rank."""
    return a.reshape(-1)[:1].reshape([1] * a.dim()) if a.numel() else a.new_zeros([1] * a.dim())
