"""Decode-size linears (1, 2, 8 and 16 rows) on Llama-1.1B and Llama-7B weights: transfuse's
weight-streaming GEMV (transfuse.kernels.gemv) with every config of its sweep, against cuBLAS
(F.linear + the epilogue as PyTorch ops) and transfuse's Triton GEMM (gemm.linear_fwd, autotuned).

    PYTHONPATH=src python3 bench/kernels/bench_gemv.py                    # the table (fp16), ~1-2 min
    PYTHONPATH=src python3 bench/kernels/bench_gemv.py --m 1,2,4 --models 7b --dtype bf16
    PYTHONPATH=src python3 bench/kernels/bench_gemv.py --json results.json

Method: each candidate is timed inside one CUDA graph of back-to-back calls over `copies` distinct
weight tensors (at least 8, and at least 3x the L2 size in all), so that every call reads its
weight from HBM as a model's layers do, while x, the residual and the output stay in L2 as they
would; CUDA events around each replay, median of --reps replays, divided by the number of calls.
Every candidate is checked against an fp32 reference before it is timed.

GB/s counts the bytes a call must move: weight + x + out (+ residual), over its time, and is
compared with the device-to-device copy bandwidth measured in the same run (2 * bytes / time of a
1 GiB copy): the practical ceiling, below the 3.35 TB/s datasheet figure of an H100 SXM.

Columns: torch = cuBLAS through F.linear then the epilogue ops (chunk, silu, mul, add) in eager
PyTorch; triton = gemm.linear_fwd (16-row tensor-core tile, split-K, autotuned on first call);
gemv = gemv_fwd with the launcher's heuristic config; best = the fastest config of the sweep
(BLOCK_N, BLOCK_K, SPLIT_K, num_warps).
"""

import argparse
import datetime
import json
import math
import statistics
import time

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton

# (model, layer, N, K, activation, residual): N output columns (silu_mul weights have 2N rows)
SHAPES = [
    ("llama-1.1b", "qkv", 2560, 2048, "none", False),
    ("llama-1.1b", "o+res", 2048, 2048, "none", True),
    ("llama-1.1b", "gate_up+silu_mul", 5632, 2048, "silu_mul", False),
    ("llama-1.1b", "down+res", 2048, 5632, "none", True),
    ("llama-1.1b", "lm_head", 32000, 2048, "none", False),
    ("llama-7b", "qkv", 12288, 4096, "none", False),
    ("llama-7b", "o+res", 4096, 4096, "none", True),
    ("llama-7b", "gate_up+silu_mul", 11008, 4096, "silu_mul", False),
    ("llama-7b", "down+res", 4096, 11008, "none", True),
    ("llama-7b", "lm_head", 32000, 4096, "none", False),
    ("bert-base", "qkv", 2304, 768, "none", False),
    ("bert-base", "o+res", 768, 768, "none", True),
    ("bert-base", "up+gelu", 3072, 768, "gelu", False),
    ("bert-base", "down+res", 768, 3072, "none", True),
]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def median_us(run, reps: int, calls: int = 1) -> float:
    """Median over `reps` runs of run() between two CUDA events, in us per call for a run() of
    `calls` calls. Also bench_small_m.py's timer."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def graph_us(call, copies: int, reps: int) -> float:
    """Median time of one call, from replays of a CUDA graph of `call(0) .. call(copies - 1)`."""
    for i in range(copies):  # compiles, autotunes and loads every kernel outside the capture
        call(i)
    torch.cuda.synchronize()
    from transfuse.kernels import split_counters

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    split_counters.reserve(stream.device, stream)  # as the runtime's capture stream has them
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for i in range(copies):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    us = median_us(graph.replay, reps, calls=copies)
    del graph
    return us


def copy_gbps(reps: int = 30) -> float:
    src = torch.randn(2**29, device="cuda", dtype=torch.float16)  # 1 GiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    seconds = median_us(lambda: dst.copy_(src), reps) * 1e-6
    return 2 * src.numel() * src.element_size() / seconds / 1e9


def torch_linear(x, w, act, r):
    """cuBLAS and the epilogue as PyTorch ops (the gated and plain activations of SHAPES)."""
    h = F.linear(x, w)
    if act == "silu_mul":
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    elif act == "gelu":
        h = F.gelu(h)
    elif act != "none":
        raise ValueError(f"torch_linear: no activation {act!r}")
    return h + r if r is not None else h


def cfg_str(conf) -> str:
    return "(" + ",".join(str(v) for v in conf) + ")"


def parse_sweep_args(doc: str, m: str, models: str, reps: int):
    """The decode-linear sweeps' command line (this script's and bench_few_rows.py's), with their
    defaults: (args, row counts, model names, dtype, element size)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--m", default=m, help="row counts, comma-separated (<= 16)")
    parser.add_argument("--models", default=models, help="which of llama-1.1b, llama-7b, bert-base")
    parser.add_argument("--splits-only", action="store_true",
                        help="bench_few_rows.py: the default config at each split, not the whole sweep")
    parser.add_argument("--dtype", default="fp16", choices=list(DTYPES))
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--json", help="write every measurement to this file")
    args = parser.parse_args()
    ms = [int(r) for r in args.m.split(",")]
    names = {n if n.startswith("bert") else f"llama-{n.removeprefix('llama-')}"
             for n in (m.strip().lower() for m in args.models.split(","))}
    dtype = DTYPES[args.dtype]
    return args, ms, names, dtype, torch.finfo(dtype).bits // 8


def device_header(dtype_name: str):
    """Prints the GPU, versions, date, dtype, copy bandwidth and L2 size; returns (properties, L2
    bytes, copy bandwidth in GB/s)."""
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 * 2**20)
    copy_bw = copy_gbps()
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.date.today().isoformat()}, {dtype_name}; copy bandwidth {copy_bw:.0f} GB/s, "
          f"L2 {l2_bytes / 2**20:.0f} MiB", flush=True)
    return props, l2_bytes, copy_bw


class Problem(NamedTuple):
    """One linear of SHAPES at M rows: x, its weight copies (every call reads one from HBM), the
    residual or None, the fp32 reference output and the bytes a call must move."""
    model: str
    layer: str
    N: int
    K: int
    act: str
    has_res: bool
    M: int
    x: torch.Tensor
    weights: list
    r: torch.Tensor | None
    gold: torch.Tensor
    moved: int


def sweep_problems(models: set, ms: list, dtype: torch.dtype, l2_bytes: int):
    """The decode-linear sweeps' problems, shape by shape and then row count by row count, from one
    seeded generator; a shape's weight copies are freed before the next shape's are made."""
    from transfuse.reference.gemm import linear_ref

    elem = torch.finfo(dtype).bits // 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    for model, layer, N, K, act, has_res in SHAPES:
        if model not in models:
            continue
        rows = 2 * N if act == "silu_mul" else N
        w_bytes = rows * K * elem
        copies = max(8, math.ceil(3 * l2_bytes / w_bytes))
        weights = [(torch.randn(rows, K, device="cuda", generator=gen) * K**-0.5).to(dtype)
                   for _ in range(copies)]
        for M in ms:
            x = torch.randn(M, K, device="cuda", generator=gen).to(dtype)
            r = torch.randn(M, N, device="cuda", generator=gen).to(dtype) if has_res else None
            gold = linear_ref(x, weights[0], None, act, r, upcast=True)
            moved = w_bytes + (M * K + M * N * (2 if has_res else 1)) * elem
            yield Problem(model, layer, N, K, act, has_res, M, x, weights, r, gold, moved)
        weights.clear()  # free this shape's copies before the next shape's
        torch.cuda.empty_cache()


def main():
    from transfuse.kernels.gemm import linear_fwd
    from transfuse.kernels._config import num_sms
    from transfuse.kernels.gemv import default_config, gemv_configs, gemv_fwd

    args, ms, models, dtype, _ = parse_sweep_args(__doc__, m="1,2,8,16", models="1.1b,7b", reps=50)
    t_start = time.time()
    props, l2_bytes, copy_bw = device_header(args.dtype)

    results = []
    for p in sweep_problems(models, ms, dtype, l2_bytes):
        model, layer, N, K, act, has_res, M, x, weights, r, gold, moved = p
        copies = len(weights)

        def checked(fn, name):
            err = ((fn(0).float() - gold).norm() / gold.norm()).item()
            if not err < 1e-2:
                raise AssertionError(f"{model} {layer} M={M} {name}: relative error {err:.3g}")

        candidates = {
            "torch": lambda i: torch_linear(x, weights[i], act, r),
            "triton": lambda i: linear_fwd(x, weights[i], None, act, r),
        }
        chosen = default_config(M, N, K, num_sms(x.device), act == "silu_mul")
        sweep = list(gemv_configs(M, act == "silu_mul"))
        if chosen not in sweep:
            sweep.append(chosen)
        for conf in sweep:
            candidates[cfg_str(conf)] = lambda i, conf=conf: gemv_fwd(x, weights[i], None, act, r, config=conf)
        times = {}
        for name, fn in candidates.items():
            checked(fn, name)
            times[name] = graph_us(fn, copies, args.reps)
        gemv_names = [cfg_str(conf) for conf in sweep]
        best = min(gemv_names, key=times.get)
        row = dict(model=model, layer=layer, N=N, K=K, M=M, activation=act, residual=has_res,
                   bytes=moved, copies=copies, times_us=times, heuristic=cfg_str(chosen), best=best)
        results.append(row)
        gbps = {name: moved / t / 1e3 for name, t in times.items()}
        print(f"{model:10s} {layer:16s} N={N:5d} K={K:5d} M={M:2d}  "
              f"torch {times['torch']:6.1f} us {gbps['torch']:5.0f} GB/s | "
              f"triton {times['triton']:6.1f} | gemv {times[cfg_str(chosen)]:6.1f} {cfg_str(chosen)} | "
              f"best {times[best]:6.1f} us {gbps[best]:5.0f} GB/s ({100 * gbps[best] / copy_bw:3.0f}% of copy) "
              f"{best}", flush=True)
        print("      sweep: " + "  ".join(f"{n}={times[n]:.1f}" for n in gemv_names), flush=True)

    print(f"\nus per call ({args.dtype}, weights from HBM); GB/s and % of the {copy_bw:.0f} GB/s copy "
          f"bandwidth for gemv's best config; x = torch time / gemv (heuristic) time")
    header = ("model", "layer", "M", "torch", "triton", "gemv", "best", "config", "GB/s", "%copy", "x torch")
    table = []
    for row in results:
        t = row["times_us"]
        gb = row["bytes"] / t[row["best"]] / 1e3
        table.append((row["model"], row["layer"], str(row["M"]), f"{t['torch']:.1f}", f"{t['triton']:.1f}",
                      f"{t[row['heuristic']]:.1f}", f"{t[row['best']]:.1f}", row["best"], f"{gb:.0f}",
                      f"{100 * gb / copy_bw:.0f}", f"{t['torch'] / t[row['heuristic']]:.2f}"))
    widths = [max(len(str(c)) for c in col) for col in zip(header, *table)]
    for line in (header, tuple("-" * w for w in widths), *table):
        print("  ".join(f"{c:>{w}}" for c, w in zip(line, widths)))
    print(f"({time.time() - t_start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=props.name, torch=torch.__version__, triton=triton.__version__,
                           date=datetime.date.today().isoformat(), dtype=args.dtype,
                           copy_gbps=copy_bw, results=results), f, indent=1)


if __name__ == "__main__":
    main()
