"""Decode linears of a batch (4, 8, 16 rows) on Llama-1.1B and Llama-7B weights: transfuse's
swap-AB tensor-core kernel (transfuse.kernels.gemm_few_rows) over a sweep of its configs, against
cuBLAS (F.linear + the epilogue as PyTorch ops), transfuse's 16-row Triton GEMM (gemm.linear_fwd
with the dispatcher's fixed tile, split-K as the dispatcher would time it) and the GEMV.
--splits-only: the default config at every split (split programs finish in the last one to arrive).

    PYTHONPATH=src python3 bench/kernels/bench_few_rows.py                 # 8 rows, llama-1.1b
    PYTHONPATH=src python3 bench/kernels/bench_few_rows.py --m 4,8,16 --models 1.1b,7b --json r.json
    PYTHONPATH=src python3 bench/kernels/bench_few_rows.py --m 8,16 --models 1.1b,bert-base --splits-only

Method: bench_gemv.py's (one CUDA graph of back-to-back calls over enough weight copies that each
call reads its weight from HBM; median of --reps replays; every candidate checked against fp32
first). GB/s: weight + x + out (+ residual) bytes over the time, against the copy bandwidth
measured in the same run.
"""

import datetime
import itertools
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
from bench_gemv import device_header, graph_us, parse_sweep_args, sweep_problems, torch_linear  # noqa: E402


def sweep_configs(gated: bool, k: int, elem: int) -> list[tuple]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_stages, num_warps) that fit 200 KB of shared memory and give
    every split at least two K steps."""
    out = []
    for block_n, block_k, stages, split in itertools.product((32, 64, 128), (64, 128, 256), (3, 5), (1, 2, 4, 8)):
        rows = 2 * block_n if gated else block_n
        if stages * (rows + 16) * block_k * elem > 200 * 1024:
            continue
        if k < 2 * block_k * split:
            continue
        out.append((block_n, block_k, split, stages, 4))
    return out


def main():
    from transfuse.kernels import gemm as gemm_kernels
    from transfuse.kernels.gemm_few_rows import default_config, few_rows_fwd
    from transfuse.kernels.gemv import gemv_fwd

    args, ms, models, dtype, elem = parse_sweep_args(__doc__, m="8", models="1.1b", reps=30)
    t_start = time.time()
    props, l2_bytes, copy_bw = device_header(args.dtype)
    results = []
    for p in sweep_problems(models, ms, dtype, l2_bytes):
        model, layer, N, K, act, has_res, M, x, weights, r, gold, moved = p
        copies, gated = len(weights), act == "silu_mul"
        tile = gemm_kernels.fixed_tile(M, gated, elem)
        candidates = {"torch": lambda i: torch_linear(x, weights[i], act, r)}
        for split in sorted({1, gemm_kernels.default_split_k(M, N, K, x.device)}):
            candidates[f"gemm/split{split}"] = (
                lambda i, s=split: gemm_kernels.linear_fwd(x, weights[i], None, act, r, split_k=s, tile=tile))
        candidates["gemv"] = lambda i: gemv_fwd(x, weights[i], None, act, r)
        heuristic = tuple(default_config(gated))
        if args.splits_only:  # the default tile at every split that keeps whole K steps per split
            steps = -(-K // heuristic[1])
            configs = [heuristic[:2] + (s,) + heuristic[3:] for s in range(1, 9) if steps % s == 0]
        else:
            configs = sweep_configs(gated, K, elem)
        if heuristic not in configs:
            configs.append(heuristic)
        for conf in configs:
            candidates[str(conf)] = lambda i, c=conf: few_rows_fwd(x, weights[i], None, act, r, config=c)
        times = {}
        for name, fn in candidates.items():
            try:
                err = ((fn(0).float() - gold).norm() / gold.norm()).item()
                if not err < 1e-2:
                    raise AssertionError(f"relative error {err:.3g}")
                times[name] = graph_us(fn, copies, args.reps)
            except Exception as e:  # noqa: BLE001 - a config that fails to compile or launch is reported, not fatal
                print(f"  {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        few = [str(c) for c in configs if str(c) in times]
        best = min(few, key=times.get)
        base = min((n for n in times if not n.startswith("(")), key=times.get)
        row = dict(model=model, layer=layer, N=N, K=K, M=M, activation=act, residual=has_res, bytes=moved,
                   times_us=times, heuristic=str(heuristic), best=best, best_other=base)
        results.append(row)
        top = sorted(few, key=times.get)[:5]
        print(f"{model} {layer:16s} M={M:2d} torch {times.get('torch', float('nan')):6.1f} "
              f"gemm {min(times.get(n, 1e9) for n in times if n.startswith('gemm')):6.1f} "
              f"gemv {times.get('gemv', float('nan')):6.1f} | few heuristic {times.get(str(heuristic), float('nan')):6.1f} "
              f"best {times[best]:6.1f} us {moved / times[best] / 1e3:5.0f} GB/s "
              f"({100 * moved / times[best] / 1e3 / copy_bw:3.0f}% copy) {best}", flush=True)
        print("      top: " + "  ".join(f"{n}={times[n]:.1f}" for n in top), flush=True)
    print(f"({time.time() - t_start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=props.name, torch=torch.__version__, triton=triton.__version__,
                           date=datetime.date.today().isoformat(), dtype=args.dtype, copy_gbps=copy_bw,
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
