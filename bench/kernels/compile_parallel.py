"""How well do Triton compiles run in parallel? Compiles N distinct small GEMM kernels for sm_90 with
an explicit target (no CUDA context), serially, in a thread pool and in a spawned process pool.

    python3 bench/kernels/compile_parallel.py [N]

Each run uses a fresh TRITON_CACHE_DIR so every compile is real. Prints seconds per mode.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import multiprocessing as mp


def _compile(i: int) -> int:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def k(x_ptr, y_ptr, n, BLOCK: tl.constexpr, BIAS: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, BLOCK)
        a = tl.load(x_ptr + rows[:, None] * n + cols[None, :])
        b = tl.load(y_ptr + rows[:, None] * n + cols[None, :])
        c = tl.dot(a, b)
        tl.store(x_ptr + rows[:, None] * n + cols[None, :], c.to(tl.float16) + BIAS)

    src = ASTSource(k, {"x_ptr": "*fp16", "y_ptr": "*fp16", "n": "i32", "BLOCK": "constexpr", "BIAS": "constexpr"},
                    constexprs={"BLOCK": 64, "BIAS": i})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    return i


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    rows = []
    for mode, workers in [("serial", 1), ("threads", 4), ("threads", 16), ("processes", 8), ("processes", 16)]:
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
        start = time.perf_counter()
        if mode == "serial":
            for i in range(n):
                _compile(i)
        elif mode == "threads":
            with ThreadPoolExecutor(workers) as ex:
                list(ex.map(_compile, range(n)))
        else:
            with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
                list(ex.map(_compile, range(n)))
        rows.append((mode, workers, time.perf_counter() - start))
    print(f"{n} distinct kernel compiles, {os.cpu_count()} CPUs")
    for mode, workers, s in rows:
        print(f"{mode:10s} {workers:3d} workers  {s:6.2f} s")


if __name__ == "__main__":
    main()
