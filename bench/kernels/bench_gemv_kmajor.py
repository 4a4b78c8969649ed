"""GPT-2-size decode linears whose weight is stored (K, N) (Conv1D: x @ W), at 1 and 2 rows:
cuBLAS on that layout (F.linear(x, W.t())), cuBLAS and transfuse's GEMV on an (N, K) copy (what
the layout change would buy), transfuse's K-major GEMV (kernels/gemv_kmajor.py) with its heuristic
config, and with --sweep the best of its config sweep at 1 row.

    PYTHONPATH=src python3 bench/kernels/bench_gemv_kmajor.py [--reps 50] [--sweep]

Timing as bench_gemv.py: one CUDA graph of back-to-back calls over enough distinct weights to
miss L2, CUDA events, median of --reps replays, us per call.
"""

import argparse

import torch
import torch.nn.functional as F

from bench_gemv import median_us  # this script's folder is on sys.path

SHAPES = [("gpt2 c_attn", 768, 2304), ("gpt2 attn c_proj", 768, 768), ("gpt2 c_fc", 768, 3072),
          ("gpt2 mlp c_proj", 3072, 768), ("gpt2-xl c_fc", 1600, 6400), ("gpt2-xl mlp c_proj", 6400, 1600)]


def graph_of(fn, calls):
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    from transfuse.kernels import gemv, gemv_kmajor

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{'shape':<20} {'M':>2} {'cublas KN':>10} {'cublas NK':>10} {'gemv NK':>9} {'gemv KN':>9}  floor us")
    for name, k, n in SHAPES:
        copies = max(8, 3 * l2 // (2 * k * n) + 1)
        w_kn = [torch.randn(k, n, device="cuda", dtype=torch.float16) / k ** 0.5 for _ in range(copies)]
        w_nk = [w.t().contiguous() for w in w_kn]
        bias = torch.randn(n, device="cuda", dtype=torch.float16)
        for m in (1, 2):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            ref = F.linear(x.float(), w_nk[0].float(), bias.float())
            cands = {
                "cublas KN": lambda: [F.linear(x, wt.t(), bias) for wt in w_kn],
                "cublas NK": lambda: [F.linear(x, wt, bias) for wt in w_nk],
                "gemv NK": lambda: [gemv.gemv_fwd(x, wt, bias) for wt in w_nk],
            }
            cands["gemv KN"] = lambda: [gemv.gemv_fwd(x, wt.t(), bias) for wt in w_kn]
            if args.sweep and m == 1:
                for conf in _sweep(k):
                    cands[conf] = lambda conf=conf: [gemv.gemv_fwd(x, wt.t(), bias, config=conf) for wt in w_kn]
            row, swept = [], {}
            for label, fn in cands.items():
                out = fn()[0]
                err = ((out.float() - ref).norm() / ref.norm()).item()
                assert err < 1e-2, (label, err)
                g = graph_of(fn, copies)
                t = median_us(g.replay, args.reps, copies)
                if isinstance(label, tuple):
                    swept[label] = t
                else:
                    row.append(t)
            floor = 2 * k * n / 3.0e12 * 1e6
            heuristic = tuple(gemv_kmajor.default_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count))
            line = f"{name:<20} {m:>2} " + " ".join(f"{t:>9.2f}" for t in row) + f"   {floor:.2f}  heuristic {heuristic}"
            if swept:
                best = sorted(swept, key=swept.get)[:3]
                line += "  best " + ", ".join(f"{c}: {swept[c]:.2f}" for c in best)
            print(line, flush=True)


def _sweep(k):
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps) configs whose tile keeps <= 64 elements a thread."""
    out = []
    for block_n in (16, 32, 64):
        for warps in (4, 8):
            for block_k in (64, 128, 256, 512, 1024):
                if block_n * block_k // (32 * warps) > 64 or block_n * block_k // (32 * warps) < 8:
                    continue
                for split in (1, 2, 4):
                    if block_k * split <= 2 * k:
                        out.append((block_n, block_k, split, warps))
    return out


if __name__ == "__main__":
    main()
