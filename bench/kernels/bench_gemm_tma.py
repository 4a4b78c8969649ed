"""Many-row GEMMs with an epilogue (bert-base's encoder linears at 1,024-16,384 rows, Llama-1.1B's
prefill at 512-4,096), each timed inside a CUDA graph of 12 back-to-back calls over 12 different
weights (like 12 layers): cuBLAS with PyTorch's epilogue ops (what transfuse.linear runs above 64
rows today), transfuse's pointer-loaded Triton GEMM (its large-regime fixed tile) and the persistent
TMA GEMM (kernels/gemm_tma.py) with each of its tiles. TFLOP/s and the max error against an fp32
reference next to torch's own. Says which tile the TMA kernel should take and where it beats cuBLAS.

Dev tool: PYTHONPATH=src python3 bench/kernels/bench_gemm_tma.py [--rows 1024,4096,16384] [--geometry bert-base]"""

import argparse

import torch

from bench_small_m import graph_time_us  # the sibling script's CUDA-graph timer
from transfuse.kernels.gemm import fixed_tile, is_gated, linear_fwd
from transfuse.kernels.gemm_tma import GATED_TILES, TILES, linear_tma_fwd
from transfuse.ops.gemm import linear_torch
from transfuse.reference.gemm import linear_ref

GEOMETRIES = {  # (name, N, K, activation, residual); for a gated unit N is the output (weight 2N rows)
    "bert-base": [
        ("ffn1+gelu", 3072, 768, "gelu", False),
        ("ffn1 (no gelu)", 3072, 768, "none", False),
        ("qkv", 2304, 768, "none", False),
        ("out+res", 768, 768, "none", True),
        ("ffn2+res", 768, 3072, "none", True),
    ],
    "llama-1.1b": [
        ("gate_up+silu_mul", 5632, 2048, "silu_mul", False),
        ("o+res", 2048, 2048, "none", True),
        ("down+res", 2048, 5632, "none", True),
    ],
}
LAYERS = 12
# Tiles swept beside the kernel's named ones (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)
SWEEP = [(128, 128, 64, 3, 8), (128, 256, 64, 4, 8), (128, 64, 64, 4, 4)]
GATED_SWEEP = [(128, 128, 64, 4, 8), (128, 64, 64, 3, 4), (64, 128, 64, 3, 4)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1024,4096,16384")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="bert-base")
    parser.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.geometry}, {args.dtype}, "
          f"{LAYERS} weights per graph; us per call (TFLOP/s)")
    for M in map(int, args.rows.split(",")):
        for name, N, K, act, has_res in GEOMETRIES[args.geometry]:
            rows = 2 * N if is_gated(act) else N
            ws = [(torch.randn(rows, K, device="cuda") * K**-0.5).to(dtype) for _ in range(LAYERS)]
            bs = [torch.randn(rows, device="cuda").to(dtype) for _ in range(LAYERS)]
            x = torch.randn(M, K, device="cuda").to(dtype)
            res = torch.randn(M, N, device="cuda").to(dtype) if has_res else None
            flops = 2 * M * rows * K
            providers = {
                "cublas": lambda w, b: linear_torch(x, w, b, act, res),
                "triton": lambda w, b: linear_fwd(x, w, b, act, res, split_k=1, tile=fixed_tile(M, is_gated(act))),
            }
            named = GATED_TILES if is_gated(act) else TILES
            tiles = {**named, **{"x".join(map(str, t)): t for t in (GATED_SWEEP if is_gated(act) else SWEEP)}}
            for label, tile in tiles.items():
                for persistent in (True, False):
                    providers[f"tma{'-p' if persistent else ''}-{label}"] = (
                        lambda w, b, tile=tile, persistent=persistent:
                        linear_tma_fwd(x, w, b, act, res, tile=tile, persistent=persistent))
            gold = linear_ref(x, ws[0], bs[0], act, res, upcast=True)
            torch_err = (linear_ref(x, ws[0], bs[0], act, res).float() - gold).abs().max().item()
            cells = []
            for label, fn in providers.items():
                try:
                    err = (fn(ws[0], bs[0]).float() - gold).abs().max().item()
                    us = graph_time_us(lambda: [fn(w, b) for w, b in zip(ws, bs)], reps=args.reps, layers=LAYERS)
                    cells.append(f"{label} {us:.1f}" + ("" if err <= 2 * torch_err + 1e-2 else f" ERR {err:.1e}"))
                except Exception as e:  # noqa: BLE001 - a tile that does not compile is a result too
                    cells.append(f"{label} failed: {type(e).__name__}: {str(e)[:80]}")
            print(f"M={M:6} {name:17} torch err {torch_err:.1e} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
