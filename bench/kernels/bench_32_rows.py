"""llama-1.1B linears at 17-32 rows: cuBLAS, the Triton GEMM fixed tile, the few-rows GEMM (us, L2 flushed).
Dev tool: PYTHONPATH=src python3 bench/kernels/bench_32_rows.py"""
import torch
from transfuse.kernels import gemm as g, gemm_few_rows as fr
from transfuse.ops.gemm import _gpu_times_ms, linear_torch
torch.manual_seed(0)
for M in (32, 24, 17):
    for name, N, K, act, res in (("qkv", 2560, 2048, "none", False), ("o+res", 2048, 2048, "none", True),
                                 ("gate_up", 5632, 2048, "silu_mul", False), ("down+res", 2048, 5632, "none", True),
                                 ("lm_head", 32000, 2048, "none", False)):
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        W = torch.randn(N * (2 if act == "silu_mul" else 1), K, device="cuda", dtype=torch.float16) / K ** 0.5
        r = torch.randn(M, N, device="cuda", dtype=torch.float16) if res else None
        tile = g.fixed_tile(M, act == "silu_mul", 2)
        c = {"cublas": lambda: linear_torch(x, W, None, act, r),
             "triton": lambda: g.linear_fwd(x, W, None, act, r, split_k=1, tile=tile),
             "few_rows": lambda: fr.few_rows_fwd(x, W, None, act, r)}
        for f in c.values():
            f()
        t = _gpu_times_ms(c, x.device)
        print(f"M={M} {name:9s} " + "  ".join(f"{k} {v*1e3:6.1f}" for k, v in t.items()), flush=True)
