"""Tile sweep for the training attention kernels (kernels/attention_train.py): is a tile outside the
autotune tables much faster, and by how much?

For one shape it launches the raw @triton.jit forward, dK/dV and dQ kernels with the launcher's exact
argument list and every (BLOCK_M, BLOCK_N, num_warps, num_stages) of a grid, checks each tile's output
against the autotuned launcher's, times it, and prints the fastest tiles beside the autotuned choice,
the launcher path and SDPA (cuDNN / flash) on the same shape.

    # default: nanoGPT-124M attention (batch 8, 12 heads, seq 1024, head dim 64, bf16, causal),
    # ~270 tiles per kernel set, compiled on 16 threads: about 2-3 minutes on an H100
    python bench/kernels/bench_attention_train.py --json /tmp/attn_sweep.jsonl
    python bench/kernels/bench_attention_train.py --layout bshd          # q/k/v views of one qkv buffer
    python bench/kernels/bench_attention_train.py --quick                # a dozen tiles per kernel
    python bench/kernels/bench_attention_train.py --kv-heads 4 --head-dim 128 --seq 2048 --batch 2
    # smoke test on CPU through Triton's interpreter (timings meaningless):
    TRITON_INTERPRET=1 python bench/kernels/bench_attention_train.py --batch 1 --heads 2 --seq 32 \
        --head-dim 16 --quick --device cpu

Grid: BLOCK_M in {16, 32, 64, 128} query rows, BLOCK_N in {32, 64, 128} keys (in every kernel: for
dK/dV BLOCK_N is the keys a program owns and BLOCK_M the queries it streams), num_warps {4, 8},
num_stages {1..5}; tiles larger than the sequence are left out. Structural pruning (--no-prune keeps
all 120 per kernel): 8 warps only on tiles of > 1024 scores (fewer than 4 scores a thread otherwise),
4 warps only on tiles of < 16384 (128x128 fp32 scores alone are 128 registers a thread on 4 warps),
num_stages <= 3 on tiles of >= 8192 (deeper pipelines of those do not fit shared memory next to the
layout conversions). The tiles of the autotune table for this dtype and head dim are always added.

Method. All tiles are compiled first on a thread pool (Triton's compile releases the GIL:
bench/results/2026-11-22-nvidia-h100-80gb-hbm3-compile-parallel.log), then timed one after the other
on an idle host: 3 warm-ups + the median of 20 runs, each bracketed by its own pair of CUDA events,
queued behind a ~2 ms sleep kernel so that launch overhead never shows as GPU time. Inputs are not
rotated (q, k, v, dO, O: 63 MB at the default shape, over the 50 MB L2). A tile whose output differs
from the autotuned launcher's by more than the dtype's rounding (relative-norm error, column `rel`)
is marked `wrong` and cannot rank. A tile that fails to compile or does not fit shared memory is
`failed`, with Triton's one-line reason.

TFLOP/s counts the matmuls each kernel really does, 2 * B * H * Sq * Sk * D each, halved when causal:
forward 2 (QK^T, PV), dK/dV 4 (KQ^T, VdO^T, P^T dO, dS^T Q), dQ 3 (QK^T and dO V^T recomputed, dS K).
SDPA's backward is counted the FlashAttention way, 5 matmuls (it does not recompute twice), so compare
its microseconds, not its TFLOP/s, with dK/dV + dQ. The launcher's backward adds the delta
preprocessing kernel (also shown alone).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
import triton

from transfuse.kernels import attention_train as at
from transfuse.kernels._config import INTERPRET

BLOCK_MS = (16, 32, 64, 128)
BLOCK_NS = (32, 64, 128)
WARPS = (4, 8)
STAGES = (1, 2, 3, 4, 5)

# --quick: a dozen tiles spread over the grid's shapes, the same for each kernel.
QUICK = [(16, 32, 4, 2), (16, 64, 4, 2), (32, 32, 4, 2), (32, 64, 4, 3), (32, 128, 8, 3), (64, 32, 4, 2),
         (64, 64, 4, 3), (64, 64, 8, 2), (64, 128, 8, 2), (128, 32, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2)]

# Matmuls per kernel (see the module docstring).
MATMULS = {"fwd": 2, "dkdv": 4, "dq": 3}
KERNELS = ("fwd", "dkdv", "dq")

# Largest relative-norm error against the autotuned launcher that a tile may show: two tilings round
# P (and dS) to the operand dtype at different running maxima, so they differ by a few units of that
# dtype's rounding (~0.3% for bf16); a skipped or doubled key block costs several percent.
REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-3}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

Tile = tuple  # (BLOCK_M, BLOCK_N, num_warps, num_stages)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def one_line(e: BaseException) -> str:
    """Triton's reason in one line: a CompilationError ends with it, everything else starts with it."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = (lines[-1] if "Compilation" in type(e).__name__ else lines[0]) if lines else ""
    return f"{type(e).__name__}: {text}"[:200]


# ----------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------

def time_us(fn: Callable[[], object], warmup: int, reps: int, cuda: bool) -> float:
    """Median microseconds of `reps` runs after `warmup` ones: CUDA events on a GPU, perf_counter else."""
    for _ in range(warmup):
        fn()
    if not cuda:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)
    torch.cuda.synchronize()
    # A sleeping kernel first lets the host queue every run before the GPU reaches them: an event
    # recorded on an idle GPU would otherwise count the host's launch time of the kernel after it.
    try:
        torch.cuda._sleep(3_000_000)  # cycles: ~2 ms at H100 clocks
    except (AttributeError, RuntimeError):
        pass
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def tflops(flops: float, us: Optional[float]) -> Optional[float]:
    return flops / (us * 1e-6) / 1e12 if us else None


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, relative norm error); inf when got holds a NaN or inf."""
    diff = got.float() - ref.float()
    if not torch.isfinite(got.float()).all():
        return float("inf"), float("inf")
    return diff.abs().max().item(), (diff.norm() / ref.float().norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------------------------------
# Inputs and the raw launches (argument lists as attention_train_fwd / attention_train_bwd build them)
# ----------------------------------------------------------------------------------------------------

@dataclass
class Case:
    """One raw kernel with its fixed arguments; `outputs` are (buffer it writes, launcher's result)."""
    name: str
    fn: object
    args: tuple
    flags: dict
    grid: Callable[[int, int], tuple]
    outputs: list = field(default_factory=list)
    flops: float = 0.0

    def launch(self, tile: Tile, warmup: bool = False):
        bm, bn, warps, stages = tile
        kw = dict(self.flags, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        if not INTERPRET:
            kw["num_ctas"] = 1  # as the autotuner's Config passes it, so that both share a cache entry
        if warmup:
            return self.fn.warmup(*self.args, grid=self.grid(bm, bn), **kw)
        return self.fn[self.grid(bm, bn)](*self.args, **kw)


def make_inputs(a, dtype, device):
    """q, k, v (batch, heads, seq, dim) views and dO. bshd: nanoGPT's layout, q, k, v cut from one
    (batch, seq, (heads + 2 * kv_heads) * dim) buffer and viewed with .view(B, T, H, D).transpose(1, 2),
    so stride_seq = (heads + 2 * kv_heads) * dim; dO then has the (batch, seq, heads, dim) memory that the
    gradient of `y.transpose(1, 2).contiguous()` has."""
    B, H, HKV, S, D = a.batch, a.heads, a.kv_heads, a.seq, a.head_dim
    if a.layout == "bshd":
        width = (H + 2 * HKV) * D
        qkv = torch.randn(B, S, width, dtype=dtype, device=device)
        q = qkv[..., : H * D].view(B, S, H, D).transpose(1, 2)
        k = qkv[..., H * D: (H + HKV) * D].view(B, S, HKV, D).transpose(1, 2)
        v = qkv[..., (H + HKV) * D:].view(B, S, HKV, D).transpose(1, 2)
        do = torch.randn(B, S, H, D, dtype=dtype, device=device).transpose(1, 2)
    else:
        q = torch.randn(B, H, S, D, dtype=dtype, device=device)
        k = torch.randn(B, HKV, S, D, dtype=dtype, device=device)
        v = torch.randn(B, HKV, S, D, dtype=dtype, device=device)
        do = torch.randn(B, H, S, D, dtype=dtype, device=device)
    return q, k, v, do


def strides3(t: torch.Tensor) -> tuple:
    return t.stride(0), t.stride(1), t.stride(2)


def build_cases(q, k, v, do, scale: float, causal: bool):
    """The three raw kernels plus the buffers the launcher's results are copied into (out_ref, lse_ref,
    delta feed the backward kernels; dq/dk/dv_ref are the oracles of the backward tiles)."""
    B, H, S, D = q.shape
    HKV = k.shape[1]
    no_bias = [0, 0, 0, 0]
    flags = at._common_flags(q, None, no_bias, causal)
    buckets = (at._bucket(S), at._bucket(S))
    group = H // HKV

    out, lse, stats = at.attention_train_empty_out(q)              # written by the swept forward tiles
    out_ref, lse_ref, stats_ref = at.attention_train_empty_out(q)  # the launcher's, input of the backward
    delta = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    dq, dk, dv, _ = at.attention_train_empty_grads(q, k, v, None, False)
    dq_ref, dk_ref, dv_ref, _ = at.attention_train_empty_grads(q, k, v, None, False)
    per_matmul = 2.0 * B * H * S * S * D * (0.5 if causal else 1.0)

    fwd = Case(
        "fwd", at._attention_train_fwd_kernel,
        (q, *strides3(q), k, *strides3(k), v, *strides3(v), q, *no_bias,
         out, *strides3(out), lse, stats, H, group, S, S, float(scale), *buckets),
        flags, lambda bm, bn: (triton.cdiv(S, bm) * B * H,),
        [(out, out_ref), (lse, lse_ref), (stats, stats_ref)], MATMULS["fwd"] * per_matmul)
    dkdv = Case(
        "dkdv", at._attention_train_bwd_dkdv_kernel,
        (q, *strides3(q), k, *strides3(k), v, *strides3(v), q, *no_bias,
         do, *strides3(do), dk, *strides3(dk), dv, *strides3(dv), dk, *strides3(dk), dv, *strides3(dv),
         delta, *no_bias, stats_ref, delta, HKV, group, S, S, float(scale), *buckets),
        dict(flags, STORE_DS=False, DS_SUM_Q=False, HAS_DK_ADD=False, HAS_DV_ADD=False),
        lambda bm, bn: (triton.cdiv(S, bn) * B * HKV,),
        [(dk, dk_ref), (dv, dv_ref)], MATMULS["dkdv"] * per_matmul)
    dqc = Case(
        "dq", at._attention_train_bwd_dq_kernel,
        (q, *strides3(q), k, *strides3(k), v, *strides3(v), q, *no_bias,
         do, *strides3(do), dq, *strides3(dq), stats_ref, delta, H, group, S, S, float(scale), *buckets),
        flags, lambda bm, bn: (triton.cdiv(S, bm) * B * H,),
        [(dq, dq_ref)], MATMULS["dq"] * per_matmul)

    pre_block_m = 32 if INTERPRET else max(16, 4096 // flags["BLOCK_D"])

    def preprocess():
        # delta = rowsum(dO * O), exactly as attention_train_bwd launches it (no dlse).
        at._attention_train_bwd_preprocess_kernel[(triton.cdiv(S, pre_block_m), B * H)](
            out_ref, *strides3(out_ref), do, *strides3(do), delta, delta, H, S,
            HEAD_DIM=flags["HEAD_DIM"], BLOCK_D=flags["BLOCK_D"], HAS_DLSE=False, BLOCK_M=pre_block_m,
            num_warps=4, num_stages=1,
        )

    refs = dict(out_ref=out_ref, lse_ref=lse_ref, stats_ref=stats_ref, dq_ref=dq_ref, dk_ref=dk_ref, dv_ref=dv_ref)
    return {"fwd": fwd, "dkdv": dkdv, "dq": dqc}, refs, preprocess, flags


# ----------------------------------------------------------------------------------------------------
# The sweep grid
# ----------------------------------------------------------------------------------------------------

def keep_structurally(tile: Tile) -> bool:
    bm, bn, warps, stages = tile
    area = bm * bn
    if warps == 8 and area <= 1024:
        return False
    if warps == 4 and area >= 16384:
        return False
    if stages > 3 and area >= 8192:
        return False
    return True


def table_tiles(kernel: str, dtype: torch.dtype, block_d: int) -> set:
    """The autotune table's tiles for this dtype and head dim (no bias), as keep() sees them."""
    try:
        return set(at._allowed_tiles(kernel, dtype == torch.float32, block_d, False))
    except (AttributeError, KeyError, ValueError):  # the table's layout changed: sweep the grid only
        return set()


def sweep_tiles(kernel: str, a, dtype, block_d: int) -> tuple[list, set]:
    seq_ok = lambda t: t[0] <= a.seq and t[1] <= a.seq  # noqa: E731
    if a.quick:
        grid = [t for t in QUICK if seq_ok(t)]
    else:
        grid = [(bm, bn, w, s) for bm in BLOCK_MS for bn in BLOCK_NS for w in WARPS for s in STAGES]
        grid = [t for t in grid if seq_ok(t) and (a.no_prune or keep_structurally(t))]
    if a.max_configs is not None and len(grid) > a.max_configs:
        random.Random(0).shuffle(grid)  # an even spread of the grid, the same on every run
        grid = grid[: a.max_configs]
    table = {t for t in table_tiles(kernel, dtype, block_d) if seq_ok(t)}
    tiles = sorted(set(grid) | table, key=lambda t: (-t[0] * t[1], t))  # big tiles first: slowest compiles
    return tiles, table


def precompile(cases: dict, tiles: dict, jobs: int) -> None:
    """Compile every tile ahead of the timing, on `jobs` threads. Only a cache warm-up: a tile that
    fails here is tried again (and its reason recorded) when it is first launched."""
    if INTERPRET or jobs <= 1:
        return
    work = [(cases[name], t) for name in tiles for t in tiles[name]]
    start = time.perf_counter()
    # One compile per kernel on this thread first: the JIT's per-device cache is created lazily.
    firsts = {name: tiles[name][0] for name in tiles if tiles[name]}
    for name, t in firsts.items():
        try:
            cases[name].launch(t, warmup=True)
        except Exception:  # noqa: BLE001 - recorded at launch
            pass
    work = [(c, t) for c, t in work if firsts.get(c.name) != t]
    total = len(work) + len(firsts)
    log(f"compiling {total} kernels on {jobs} threads ...")
    done, step = len(firsts), max(1, total // 10)
    with ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(case.launch, t, True) for case, t in work]
        for fut in as_completed(futures):
            try:
                fut.result()
            except Exception:  # noqa: BLE001
                pass
            done += 1
            if done % step == 0 or done == total:
                log(f"  compiled {done}/{total}  ({time.perf_counter() - start:.0f} s)")


def run_tile(case: Case, tile: Tile, a, cuda: bool, tol: float) -> dict:
    rec = dict(kernel=case.name, BLOCK_M=tile[0], BLOCK_N=tile[1], num_warps=tile[2], num_stages=tile[3])
    try:
        for buf, _ in case.outputs:
            buf.fill_(float("nan"))  # a tile that skips rows must not inherit another tile's values
        compiled = case.launch(tile)
        if cuda:
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - compile errors, out of shared memory, ...
        return dict(rec, status="failed", reason=one_line(e))
    for attr, key in (("n_regs", "regs"), ("n_spills", "spills")):
        rec[key] = getattr(compiled, attr, None)
    metadata = getattr(compiled, "metadata", None)
    rec["shared"] = getattr(metadata, "shared", None)
    worst_abs, worst_rel = 0.0, 0.0
    for buf, ref in case.outputs:
        err_abs, err_rel = rel_err(buf, ref)
        worst_abs, worst_rel = max(worst_abs, err_abs), max(worst_rel, err_rel)
    rec.update(max_abs_diff=worst_abs, rel=worst_rel)
    try:
        us = time_us(lambda: case.launch(tile), a.warmup, a.reps, cuda)
    except Exception as e:  # noqa: BLE001
        return dict(rec, status="failed", reason=one_line(e))
    rec.update(us=us, tflops=tflops(case.flops, us), status="ok" if worst_rel <= tol else "wrong")
    return rec


# ----------------------------------------------------------------------------------------------------
# References: the autotuned launchers and SDPA
# ----------------------------------------------------------------------------------------------------

def config_tile(autotuned) -> Optional[Tile]:
    cfg = getattr(autotuned, "best_config", None)
    if cfg is None:
        return None
    return (cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages)


def sdpa_lines(q, k, v, do, scale, causal, a, cuda: bool, flops_fwd: float) -> list[dict]:
    """SDPA forward and forward+backward (grads of q, k, v only: no assembly into a qkv buffer)."""
    group = q.shape[1] // k.shape[1]
    backends = [("default", None)]
    if cuda:
        from torch.nn.attention import SDPBackend
        backends += [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)]
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    gqa = {"enable_gqa": True} if group > 1 else {}
    rows = []
    for name, backend in backends:
        def fwd():
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale, **gqa)

        def fwd_bwd():
            return torch.autograd.grad(fwd(), (qs, ks, vs), do)

        def under(fn):
            if backend is None:
                return fn
            from torch.nn.attention import sdpa_kernel

            def run():
                with sdpa_kernel(backend):
                    return fn()
            return run

        rec = dict(kind="sdpa", backend=name)
        try:
            us_f = time_us(under(fwd), a.warmup, a.reps, cuda)
            us_fb = time_us(under(fwd_bwd), a.warmup, a.reps, cuda)
        except Exception as e:  # noqa: BLE001 - backend not available for this shape or dtype
            rows.append(dict(rec, status="failed", reason=one_line(e)))
            continue
        rows.append(dict(rec, status="ok", fwd_us=us_f, fwd_bwd_us=us_fb, bwd_us=us_fb - us_f,
                         fwd_tflops=tflops(flops_fwd, us_f), bwd_tflops=tflops(2.5 * flops_fwd, us_fb - us_f)))
    return rows


# ----------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------

def fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def tile_str(t: Optional[Tile]) -> str:
    return "-" if t is None else "{}x{} w{} s{}".format(*t)


def print_kernel(name: str, recs: list[dict], autotuned: Optional[Tile], table: set, top: int) -> None:
    ok = sorted((r for r in recs if r["status"] == "ok"), key=lambda r: r["us"])
    by_tile = {(r["BLOCK_M"], r["BLOCK_N"], r["num_warps"], r["num_stages"]): r for r in recs}
    auto = by_tile.get(autotuned) if autotuned else None
    n_fail = sum(r["status"] == "failed" for r in recs)
    n_wrong = sum(r["status"] == "wrong" for r in recs)
    print(f"\n== {name}: {len(recs)} tiles, {len(ok)} ok, {n_fail} failed, {n_wrong} wrong "
          f"(* autotuned choice, t in the autotune table)")
    print(f"{'#':>3} {'BLOCK_M':>7} {'BLOCK_N':>7} {'warps':>5} {'stages':>6} {'us':>9} {'TFLOP/s':>8} "
          f"{'vs auto':>7} {'regs':>5} {'spill':>5} {'smem KiB':>8} {'rel err':>8}")
    auto_us = auto["us"] if auto and auto.get("status") == "ok" else None
    shown = ok[:top]
    if auto and auto not in shown:
        shown = shown + [auto]
    for r in shown:
        t = (r["BLOCK_M"], r["BLOCK_N"], r["num_warps"], r["num_stages"])
        rank = ok.index(r) + 1 if r in ok else "-"
        mark = ("*" if t == autotuned else " ") + ("t" if t in table else " ")
        speed = fmt(auto_us / r["us"], ".2f") + "x" if auto_us and r.get("us") else "-"
        shared = r.get("shared")
        print(f"{rank:>3} {r['BLOCK_M']:>7} {r['BLOCK_N']:>7} {r['num_warps']:>5} {r['num_stages']:>6} "
              f"{fmt(r.get('us'), '.1f'):>9} {fmt(r.get('tflops'), '.1f'):>8} {speed:>7} "
              f"{fmt(r.get('regs'), 'd'):>5} {fmt(r.get('spills'), 'd'):>5} "
              f"{fmt(shared / 1024 if shared is not None else None, '.0f'):>8} {fmt(r.get('rel'), '.1e'):>8} {mark}"
              + (f"  [{r['status']}]" if r["status"] != "ok" else ""))
    if autotuned is not None and auto is None:
        print(f"    autotuned choice {tile_str(autotuned)} was not swept")
    reasons: dict = {}
    for r in recs:
        if r["status"] == "failed":
            reasons.setdefault(r["reason"], []).append(tile_str((r["BLOCK_M"], r["BLOCK_N"], r["num_warps"],
                                                                 r["num_stages"])))
    for reason, ts in list(reasons.items())[:4]:
        print(f"    failed x{len(ts)} ({', '.join(ts[:3])}{', ...' if len(ts) > 3 else ''}): {reason}")
    for r in [r for r in recs if r["status"] == "wrong"][:3]:
        print(f"    wrong: {tile_str((r['BLOCK_M'], r['BLOCK_N'], r['num_warps'], r['num_stages']))} "
              f"max abs diff {r['max_abs_diff']:.3g}, rel {r['rel']:.2e}")


# ----------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=None, help="GQA/MQA: key/value heads (default: --heads)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--layout", choices=["bhsd", "bshd"], default="bhsd",
                   help="bshd: q/k/v are (B, T, H, D) views of one qkv buffer, as nanoGPT's")
    p.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated subset of fwd,dkdv,dq")
    p.add_argument("--quick", action="store_true", help="a dozen tiles per kernel instead of the grid")
    p.add_argument("--no-prune", action="store_true", help="keep the whole grid (120 tiles per kernel)")
    p.add_argument("--max-configs", type=int, default=None,
                   help="at most this many grid tiles per kernel (a fixed spread; table tiles come on top)")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                   help="compile threads (1: compile each tile at its first launch)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs (default 3; 1 on CPU)")
    p.add_argument("--reps", type=int, default=None, help="timed runs (default 20; 2 on CPU)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu (needs TRITON_INTERPRET=1)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every record as JSON lines")
    a = p.parse_args(argv)
    a.kv_heads = a.kv_heads or a.heads
    if a.heads % a.kv_heads:
        p.error(f"--heads ({a.heads}) must be a multiple of --kv-heads ({a.kv_heads})")
    a.kernels = [k for k in a.kernels.split(",") if k]
    if not set(a.kernels) <= set(KERNELS):
        p.error(f"--kernels must be a subset of {','.join(KERNELS)}")
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if not cuda and not INTERPRET:
        sys.exit("a CPU run needs TRITON_INTERPRET=1 in the environment (set before Python starts)")
    a.warmup = a.warmup if a.warmup is not None else (3 if cuda else 1)
    a.reps = a.reps if a.reps is not None else (20 if cuda else 2)
    dtype = DTYPES[a.dtype]
    tol = REL_TOL[dtype]
    torch.manual_seed(0)
    scale = a.head_dim ** -0.5

    gpu = torch.cuda.get_device_name(device) if cuda else "cpu (Triton interpreter: timings meaningless)"
    shape = dict(batch=a.batch, heads=a.heads, kv_heads=a.kv_heads, seq=a.seq, head_dim=a.head_dim,
                 dtype=a.dtype, causal=a.causal, layout=a.layout)
    meta = dict(kind="meta", device=gpu, torch=torch.__version__, triton=triton.__version__,
                date=datetime.date.today().isoformat(), **shape)
    print(f"# {gpu}, torch {torch.__version__}, triton {triton.__version__}, {meta['date']}")
    print("# " + ", ".join(f"{k} {v}" for k, v in shape.items()) + f"; median of {a.reps} after {a.warmup} warm-ups")

    q, k, v, do = make_inputs(a, dtype, device)
    cases, refs, preprocess, flags = build_cases(q, k, v, do, scale, a.causal)
    tiles, tables = {}, {}
    for name in a.kernels:
        tiles[name], tables[name] = sweep_tiles(name, a, dtype, flags["BLOCK_D"])
    log("tiles per kernel: " + ", ".join(f"{n} {len(t)}" for n, t in tiles.items()))
    t0 = time.perf_counter()
    precompile(cases, tiles, a.jobs)

    # The autotuned launchers: the oracle of every tile, and the current choice.
    log("autotuned launchers ...")
    out, lse, stats = at.attention_train_fwd(q, k, v, None, scale, a.causal)
    dq, dk, dv, _ = at.attention_train_bwd(do, q, k, v, None, out, stats, scale, a.causal, False)
    for key, val in (("out_ref", out), ("lse_ref", lse), ("stats_ref", stats), ("dq_ref", dq), ("dk_ref", dk), ("dv_ref", dv)):
        refs[key].copy_(val)
    preprocess()
    autotuned = {"fwd": config_tile(at._attention_train_fwd_kernel_autotuned),
                 "dkdv": config_tile(at._attention_train_bwd_dkdv_kernel_autotuned),
                 "dq": config_tile(at._attention_train_bwd_dq_kernel_autotuned)}
    for name in a.kernels:
        if autotuned[name] is not None and autotuned[name] not in tiles[name]:
            tiles[name].append(autotuned[name])

    records = [meta]
    per_matmul = cases["fwd"].flops / MATMULS["fwd"]
    us_fwd = time_us(lambda: at.attention_train_fwd(q, k, v, None, scale, a.causal), a.warmup, a.reps, cuda)
    us_bwd = time_us(lambda: at.attention_train_bwd(do, q, k, v, None, out, stats, scale, a.causal, False),
                     a.warmup, a.reps, cuda)
    us_pre = time_us(preprocess, a.warmup, a.reps, cuda)
    launcher = dict(kind="launcher", fwd_us=us_fwd, bwd_us=us_bwd, preprocess_us=us_pre,
                    fwd_tflops=tflops(2 * per_matmul, us_fwd), bwd_tflops=tflops(7 * per_matmul, us_bwd),
                    autotuned={n: autotuned[n] for n in KERNELS})
    records.append(launcher)

    sdpa = sdpa_lines(q, k, v, do, scale, a.causal, a, cuda, 2 * per_matmul)
    records += sdpa
    sdpa_out = F.scaled_dot_product_attention(q, k, v, is_causal=a.causal, scale=scale,
                                              **({"enable_gqa": True} if a.heads != a.kv_heads else {}))
    launcher["vs_sdpa_out"] = rel_err(out, sdpa_out)

    results = {}
    for name in a.kernels:
        case, recs = cases[name], []
        log(f"timing {name}: {len(tiles[name])} tiles")
        for i, tile in enumerate(tiles[name], 1):
            rec = run_tile(case, tile, a, cuda, tol)
            rec.update(kind="sweep", in_table=tile in tables[name], autotuned=tile == autotuned[name])
            recs.append(rec)
            if i % 10 == 0 or i == len(tiles[name]):
                best = min((r for r in recs if r["status"] == "ok"), key=lambda r: r["us"], default=None)
                log(f"  {name} {i}/{len(tiles[name])}, best {fmt(best and best['us'], '.1f')} us "
                    f"{tile_str(best and (best['BLOCK_M'], best['BLOCK_N'], best['num_warps'], best['num_stages']))}"
                    f"  ({time.perf_counter() - t0:.0f} s)")
        results[name] = recs
        records += recs

    # ---- report
    for name in a.kernels:
        print_kernel(name, results[name], autotuned[name], tables[name], a.top)

    print("\n== references (us; TFLOP/s)")
    print(f"transfuse launcher  fwd {us_fwd:8.1f} ({fmt(launcher['fwd_tflops'], '.1f')})   "
          f"bwd {us_bwd:8.1f} (preprocess {us_pre:.1f} + dK/dV + dQ; {fmt(launcher['bwd_tflops'], '.1f')} "
          f"at 7 matmuls)   autotuned " + ", ".join(f"{n} {tile_str(autotuned[n])}" for n in KERNELS))
    abs_d, rel_d = launcher["vs_sdpa_out"]
    print(f"                    out vs SDPA: max abs diff {abs_d:.3g}, rel {rel_d:.2e}")
    for r in sdpa:
        if r["status"] != "ok":
            print(f"sdpa {r['backend']:<14} {r['reason']}")
            continue
        print(f"sdpa {r['backend']:<14} fwd {r['fwd_us']:8.1f} ({fmt(r['fwd_tflops'], '.1f')})   "
              f"bwd {r['bwd_us']:8.1f} ({fmt(r['bwd_tflops'], '.1f')} at 5 matmuls)   fwd+bwd {r['fwd_bwd_us']:.1f}")

    def best_us(name):
        ok = [r["us"] for r in results.get(name, []) if r["status"] == "ok"]
        return min(ok) if ok else None

    def auto_us(name):
        hits = [r for r in results.get(name, []) if r["autotuned"] and r["status"] == "ok"]
        return hits[0]["us"] if hits else None

    if set(a.kernels) == set(KERNELS):
        best = [best_us(n) for n in KERNELS]
        auto = [auto_us(n) for n in KERNELS]
        if None not in best and None not in auto:
            summary = dict(kind="summary", best_fwd_bwd_us=sum(best) + us_pre, autotuned_fwd_bwd_us=sum(auto) + us_pre)
            print(f"\nfwd + preprocess + dK/dV + dQ: autotuned tiles {summary['autotuned_fwd_bwd_us']:.1f} us, "
                  f"best swept tiles {summary['best_fwd_bwd_us']:.1f} us "
                  f"({summary['autotuned_fwd_bwd_us'] / summary['best_fwd_bwd_us']:.2f}x)")
            records.append(summary)
    log(f"total {time.perf_counter() - t0:.0f} s")

    if a.json:
        with open(a.json, "w") as f:
            for r in records:
                f.write(json.dumps(r, default=str) + "\n")
        print(f"# wrote {len(records)} JSON lines to {a.json}")


if __name__ == "__main__":
    main()
