"""Decode linears of a batch, the weight shared evenly among the programs
(transfuse.kernels.gemm_few_rows_stream) over a sweep of its configs, against cuBLAS (F.linear + the
epilogue as PyTorch ops) and gemm_few_rows (its default tile at every split the dispatcher times).

    PYTHONPATH=src python3 bench/kernels/bench_few_rows_stream.py                  # 8 rows, llama-1.1b
    PYTHONPATH=src python3 bench/kernels/bench_few_rows_stream.py --m 4,8,16 --models 1.1b,7b,bert-base --json r.json

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


def stream_configs(gated: bool, elem: int) -> list[tuple]:
    """(BLOCK_N, BLOCK_K, num_stages, num_warps, programs_per_sm) within 200 KB of shared memory per
    SM (all its programs together)."""
    out = []
    for block_n, block_k, stages, per_sm in itertools.product((32, 64), (64, 128, 256), (3, 4, 6, 8), (1, 2)):
        rows = 2 * block_n if gated else block_n
        if per_sm * stages * (rows + 16) * block_k * elem > 200 * 1024:
            continue
        out.append((block_n, block_k, stages, 4, per_sm))
    return out


def main():
    from transfuse.kernels.gemm_few_rows import default_config, few_rows_fwd, split_candidates
    from transfuse.kernels.gemm_few_rows_stream import few_rows_stream_fwd

    args, ms, models, dtype, elem = parse_sweep_args(__doc__, m="8", models="1.1b", reps=30)
    t_start = time.time()
    props, l2_bytes, copy_bw = device_header(args.dtype)
    results = []
    for p in sweep_problems(models, ms, dtype, l2_bytes):
        model, layer, N, K, act, has_res, M, x, weights, r, gold, moved = p
        copies, gated = len(weights), act == "silu_mul"
        candidates = {"torch": lambda i: torch_linear(x, weights[i], act, r)}
        for split in split_candidates(N, K, x.device, gated):
            candidates[f"few/split{split}"] = lambda i, s=split: few_rows_fwd(x, weights[i], None, act, r, split_k=s)
        configs = stream_configs(gated, elem)
        for conf in configs:
            candidates[str(conf)] = lambda i, c=conf: few_rows_stream_fwd(x, weights[i], None, act, r, config=c)
        times = {}
        for name, fn in candidates.items():
            try:
                err = ((fn(0).float() - gold).norm() / gold.norm()).item()
                if not err < 1e-2:
                    raise AssertionError(f"relative error {err:.3g}")
                times[name] = graph_us(fn, copies, args.reps)
            except Exception as e:  # noqa: BLE001 - a config that fails to compile or launch is reported, not fatal
                print(f"  {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        stream = [str(c) for c in configs if str(c) in times]
        few = min((n for n in times if n.startswith("few")), key=times.get)
        best = min(stream, key=times.get)
        row = dict(model=model, layer=layer, N=N, K=K, M=M, activation=act, residual=has_res, bytes=moved,
                   times_us=times, best=best, best_few=few)
        results.append(row)
        print(f"{model} {layer:16s} M={M:2d} torch {times.get('torch', float('nan')):6.1f} "
              f"few {times[few]:6.1f} ({few}) | stream best {times[best]:6.1f} us "
              f"{moved / times[best] / 1e3:5.0f} GB/s ({100 * moved / times[best] / 1e3 / copy_bw:3.0f}% copy) {best}",
              flush=True)
        print("      top: " + "  ".join(f"{n}={times[n]:.1f}" for n in sorted(stream, key=times.get)[:6]), flush=True)
    print(f"({time.time() - t_start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=props.name, torch=torch.__version__, triton=triton.__version__,
                           date=datetime.date.today().isoformat(), dtype=args.dtype, copy_gbps=copy_bw,
                           few_rows_default=[list(default_config(False)), list(default_config(True))],
                           results=results), f, indent=1)


if __name__ == "__main__":
    main()
