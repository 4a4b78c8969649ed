"""runtime/precompile.py's compile_only with real Triton compiles on a machine without a GPU: Triton
(not its interpreter) behind a stand-in driver that names an sm_90 target, so kernels compile (code
generator, MLIR, LLVM, ptxas) and never launch. In a subprocess: the suite runs with TRITON_INTERPRET=1,
which Triton reads when a kernel is defined.

Checks that compiles run in forked processes and come back as kernels loaded from Triton's disk
cache, that a variant launched again within the dry run is not packed and hashed again (Triton 3.6
re-packed it at every launch), that a kernel which fails to compile is counted and dropped from the
kernel cache, that TRANSFUSE_PRECOMPILE_PROCESSES=0 keeps the compiles in threads, and that a killed
or a stuck worker leaves its compiles to this process."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch, triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class StandInDriver:
        def get_current_device(self): return 0
        def get_current_stream(self, device=None): return 0
        def get_current_target(self): return GPUTarget("cuda", 90, 32)
        def get_active_torch_device(self): return torch.device("cpu")

    driver.set_active(StandInDriver())

    @triton.jit
    def scale_kernel(x, y, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + i, tl.load(x + i, mask=i < n) * 2, mask=i < n)

    from triton import knobs
    from transfuse.runtime import precompile

    hits = []  # this process's compiles: a disk-cache hit where a forked worker compiled first
    knobs.compilation.listener = lambda *, cache_hit, **_: hits.append(cache_hit)

    if os.environ.get("KILL_A_WORKER"):  # as the OOM killer would: the pool breaks, threads compile alone
        start = precompile._ForkedCompiles.start
        def start_then_kill(workers):
            pool = start(workers)
            os.kill(next(iter(pool.processes._processes)), signal.SIGKILL)
            time.sleep(1)
            return pool
        precompile._ForkedCompiles.start = start_then_kill

    if os.environ.get("STALL_BLOCK"):  # a worker that hangs on one variant (a lock held at the fork)
        precompile.REMOTE_TIMEOUT_S = 3.0
        compile_in_worker = precompile._compile_in_worker
        def stalling(spec):
            if int(os.environ["STALL_BLOCK"]) in spec[3].values():
                time.sleep(60)
            return compile_in_worker(spec)
        precompile._compile_in_worker = stalling

    packed = [0]
    pack_args = JITFunction._pack_args
    def counting(self, *args, **kwargs):
        packed[0] += 1
        return pack_args(self, *args, **kwargs)
    JITFunction._pack_args = counting

    x, y = torch.randn(300), torch.empty(300)
    started = time.perf_counter()
    with precompile.compile_only(workers=2) as stats:
        for _ in range(20):
            for block in (32, 64, 128):
                scale_kernel[(1,)](x, y, 300, BLOCK=block)
        scale_kernel[(1,)](x, y, 300, BLOCK=48)  # not a power of two: tl.arange refuses it
    cache = scale_kernel.device_caches[0][0]
    print(json.dumps({"stats": stats, "packed": packed[0], "hits": hits, "seconds": time.perf_counter() - started,
                      "cached": sorted(type(k).__name__ for k in cache.values()),
                      "binaries": [getattr(k, "asm", {}).get("cubin") is not None for k in cache.values()]}))
""")


def _run(tmp_path, processes: str, **extra_env) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(extra_env)
    env.update(TRITON_CACHE_DIR=str(tmp_path / processes), TRANSFUSE_PRECOMPILE_PROCESSES=processes,
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    script = tmp_path / "dry_run.py"  # a file: Triton reads a kernel's source from it
    script.write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    if "ptxas" in proc.stderr and proc.returncode:
        pytest.skip("this Triton has no ptxas to compile with")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="forked compiles are Linux's")
@pytest.mark.parametrize("processes", ["1", "0"])
def test_compile_only_compiles_each_variant_once_and_drops_failures(tmp_path, processes):
    out = _run(tmp_path, processes)
    stats = out["stats"]
    assert stats["how"] == ("2 forked processes" if processes == "1" else "2 threads"), stats
    assert (stats["compiles"], stats["failed"]) == (4, 1), stats
    assert out["packed"] == 4, "a variant was packed again at a later launch of the dry run"
    assert out["hits"] == [processes == "1"] * 3, "the workers' binaries were not the ones loaded"
    assert out["cached"] == ["CompiledKernel"] * 3 and all(out["binaries"]), out


@pytest.mark.skipif(sys.platform != "linux", reason="forked compiles are Linux's")
def test_a_killed_worker_leaves_the_compiles_to_the_threads(tmp_path):
    out = _run(tmp_path, "1", KILL_A_WORKER="1")
    assert (out["stats"]["compiles"], out["stats"]["failed"]) == (4, 1), out["stats"]
    assert out["hits"] == [False] * 3, "a broken pool's compiles should run in this process"
    assert out["cached"] == ["CompiledKernel"] * 3 and all(out["binaries"]), out


@pytest.mark.skipif(sys.platform != "linux", reason="forked compiles are Linux's")
def test_a_stuck_worker_is_given_up_on(tmp_path):
    out = _run(tmp_path, "1", STALL_BLOCK="64")
    assert (out["stats"]["compiles"], out["stats"]["failed"]) == (4, 1), out["stats"]
    assert sorted(out["hits"]) == [False, True, True], "the stuck variant should compile here, the others load"
    assert out["cached"] == ["CompiledKernel"] * 3 and all(out["binaries"]), out
    assert out["seconds"] < 40, "the dry run waited for the stuck worker"
