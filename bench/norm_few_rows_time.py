"""GPU time of the norm inside the few-rows GEMM (norm_few_rows_fwd) against the norm kernel then
few_rows_fwd, at Llama-1.1B's batch-8 decode shapes: 20 launches captured in a CUDA graph, the
median of 20 replays per launch (transfuse.bench.timing.graph_replay_us), each kernel at 4 and 8
warps. Dev tool:
PYTHONPATH=src python3 bench/norm_few_rows_time.py
(Session 42's figures came from this tool's first version: 4 warps only, one weight per shape, which
an H200's L2 can hold between launches, and one warm-up call on the default stream.)"""
import itertools

import torch

from transfuse.bench.timing import graph_replay_us
from transfuse.kernels import gemm_few_rows as fr
from transfuse.kernels import norm
from transfuse.kernels.norm_prologue import NormPrologue


def gpu_us(fn):
    return graph_replay_us(fn, repeat=20, replays=20)


def with_warps(gated: bool, warps: int) -> fr.FewRowsConfig:
    return fr.default_config(gated)._replace(num_warps=warps)


# The weights are rotated through COPIES buffers, so that a launch reads its weight from HBM rather
# than from the L2 the previous launch filled (a 46 MB gate-up fits in an H200's 50 MB L2).
COPIES = 4
for M, K, N, act in [(8, 2048, 2560, "none"), (8, 2048, 5632, "silu_mul"), (16, 768, 3072, "gelu")]:
    gated = act.endswith("_mul")
    x, r = torch.randn(M, K, device="cuda").half(), torch.randn(M, K, device="cuda").half()
    w = torch.rand(K, device="cuda").half() + 0.5
    Ws = [torch.randn(N * (2 if gated else 1), K, device="cuda").half() / K ** 0.5 for _ in range(COPIES)]
    p = NormPrologue(r, w, 1e-6, 0.0, True)
    normed, _ = norm.add_rms_norm_fwd(x, r, w, 1e-6, 0.0, True, True)
    weights = itertools.cycle(Ws)

    def weight():
        return next(weights)

    norm_only = gpu_us(lambda: norm.add_rms_norm_fwd(x, r, w, 1e-6, 0.0, True, True))
    line = f"M={M} K={K} N={N} {act:<8} norm {norm_only:5.2f} us"
    # (the default config has 4 warps: with 8, ptxas for sm_90a reports no spills in either kernel,
    # against 684 bytes for the gated few-rows kernel and 244 for the norm prologue with triton 3.6)
    for warps in (4, 8):
        conf = with_warps(gated, warps)
        fused = gpu_us(lambda: fr.norm_few_rows_fwd(x, p, weight(), None, act, config=conf))
        gemm_only = gpu_us(lambda: fr.few_rows_fwd(normed, weight(), None, act, config=conf))
        both = gpu_us(lambda: fr.few_rows_fwd(norm.add_rms_norm_fwd(x, r, w, 1e-6, 0.0, True, True)[0], weight(),
                                              None, act, config=conf))
        line += (f" | {warps} warps: fused {fused:6.2f}, few_rows {gemm_only:6.2f}, norm + few_rows {both:6.2f}")
    print(line, flush=True)
