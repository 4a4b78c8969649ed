"""A batched decode step's norm + linear: transfuse.kernels.norm_few_rows (one launch) against the
two launches it replaces, the norm kernel then cuBLAS (F.linear + the epilogue as PyTorch ops) or
gemm_few_rows, on Llama-1.1B's two norms (add + RMSNorm -> q/k/v, add + RMSNorm -> gate_up),
Llama-7B's, and GPT-2's LayerNorms.

    PYTHONPATH=src python3 bench/kernels/bench_norm_few_rows.py --m 4,8,16

Method: bench_gemv.py's graph_us (one CUDA graph of back-to-back calls over enough weight copies
that each call reads its weight from HBM; median of --reps replays); every candidate checked
against the fp32 reference first.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_gemv import device_header, graph_us, torch_linear  # noqa: E402

# (model, layer, N, K, activation, layer norm)
SHAPES = [
    ("llama-1.1b", "norm+qkv", 2560, 2048, "none", False),
    ("llama-1.1b", "norm+gate_up", 5632, 2048, "silu_mul", False),
    ("llama-7b", "norm+qkv", 12288, 4096, "none", False),
    ("llama-7b", "norm+gate_up", 11008, 4096, "silu_mul", False),
    ("gpt2", "ln_1+c_attn", 2304, 768, "none", True),
    ("gpt2", "ln_2+c_fc", 3072, 768, "gelu", True),
]


def main():
    from transfuse.kernels import norm
    from transfuse.kernels.gemm_few_rows import few_rows_fwd
    from transfuse.kernels.norm_few_rows import norm_few_rows_fwd
    from transfuse.kernels.norm_prologue import NormPrologue
    from transfuse.reference.gemm import linear_ref

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", default="8")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    props, l2_bytes, copy_bw = device_header("fp16")
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.float16
    for model, layer, N, K, act, ln in SHAPES:
        rows = 2 * N if act == "silu_mul" else N
        copies = max(8, -(-3 * l2_bytes // (rows * K * 2)))
        weights = [(torch.randn(rows, K, device="cuda", generator=gen) * K**-0.5).to(dtype) for _ in range(copies)]
        g = (torch.rand(K, device="cuda", generator=gen) + 0.5).to(dtype)
        nb = torch.randn(K, device="cuda", generator=gen).to(dtype) if ln else None
        for M in (int(m) for m in args.m.split(",")):
            x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
            r = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
            prologue = NormPrologue(r, g, 1e-5, 0.0, not ln, nb, ln)

            def normed():
                if ln:
                    return norm.add_layer_norm_fwd(x, r, g, nb, 1e-5, True)[0]
                return norm.add_rms_norm_fwd(x, r, g, 1e-5, 0.0, True, True)[0]

            gold = linear_ref(normed(), weights[0], None, act, None, upcast=True)
            candidates = {
                "norm+cublas": lambda i: torch_linear(normed(), weights[i], act, None),
                "norm+few_rows": lambda i: few_rows_fwd(normed(), weights[i], None, act, None),
                "fused": lambda i: norm_few_rows_fwd(x, prologue, weights[i], None, act)[0],
            }
            times = {}
            for name, fn in candidates.items():
                err = ((fn(0).float() - gold).norm() / gold.norm()).item()
                assert err < 1e-2, (name, err)
                times[name] = graph_us(fn, copies, args.reps)
            best_unfused = min(times["norm+cublas"], times["norm+few_rows"])
            print(f"{model:10s} {layer:13s} M={M:2d}  " + "  ".join(f"{n} {t:6.1f}" for n, t in times.items())
                  + f"   fused / best unfused {times['fused'] / best_unfused:.2f}", flush=True)
        weights.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
