"""GPU time of the norm inside the few-rows GEMM (norm_few_rows_fwd) against the norm kernel then
few_rows_fwd, at Llama-1.1B's batch-8 decode shapes: 20 launches captured in a CUDA graph, the
median of 20 replays per launch (transfuse.bench.timing.graph_replay_us). Dev tool:
PYTHONPATH=src python3 bench/norm_few_rows_time.py
(Session 42's figures came from this tool's first version, which timed the same way inline, after
one warm-up call on the default stream instead of three on a side stream.)"""
import torch

from transfuse.bench.timing import graph_replay_us
from transfuse.kernels import gemm_few_rows as fr
from transfuse.kernels import norm
from transfuse.kernels.norm_prologue import NormPrologue


def gpu_us(fn):
    return graph_replay_us(fn, repeat=20, replays=20)


for M, K, N, act in [(8, 2048, 2560, "none"), (8, 2048, 5632, "silu_mul"), (16, 768, 3072, "gelu")]:
    x, r = torch.randn(M, K, device="cuda").half(), torch.randn(M, K, device="cuda").half()
    w = torch.rand(K, device="cuda").half() + 0.5
    W = torch.randn(N * (2 if act.endswith("_mul") else 1), K, device="cuda").half() / K ** 0.5
    p = NormPrologue(r, w, 1e-6, 0.0, True)
    fused = gpu_us(lambda: fr.norm_few_rows_fwd(x, p, W, None, act))
    normed, _ = norm.add_rms_norm_fwd(x, r, w, 1e-6, 0.0, True, True)
    norm_only = gpu_us(lambda: norm.add_rms_norm_fwd(x, r, w, 1e-6, 0.0, True, True))
    gemm_only = gpu_us(lambda: fr.few_rows_fwd(normed, W, None, act))
    both = gpu_us(lambda: fr.few_rows_fwd(norm.add_rms_norm_fwd(x, r, w, 1e-6, 0.0, True, True)[0], W, None, act))
    print(f"M={M} K={K} N={N} {act:<8} fused {fused:6.2f} us | norm {norm_only:5.2f} + few_rows {gemm_only:6.2f}"
          f" = {both:6.2f} us back to back", flush=True)
