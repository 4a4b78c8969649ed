"""Where the seconds of an optimized decoder's first generate() calls go: one call per batch size in
this process (a new batch size is a call of its own), each split by timers that cost nothing.

    C=$(mktemp -d); export TRITON_CACHE_DIR=$C/triton TRANSFUSE_CACHE_DIR=$C/transfuse
    for run in empty warm; do PYTHONPATH=src python3 bench/first_generate_phases.py --batches 1,8; done

One JSON line per call: `seconds` (the whole generate(), synchronized), `backend` (Dynamo traces
handed to transfuse's backend: its passes and compile, the trace itself is in `dynamo`), `capture`
(CUDA-graph captures of buckets and of decode steps, their warm-up launches included), `gemm_timing`
(the GEMM dispatcher timing candidates for a new shape), `triton` (Triton compiles: count, seconds
summed over threads, cache hits), `traces` (Dynamo frames compiled during the call) and `dynamo`
(Dynamo's own split, torch._dynamo.utils.compile_times, summed since the process started).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from triton import knobs

import transfuse
from transfuse import backend
from transfuse.bench import decoder
from transfuse.ops import gemm
from transfuse.runtime import cuda_graphs, decode_loop
from first_call_phases import SECONDS, timed  # this script's folder is on sys.path

COMPILES = {"count": 0, "seconds": 0.0, "cache_hits": 0}


def listener(*, src, metadata, times, cache_hit, **_):
    COMPILES["count"] += 1
    COMPILES["cache_hits"] += int(bool(cache_hit))
    stages = times.ir_initialization + sum(us for _, us in times.lowering_stages) + times.store_results
    COMPILES["seconds"] += stages / 1e6


def _frames() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-1.1b", choices=sorted(decoder.GEOMETRIES))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1 (--model tiny)")
    cli = parser.parse_args()
    knobs.compilation.listener = listener
    timed(backend.Backend, "__call__", "backend")
    timed(cuda_graphs.GraphCache, "capture", "capture")
    timed(decode_loop.DecodeLoop, "_capture", "capture")
    timed(gemm, "_measure", "gemm_timing")
    device = torch.device(cli.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    model = decoder.fresh_copy(decoder.make_model(cli.model), device, torch.float16 if device.type == "cuda" else torch.float32)
    transfuse.optimize(model)
    print(json.dumps({"setup_s": round(time.perf_counter() - start, 3)}), flush=True)
    call = decoder._generate(model, "transfuse")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for batch in [int(b) for b in cli.batches.split(",") if b]:
            ids = torch.randint(3, model.config.vocab_size, (batch, cli.prompt), generator=gen).to(device)
            SECONDS.clear()
            COMPILES.update(count=0, seconds=0.0, cache_hits=0)
            frames = _frames()
            sync()
            start = time.perf_counter()
            call(ids, cli.new_tokens)
            sync()
            seconds = time.perf_counter() - start
            again = time.perf_counter()
            call(ids, cli.new_tokens)
            sync()
            names, values = torch._dynamo.utils.compile_times(repr="csv")
            print(json.dumps({"batch": batch, "seconds": round(seconds, 3), "second_call_s": round(time.perf_counter() - again, 3),
                              **{k: round(v, 3) for k, v in SECONDS.items() if not k.endswith("_end")}, "triton": dict(COMPILES),
                              "traces": _frames() - frames, "dynamo": dict(zip(names, values))}), flush=True)
    print(transfuse.report(model))


if __name__ == "__main__":
    main()
