"""Compile every bucket's Triton kernels at once, in parallel, when a second bucket comes.

A model served at many shapes needs a few dozen Triton variants (attention per sequence regime, GEMM
tiles per row regime, ...). Compiled one by one as each bucket first comes, they were most of a cold
start: ~40 compiles, 1-2 s each once a new bucket came (bench/results/*triton-variants-cold-stream*).
Compiles run in parallel (forked processes; see compile_only for how much).

So when a bucketed runner is about to capture its second bucket (the first capture compiles only its
own bucket's kernels, in the same way: a model served at one shape pays nothing more), it dry-runs
its graph once per bucket it may meet, in `compile_only()`: every Triton launch becomes Triton's own
compile-without-launch (`warmup=True`), queued on a thread pool (Triton's AsyncCompileMode) whose
threads hand each compile to a forked process and load its binary back (_ForkedCompiles);
autotuned kernels queue every config they would time; the GEMM dispatcher queues its Triton
candidates and times nothing. Outputs of a dry run are never read (kernels do not run; their outputs
hold whatever memory held). The block waits for every compile; later launches find their binaries in
Triton's in-memory cache.

A marker on disk (keyed by GPU, versions, kernel sources, Triton's cache directory, the graph and its
buckets) says that an earlier process compiled the same set: then nothing is dry-run and the first
launches read Triton's disk cache as before. TRANSFUSE_PRECOMPILE=0 turns this off.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import re
import time
import warnings
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import torch

from transfuse.kernels._config import COMPILE_ONLY, dry_run_launches

ENV = "TRANSFUSE_PRECOMPILE"
PROCESSES_ENV = "TRANSFUSE_PRECOMPILE_PROCESSES"
# A forked worker's compile (its wait in the queue included) given up on after this long, and done in
# this process instead: a worker can only hang on a lock that another thread held when it was forked.
REMOTE_TIMEOUT_S = 300.0
# A dry run allocates every intermediate of a forward at the bucket's size: buckets above this many
# rows of the first dynamic input (e.g. batch x seq tokens) are not dry-run, unless the call that
# triggers the precompile is itself that large. Above a few thousand rows the GEMMs are cuBLAS's and
# the sequence regimes of attention are already met at batch 1.
MAX_ROWS = 2048


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip() != "0"


@contextlib.contextmanager
def compile_only(workers: int | None = None, processes: bool = True):
    """Inside: Triton launches compile in a thread pool (Triton's AsyncCompileMode) and do not run.
    On exit: waits for every compile; a failed one is dropped (its first real launch compiles it
    again and reports its error there). Yields a dict that holds {"compiles", "failed", "seconds",
    "dry_run_seconds", "how"} after the block.

    Where the platform forks (Linux), each compile runs first in a forked process (_ForkedCompiles):
    in threads alone, Triton's Python code generator and its MLIR passes hold the interpreter lock,
    and bert-base's 48 variants, 36 s of compiling one at a time, took 12.4 s in 16 threads (4.3 at
    once on average, the dry run itself slowed 4.8 -> 11.1 s by the lock: bench/precompile_phases.py,
    H200, 2026-11-29; 4.7-4.9 s in 16 forked processes, the dry run 3.5 s). Forked processes start
    in a fraction of a second, where fresh ones each start torch and Triton first (19 s for 44
    variants on an H100, session 11); still, for a handful of compiles (`processes=False`: a first
    bucket's) starting them costs more than they save. TRANSFUSE_PRECOMPILE_PROCESSES=0 keeps every
    compile in threads."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    stats = {"compiles": 0, "failed": 0, "seconds": 0.0, "how": ""}
    workers = workers or min(16, os.cpu_count() or 1)
    jit_run, tune_run, jit_do_compile = JITFunction.run, Autotuner.run, JITFunction._do_compile
    touched: dict = {}

    def do_compile(self, key, signature, device, *rest):
        kernel = jit_do_compile(self, key, signature, device, *rest)
        if kernel is not None and COMPILE_ONLY.get():
            # The queued compile stands in the kernel cache until it finishes, as Triton 3.8 does
            # itself. Triton 3.6 leaves it out, so every later launch of the variant in the dry run
            # packed its arguments and hashed its source again: bert-base's 51 variants were "compiled"
            # 4,637 times in its stream's dry run (cProfile, H200, 2026-11-29).
            self.device_caches[device][0][key] = kernel
        return kernel

    def run(self, *args, grid, warmup, **kwargs):
        if COMPILE_ONLY.get():
            touched[id(self)] = self
            warmup = True
        return jit_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def tune(self, *args, **kwargs):
        if not COMPILE_ONLY.get():
            return tune_run(self, *args, **kwargs)
        # Every config the autotuner would time, compiled; none timed or chosen here (timing no-ops
        # would cache a meaningless choice). Pre-hooks (zeroing for split-K) are not run: nothing runs.
        self.nargs = dict(zip(self.arg_names, args))
        configs = self.prune_configs(kwargs) if len(self.configs) > 1 else self.configs
        for config in configs:
            self.fn.run(*args, **kwargs, **config.all_kwargs())
        self.nargs = None

    start = time.perf_counter()
    threads = _ThreadCompiles(workers, processes=processes and _processes_enabled())
    try:
        with threads, dry_run_launches():
            token = COMPILE_ONLY.set(True)
            JITFunction.run, Autotuner.run, JITFunction._do_compile = run, tune, do_compile
            try:
                yield stats
            finally:
                COMPILE_ONLY.reset(token)
                JITFunction.run, Autotuner.run, JITFunction._do_compile = jit_run, tune_run, jit_do_compile
                stats["dry_run_seconds"] = time.perf_counter() - start
        _forget(touched.values(), threads.failed_kernels)
        stats.update(compiles=threads.compiles, failed=threads.failed, how=threads.how())
    finally:
        stats["seconds"] = time.perf_counter() - start


class _ThreadCompiles:
    """Triton's AsyncCompileMode over a thread pool (whose compiles first run in forked processes
    where `processes`); without the mode (an older Triton) the dry run's launches compile one by one
    as it meets them."""

    def __init__(self, workers: int, processes: bool = False):
        self.workers = workers
        self.processes = processes
        self.compiles = self.failed = 0
        self.failed_kernels: list = []

    def __enter__(self):
        try:
            from triton.runtime._async_compile import AsyncCompileMode
        except ImportError:
            self.mode = None
            return self
        self.pool = None
        if self.processes:
            self.pool = _ForkedCompiles.start(self.workers)
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="transfuse-compile")
        self.mode = AsyncCompileMode(self.pool)
        self.mode.__enter__()
        return self

    def how(self) -> str:
        if self.mode is None:
            return "series (no AsyncCompileMode)"
        return f"{self.workers} forked processes" if isinstance(self.pool, _ForkedCompiles) else f"{self.workers} threads"

    def __exit__(self, *exc):
        if self.mode is None:
            return False
        for future_kernel in list(self.mode.future_kernels.values()):
            try:
                future_kernel.result()
            except Exception:  # noqa: BLE001 - reported by the real launch, see compile_only
                self.failed_kernels.append(future_kernel)
        # The mode's exit waits on its futures again and would raise a failed one's error.
        self.mode.raw_futures[:] = [f for f in self.mode.raw_futures if f.exception() is None]
        self.compiles = len(self.mode.future_kernels)
        self.failed = len(self.failed_kernels)
        self.mode.__exit__(None, None, None)
        self.pool.shutdown()
        return False


def _processes_enabled() -> bool:
    return os.environ.get(PROCESSES_ENV, "1").strip() != "0"


class _ForkedCompiles(Executor):
    """The executor handed to Triton's AsyncCompileMode when compiles run in processes.

    Triton submits each compile as a closure over its ASTSource, target, options and environment.
    The compile runs first in a forked worker, from those values (_compile_in_worker): code
    generation, MLIR, LLVM and ptxas, its binary written to Triton's disk cache. Then Triton's own
    closure runs here in a thread, finds the binary in the disk cache and only loads it. Whatever
    the worker cannot do (a kernel not defined at module level, a value that does not pickle, an
    error) the thread's own call does as before, and reports its error as before."""

    def __init__(self, workers: int, processes: ProcessPoolExecutor):
        self.processes = processes
        self.threads = ThreadPoolExecutor(workers, thread_name_prefix="transfuse-compile")
        self.stalled = False  # a worker's compile outlived REMOTE_TIMEOUT_S

    @classmethod
    def start(cls, workers: int) -> "_ForkedCompiles | None":
        """Forks the workers now, from this thread, before any compile thread exists (a fork copies
        only the forking thread; locks other threads hold would stay held in the child). None where
        the platform does not fork or the fork fails."""
        if "fork" not in multiprocessing.get_all_start_methods():
            return None
        processes = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded, use of fork()"
                for ready in [processes.submit(os.getpid) for _ in range(workers)]:
                    ready.result(timeout=60)
        except Exception:  # noqa: BLE001 - threads alone compile everything, only slower
            _terminate(processes)
            return None
        return cls(workers, processes)

    def submit(self, fn, /, *args, **kwargs):
        spec, remote = _compile_spec(fn), None
        if spec is not None:
            try:
                remote = self.processes.submit(_compile_in_worker, spec)
            except RuntimeError:  # a broken pool (a worker killed): the thread compiles it alone
                remote = None
        return self.threads.submit(self._load_after, remote, fn, *args, **kwargs)

    def _load_after(self, remote, fn, *args, **kwargs):
        if remote is not None:
            try:
                remote.result(timeout=REMOTE_TIMEOUT_S)
            except TimeoutError:  # a worker stuck (a lock some thread held at the fork): compile here
                self.stalled = True
            except Exception:  # noqa: BLE001 - fn compiles it here and raises its error, see the class
                pass
        return fn(*args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.threads.shutdown(wait, cancel_futures=cancel_futures)
        if self.stalled:  # waiting would wait for the stuck worker
            _terminate(self.processes)
        else:
            self.processes.shutdown(wait, cancel_futures=cancel_futures)


def _terminate(pool: ProcessPoolExecutor) -> None:
    for process in list((getattr(pool, "_processes", None) or {}).values()):  # no public way before 3.14
        process.terminate()
    pool.shutdown(wait=False, cancel_futures=True)


def _compile_spec(fn) -> tuple | None:
    """What a worker needs to repeat Triton's compile closure `fn` (triton.runtime.jit's
    `async_compile`, over src, target, options and env_vars in Triton 3.6-3.8): the kernel's module
    and name, its signature, constants and attributes, the target, the options, the environment.
    None when the closure is not of that form."""
    try:
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
        src, options = cells["src"], cells["options"]
        raw = src.fn.fn
        return (raw.__module__, raw.__qualname__, dict(src.signature), dict(src.constants), dict(src.attrs),
                cells["target"], dict(options.__dict__), cells.get("env_vars"))
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def _compile_in_worker(spec: tuple) -> None:
    import importlib

    import triton
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    module, name, signature, constants, attrs, target, options, env_vars = spec
    kernel = getattr(importlib.import_module(module), name)
    while not isinstance(kernel, JITFunction):  # autotuner and heuristics wrappers hold theirs in .fn
        kernel = kernel.fn
    triton.compile(ASTSource(kernel, signature, constants, attrs), target=target, options=options,
                   _env_vars=env_vars)


def _forget(functions, failed: list) -> None:
    """Drops failed compiles from the kernels' in-memory caches, where the async mode left them."""
    if not failed:
        return
    failed_ids = {id(f) for f in failed}
    for fn in functions:
        for caches in getattr(fn, "device_caches", {}).values():
            kernel_cache = caches[0]
            for key in [k for k, v in kernel_cache.items() if id(v) in failed_ids]:
                del kernel_cache[key]


# -------------------------------------------------------------------------------------------------
# Which buckets, and whether an earlier process compiled them
# -------------------------------------------------------------------------------------------------


def bucket_sizes(policy, upper: int | None, cap: int, lower: int = 0) -> list[int]:
    """Every bucket size of one dimension: the policy's list, or powers of two, from its lower bound
    (smaller sizes go to another trace) up to its upper bound (the largest size the graph allows) or
    `cap` where it has none."""
    limit = upper if upper is not None else cap
    if policy.sizes is not None:
        sizes = [s for s in policy.sizes if s <= limit]
        if upper is not None and policy.sizes[-1] > upper:
            sizes.append(upper)  # the policy clamps larger sizes to the upper bound
        return sorted(s for s in set(sizes) if s >= lower)
    sizes, n = [], 1
    while n < limit:
        sizes.append(n)
        n *= 2
    sizes.append(limit)
    return sorted(s for s in set(sizes) if s >= lower)


def grid(groups: list[list[int]], rows_of, max_rows: int) -> list[tuple]:
    """The product of each group's sizes, keeping the combinations whose rows (rows_of(combo)) fit."""
    return [combo for combo in itertools.product(*groups) if rows_of(combo) <= max_rows]


def graph_fingerprint(fn) -> str:
    """What a graph computes, not what its nodes are called: each node's op, target and arguments,
    with other nodes by position. A graph loaded from the trace cache names its nodes differently
    from the same graph traced in the process that saved it (getitem_23 against getitem_36); keyed by
    its code, its buckets would be dry-run once more for nothing."""
    graph = getattr(fn, "graph", None)
    if graph is None:
        return getattr(fn, "code", "")
    index = {node: i for i, node in enumerate(graph.nodes)}
    lines = []
    for node in graph.nodes:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{index[n]}")
        if node.op == "placeholder":  # its shape, not its name: two geometries of one model class differ here
            val = node.meta.get("val", node.meta.get("example_value"))
            target = (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else type(val).__name__
        elif isinstance(node.target, torch._ops.OpOverload):
            target = str(node.target)
        else:
            target = getattr(node.target, "__qualname__", node.target)
        lines.append(f"{node.op} {target} {args!r} {kwargs!r}")
    return re.sub(r" at 0x[0-9a-f]+", "", "\n".join(lines))  # object reprs: no addresses


def marker(device: torch.device, fingerprint: str, keys: list) -> Path | None:
    """The file whose presence says this graph's buckets were compiled into this Triton cache."""
    if device.type != "cuda":
        return None
    from transfuse import kernels
    from transfuse.runtime.tuning_cache import cache_dir, identity

    triton_dir = os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")
    sources = sorted(Path(kernels.__file__).parent.glob("*.py"))
    return cache_dir() / "precompiled" / identity(device, sources, triton_dir, fingerprint, repr(keys))[:24]


def mark(path: Path | None) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError:
        pass  # a read-only cache directory costs a dry run next time, nothing else
