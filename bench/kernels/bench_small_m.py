"""Few-row GEMMs (a batch of 1 x 16 tokens) as a model runs them: each timed inside a CUDA graph of
12 back-to-back calls over 12 different weights (like 12 layers: weights come from HBM, not L2),
for bert-base's four linears (or llama-1.1B's five, --geometry llama-1.1b). Candidates: cuBLAS
(F.linear + epilogue ops), and transfuse's Triton GEMM with several narrow tiles and K splits. Says
which tile the small-row regime should try, and how far each is from the weight-read floor.

Dev tool: PYTHONPATH=src python3 bench/kernels/bench_small_m.py [--m 16] [--geometry llama-1.1b] [--wide]"""

import argparse

import torch
import torch.nn.functional as F

# the sibling script's CUDA-event timer (run as a script, this folder is on sys.path)
from bench_gemv import median_us
from transfuse.bench.floor import measure_copy_gbps
from transfuse.kernels.gemm import linear_fwd

GEOMETRIES = {  # (name, N, K, activation, residual); for "silu_mul" N is the output (weight 2N rows)
    "bert-base": [
        ("qkv", 2304, 768, "none", False),
        ("out+res", 768, 768, "none", True),
        ("ffn1+gelu", 3072, 768, "gelu", False),
        ("ffn2+res", 768, 3072, "none", True),
    ],
    "llama-1.1b": [
        ("qkv", 2560, 2048, "none", False),
        ("o+res", 2048, 2048, "none", True),
        ("gate_up", 5632, 2048, "silu_mul", False),
        ("down+res", 2048, 5632, "none", True),
        ("lm_head", 32000, 2048, "none", False),
    ],
}
TILES = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)
    (16, 64, 128, 5, 4),
    (16, 32, 128, 4, 4),
    (16, 32, 256, 3, 4),
    (16, 16, 256, 3, 2),
    (16, 16, 512, 2, 4),
    (16, 32, 512, 2, 4),
]
# --wide: more tiles, deeper pipelines, longer splits (for the weight-bound llama shapes)
WIDE_TILES = TILES + [
    (16, 64, 128, 4, 4),
    (16, 64, 256, 3, 4),
    (16, 64, 256, 4, 4),
    (16, 128, 128, 4, 4),
    (16, 128, 64, 6, 4),
    (16, 32, 128, 6, 4),
    (16, 32, 256, 4, 4),
    (16, 16, 256, 4, 2),
    (16, 16, 128, 6, 2),
]
SPLITS = (1, 2, 4)
WIDE_SPLITS = (1, 2, 4, 8)
LAYERS = 12


def graph_time_us(fn, reps=30, layers=LAYERS):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_us(graph.replay, reps, calls=layers)



def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=16)
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="bert-base")
    parser.add_argument("--wide", action="store_true", help="sweep more tiles and splits")
    parser.add_argument("--layers", type=int, default=LAYERS, help="distinct weights per graph")
    args = parser.parse_args()
    torch.manual_seed(0)
    M = args.m
    tiles, splits = (WIDE_TILES, WIDE_SPLITS) if args.wide else (TILES, SPLITS)
    layers = args.layers
    bandwidth = measure_copy_gbps()
    print(f"M={M}, fp16, us per GEMM (inside a graph of {layers} over distinct weights); "
          f"copy bandwidth {bandwidth:.0f} GB/s")
    for name, N, K, act, res in GEOMETRIES[args.geometry]:
        rows = 2 * N if act == "silu_mul" else N
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        ws = [torch.randn(rows, K, device="cuda", dtype=torch.float16) / K**0.5 for _ in range(layers)]
        bs = [torch.randn(rows, device="cuda", dtype=torch.float16) for _ in range(layers)]
        r = torch.randn(M, N, device="cuda", dtype=torch.float16) if res else None

        def epilogue(h):
            if act == "gelu":
                h = F.gelu(h)
            elif act == "silu_mul":
                gate, up = h.chunk(2, dim=-1)
                h = F.silu(gate) * up
            return h + r if r is not None else h

        def torch_fn():
            for w, b in zip(ws, bs):
                epilogue(F.linear(x, w, b))

        ref = epilogue(F.linear(x.float(), ws[0].float(), bs[0].float()))
        row = {"cublas": graph_time_us(torch_fn, layers=layers)}
        if M <= 16:
            from transfuse.kernels.gemv import gemv_fwd

            def gemv_fn():
                for w, b in zip(ws, bs):
                    gemv_fwd(x, w, b, act, r)
            row["gemv"] = graph_time_us(gemv_fn, layers=layers)
        for tile in tiles:
            for split in splits:
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

                    row[f"{tile}/{split}"] = graph_time_us(tri, layers=layers)
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
                    print(f"  {name} {tile}/{split}: {type(e).__name__}: {str(e)[:80]}")
        best = min((k for k in row if k not in ("cublas", "gemv")), key=lambda k: row[k])
        floor = (rows * K * 2) / (bandwidth * 1e3)  # us to read the weight once at copy bandwidth
        print(f"{name:10s} N={rows:5d} K={K:5d}  floor {floor:5.1f}  cublas {row['cublas']:5.1f} "
              f"({floor / row['cublas']:.0%})  gemv {row.get('gemv', float('nan')):5.1f}  "
              f"best triton {row[best]:5.1f} ({floor / row[best]:.0%}) {best}")
        print("    " + "  ".join(f"{k}={v:.1f}" for k, v in row.items() if k not in ("cublas", "gemv")))


if __name__ == "__main__":
    main()
