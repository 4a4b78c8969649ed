"""Few-row GEMMs (a batch of 1 x 16 tokens) as a model runs them: each timed inside a CUDA graph of
12 back-to-back calls over 12 different weights (like 12 layers: weights come from HBM, not L2),
for bert-base's four linears. Candidates: cuBLAS (F.linear + epilogue ops), and transfuse's Triton
GEMM with several narrow tiles and K splits. Says which tile the small-row regime should try.

Dev tool: PYTHONPATH=src python3 bench/kernels/bench_small_m.py [--m 16]"""

import argparse

import torch
import torch.nn.functional as F

# the sibling script's CUDA-event timer (run as a script, this folder is on sys.path)
from bench_gemv import median_us
from transfuse.kernels.gemm import linear_fwd

SHAPES = [  # (name, N, K, activation, residual)
    ("qkv", 2304, 768, "none", False),
    ("out+res", 768, 768, "none", True),
    ("ffn1+gelu", 3072, 768, "gelu", False),
    ("ffn2+res", 768, 3072, "none", True),
]
TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)
    (16, 64, 128, 5, 4),
    (16, 32, 128, 4, 4),
    (16, 32, 256, 3, 4),
    (16, 16, 256, 3, 2),
    (16, 16, 512, 2, 4),
    (16, 32, 512, 2, 4),
]
SPLITS = (1, 2, 4)
LAYERS = 12


def graph_time_us(fn, reps=30):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_us(graph.replay, reps, calls=LAYERS)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=16)
    args = parser.parse_args()
    torch.manual_seed(0)
    M = args.m
    print(f"M={M}, fp16, us per GEMM (inside a graph of {LAYERS} over distinct weights)")
    for name, N, K, act, res in SHAPES:
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        ws = [torch.randn(N, K, device="cuda", dtype=torch.float16) / K**0.5 for _ in range(LAYERS)]
        bs = [torch.randn(N, device="cuda", dtype=torch.float16) for _ in range(LAYERS)]
        r = torch.randn(M, N, device="cuda", dtype=torch.float16) if res else None

        def torch_fn():
            for w, b in zip(ws, bs):
                h = F.linear(x, w, b)
                if act == "gelu":
                    h = F.gelu(h)
                if r is not None:
                    h = h + r

        ref = F.linear(x.float(), ws[0].float(), bs[0].float())
        ref = F.gelu(ref) if act == "gelu" else ref
        ref = ref + r.float() if r is not None else ref
        row = {"cublas": graph_time_us(torch_fn)}
        for tile in TILES:
            for split in SPLITS:
                if K // split < tile[2]:
                    continue
                try:
                    out = linear_fwd(x, ws[0], bs[0], act, r, split_k=split, tile=tile)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        row[f"{tile}/{split}"] = float("nan")
                        continue

                    def tri(tile=tile, split=split):
                        for w, b in zip(ws, bs):
                            linear_fwd(x, w, b, act, r, split_k=split, tile=tile)

                    row[f"{tile}/{split}"] = graph_time_us(tri)
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
                    print(f"  {name} {tile}/{split}: {type(e).__name__}: {str(e)[:80]}")
        best = min((k for k in row if k != "cublas"), key=lambda k: row[k])
        floor = (N * K * 2) / 3.0e6  # us at 3.0 TB/s
        print(f"{name:10s} N={N:5d} K={K:5d}  floor {floor:4.1f}  cublas {row['cublas']:5.1f}  "
              f"best triton {row[best]:5.1f} {best}")
        print("    " + "  ".join(f"{k}={v:.1f}" for k, v in row.items() if k != "cublas"))


if __name__ == "__main__":
    main()
