"""The last step of a norm backward: summing the (n_programs, N) fp32 partial rows of dweight and
dbias. torch's column sum (two launches, as before 2026-11-26) against norm_backward's
_sum_partials_kernel (one launch for both) at several tiles; each timed as 25 calls inside one CUDA
graph, as they run in a training step's graph. Also the whole layer_norm_bwd at 8192 x N.

    PYTHONPATH=src python3 bench/kernels/bench_norm_partials.py"""
import itertools

import torch
import triton

from bench_gemv import graph_us  # this script's folder is on sys.path
from transfuse.kernels import norm_backward as nb


def graph_time_us(fn, n=25, reps=30):
    """One call's median time from replays of a CUDA graph of n calls (bench_gemv's timer)."""
    return graph_us(lambda _: fn(), n, reps)


def launch(partials, outs, block_p, block_n, warps, stages):
    n_cols = partials.shape[-1]
    nb._sum_partials_kernel[(triton.cdiv(n_cols, block_n), partials.shape[0])](
        partials, partials.stride(0), partials.stride(1), outs[0], outs[1], outs[-1], partials.shape[1], n_cols,
        BF16_RNE_BY_HAND=False, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


programs = nb._max_programs(torch.device("cuda"))
print(f"n_programs {programs}")
for n_cols in (768, 2048, 4096):
    partials = torch.randn(2, programs, n_cols, device="cuda")
    outs = [torch.empty(n_cols, device="cuda") for _ in range(2)]
    ref = partials.sum(1)
    t_torch = graph_time_us(lambda: (partials[0].sum(0), partials[1].sum(0)))
    res = {}
    for bp, bn, w, st in itertools.product((16, 32, 64), (16, 32, 64, 128), (2, 4, 8), (1, 3)):
        if bp * bn > 8192:
            continue
        launch(partials, outs, bp, bn, w, st)
        assert torch.allclose(torch.stack(outs), ref, rtol=1e-4, atol=1e-3)
        res[(bp, bn, w, st)] = graph_time_us(lambda: launch(partials, outs, bp, bn, w, st))
    best = sorted(res, key=res.get)[:4]
    print(f"N {n_cols:5d}: torch two sums {t_torch:6.2f} us; ours (32, 32, 4, 3) {res[(32, 32, 4, 3)]:6.2f}; best "
          + ", ".join(f"{k} {res[k]:.2f}" for k in best))
    x = torch.randn(8192, n_cols, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x); w_ = torch.randn(n_cols, device="cuda"); b_ = torch.randn(n_cols, device="cuda")
    t_all = graph_time_us(lambda: nb.layer_norm_bwd(dy, x, w_, b_, 1e-5))
    print(f"         layer_norm_bwd 8192 x {n_cols} bf16, fp32 params: {t_all:6.2f} us")
