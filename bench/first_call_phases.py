"""The first transfuse call of bert-base (fp16, 8x128) in a fresh process, split into its phases.

    C=$(mktemp -d); export TRITON_CACHE_DIR=$C/triton TRANSFUSE_CACHE_DIR=$C/transfuse
    for run in empty warm warm warm; do echo "$run $(PYTHONPATH=src python3 bench/first_call_phases.py)"; done

Prints one JSON line of seconds from the call's start: `backend_end` (Dynamo's trace and transfuse's
backend), `precompile` / `precompile_end` (the first bucket's dry run), `capture` / `capture_end`
(the CUDA-graph capture, its warm-up launches included), `first_call`, and Dynamo's own split
(torch._dynamo.utils.compile_times). Unlike cProfile (bench/profile_first_call.py), the timers cost
nothing, so the seconds are the call's own.
"""

import argparse
import json
import time

import torch

from transfuse import backend
from transfuse.bench import dynamic, timing
from transfuse.runtime import buckets, cuda_graphs

SECONDS: dict[str, float] = {}


def timed(owner, name: str, label: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            SECONDS[label] = SECONDS.get(label, 0.0) + time.perf_counter() - start
            SECONDS[label + "_end"] = time.perf_counter()

    setattr(owner, name, wrapper)


def main() -> None:
    timed(backend.Backend, "__call__", "backend")
    timed(buckets.PaddedRunner, "_precompile", "precompile")
    timed(cuda_graphs.GraphCache, "capture", "capture")
    args = argparse.Namespace(config="bert-base", dtype="fp16", attn="sdpa")
    model, inputs = dynamic.first_call_model(args, torch.device("cuda"))
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        seconds, _ = timing.time_first_call(model, inputs, cuda=True)
    out = {k: round(v - start if k.endswith("_end") else v, 3) for k, v in SECONDS.items()}
    out["first_call"] = round(seconds, 3)
    names, values = torch._dynamo.utils.compile_times(repr="csv")
    out["dynamo"] = dict(zip(names, values))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
