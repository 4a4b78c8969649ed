"""Where the precompile at a bucketed runner's second bucket spends its time (issue 3's stream).

    C=$(mktemp -d); export TRITON_CACHE_DIR=$C/triton TRANSFUSE_CACHE_DIR=$C/transfuse
    PYTHONPATH=src python3 bench/precompile_phases.py [--workers N]

bert-base fp16: a first call at 8x128, then a call at 4x64 (another bucket), whose capture dry-runs
every bucket (runtime/precompile.py). Triton's compilation listener records each compile: its wall
interval, the thread, and its stages (make_ir is Triton's Python code generator; ttir/ttgir/llir are
MLIR passes; ptx is LLVM; cubin is ptxas). --workers 1 compiles one at a time: each stage's own cost,
no lock contention. A compile in a forked worker (runtime/precompile.py's default) is not seen here:
only its load, from the disk cache, in this process. Prints a JSON summary: the precompile's seconds, the dry run's, the sum of each
stage over the compiles, how many compiles ran at once on average, the slowest kernels.
"""

import argparse
import contextlib
import cProfile
import json
import pstats
import threading
import time
from collections import defaultdict

import torch
from triton import knobs

from transfuse.bench import dynamic, timing
from transfuse.runtime import buckets, precompile

EVENTS: list[dict] = []


def listener(*, src, metadata, times, cache_hit, **_):
    end = time.perf_counter()
    stages = {"make_ir": times.ir_initialization / 1e6}
    stages.update({name: us / 1e6 for name, us in times.lowering_stages})
    total = sum(stages.values()) + times.store_results / 1e6
    name = getattr(getattr(src, "fn", None), "__name__", None) or metadata.get("name", "?")
    EVENTS.append(dict(name=name, thread=threading.current_thread().name, start=end - total, end=end,
                       total=total, stages=stages, cache_hit=cache_hit))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=None, help="compile threads (default: precompile's)")
    parser.add_argument("--profile", default=None,
                        help="write cProfile's top functions of the second call and of a third (a new bucket) here")
    cli = parser.parse_args()
    knobs.compilation.listener = listener
    if cli.workers:
        original = precompile.compile_only
        precompile.compile_only = lambda workers=None, processes=True: original(cli.workers, processes)
    spans: dict[str, list[float]] = {}
    original_precompile = buckets.PaddedRunner._precompile

    def timed_precompile(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original_precompile(self, *args, **kwargs)
        finally:
            spans.setdefault("every_bucket" if kwargs.get("every_bucket", args[-1]) else "first_bucket",
                             [start, time.perf_counter()])

    buckets.PaddedRunner._precompile = timed_precompile
    run_args = argparse.Namespace(config="bert-base", dtype="fp16", attn="sdpa")
    model, inputs = dynamic.first_call_model(run_args, torch.device("cuda"))
    second = {k: v[:4, :64].contiguous() for k, v in inputs.items()}
    with torch.inference_mode():
        first, _ = timing.time_first_call(model, inputs, cuda=True)
        traces = [dynamic._dynamo_frames()]
        profile = cProfile.Profile() if cli.profile else None
        second_s = _call(model, second, profile)
        traces.append(dynamic._dynamo_frames())
        if profile:
            third = {k: v[:, :32].repeat(2, 1).contiguous() for k, v in inputs.items()}  # 16x32: another bucket
            third_profile = cProfile.Profile()
            third_s = _call(model, third, third_profile)
            traces.append(dynamic._dynamo_frames())
            with open(cli.profile, "w") as f:
                for label, prof, seconds in (("second call", profile, second_s), ("third call", third_profile, third_s)):
                    f.write(f"==== {label}: {seconds:.3f} s\n")
                    pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(45)
                    pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(25)
    lo, hi = spans.get("every_bucket", [0.0, 0.0])
    during = [e for e in EVENTS if lo <= e["end"] <= hi + 1e-3]
    inside = [e for e in during if not e["cache_hit"]]  # in forked workers (the default) none: they load
    per_stage: dict[str, float] = defaultdict(float)
    for e in inside:
        for stage, s in e["stages"].items():
            per_stage[stage] += s
    busy = sum(e["total"] for e in inside)
    slowest = sorted(inside, key=lambda e: -e["total"])[:12]
    runners = [r for b in model._transfuse_state.backends for r in b.runners]
    stats = next((r.precompiled for r in runners if getattr(r, "precompiled", None)), None) or {}
    print(json.dumps({
        "first_call_s": round(first, 3), "second_call_s": round(second_s, 3),
        "dynamo_traces_after_each_call": traces,
        "precompile_s": round(hi - lo, 3), "dry_run_s": round(stats.get("dry_run_seconds", float("nan")), 3),
        "how": stats.get("how"), "compiles": len(inside), "loads": len(during) - len(inside),
        "load_seconds_summed": round(sum(e["total"] for e in during if e["cache_hit"]), 2), "compile_seconds_summed": round(busy, 2),
        "mean_concurrency": round(busy / (hi - lo), 2) if hi > lo else None,
        "stage_seconds_summed": {k: round(v, 2) for k, v in per_stage.items()},
        "kernels": {n: sum(1 for e in inside if e["name"] == n) for n in sorted({e["name"] for e in inside})},
        "slowest": [dict(name=e["name"], total=round(e["total"], 2),
                         stages={k: round(v, 2) for k, v in e["stages"].items()}) for e in slowest],
    }, indent=1))


def _call(model, inputs: dict, profile: cProfile.Profile | None) -> float:
    """Seconds of one call (timing.time_first_call), under `profile` when given."""
    with profile or contextlib.nullcontext():
        seconds, _ = timing.time_first_call(model, inputs, cuda=True)
    return seconds


if __name__ == "__main__":
    main()
