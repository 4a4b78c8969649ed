"""A stream of requests of every shape (`transfuse bench --dynamic`): total wall time, warm-up included.

bert-base geometry, random weights, fp16, one GPU. The stream: `--requests` requests with a fixed
seed, sequence length log-normal over [8, 512] (median 64), batch uniform in [1, 32], random token
ids and a full attention mask; every request's inputs are on the GPU before the clock starts. Per
provider (HF eager, torch.compile default, torch.compile reduce-overhead, transfuse), each on its own
copy of the model after a Dynamo reset, in one process:

- total seconds for the whole stream, from a cold start (the first call's compilation counts);
- first-call seconds, and for transfuse the seconds to serve the first shape of a new bucket;
- Dynamo traces (for torch.compile: frames compiled; each after the first is a recompile);
- for transfuse: CUDA graphs captured, pool memory, buckets used.

With `--first-call-only` the process runs one transfuse call and prints its seconds: the bench starts
that twice in fresh processes sharing a new Triton cache directory, first empty, then warm.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import torch._dynamo

from transfuse.bench import encoder, timing

DESCRIPTION = "a stream of requests of random shapes: total wall time incl. warm-up, first-call and new-bucket seconds"
DEFAULT_PROVIDERS = "eager,compile,compile-ro,transfuse"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--providers", default=DEFAULT_PROVIDERS)
    parser.add_argument("--dtype", default="fp16", choices=sorted(encoder.DTYPES))
    parser.add_argument("--config", default="bert-base", choices=["bert-base", "tiny"])
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--compile-dynamic", default="auto", choices=["auto", "false"])
    parser.add_argument("--first-call-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--skip-cold-start", action="store_true", help="do not start the two first-call processes")


def request_shapes(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    shapes = []
    for _ in range(n):
        seq = int(round(math.exp(rng.gauss(math.log(64), 0.9))))
        shapes.append((rng.randint(1, 32), min(512, max(8, seq))))
    return shapes


def _providers(args) -> dict[str, Callable]:
    import transfuse

    def compile_ro(model):
        compiled = torch.compile(model, mode="reduce-overhead", dynamic=encoder._compile_dynamic(args))

        def call(**inputs):
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(**inputs)

        return call

    return {
        "eager": lambda m: m,
        "compile": lambda m: torch.compile(m, dynamic=encoder._compile_dynamic(args)),
        "compile-ro": compile_ro,
        "transfuse": lambda m: transfuse.optimize(m),
    }


def _dynamo_frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def first_call_model(args, device) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model of args (config, dtype, attn) on `device`, optimized and not yet called, and its 8x128
    inputs (also bench/first_call_phases.py's)."""
    import transfuse

    dtype = encoder.DTYPES[args.dtype]
    model = encoder.make_model(encoder.make_config(args), 0).to(device=device, dtype=dtype)
    inputs = encoder.make_inputs(8, 128, model.config.vocab_size, 0.0, 0, device)
    return transfuse.optimize(model), inputs


def _first_call(args, device) -> None:
    """--first-call-only: one transfuse call in this fresh process; prints JSON."""
    import transfuse

    model, inputs = first_call_model(args, device)
    with torch.inference_mode():
        seconds, _ = timing.time_first_call(model, inputs, cuda=True)
    lines = [line.strip() for line in transfuse.report(model).splitlines() if "precompile" in line]
    print(json.dumps({"first_call_s": seconds, "precompile": lines}))


def _cold_starts(args) -> dict[str, float]:
    """First-call seconds in fresh processes: empty caches, then warm ones (same cache directory)."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(cache, "triton"), TRANSFUSE_CACHE_DIR=os.path.join(cache, "transfuse"))
        for label in ("empty_caches", "warm_caches"):
            cmd = [sys.executable, "-m", "transfuse.bench", "--model", "dynamic", "--first-call-only",
                   "--config", args.config, "--dtype", args.dtype, "--attn", args.attn]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            line = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            out[label] = json.loads(line[-1])["first_call_s"] if line else float("nan")
            if line:
                out[label + "_precompile"] = json.loads(line[-1]).get("precompile", [])
            if not line:
                print(proc.stderr[-2000:], file=sys.stderr)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not torch.cuda.is_available():
        raise SystemExit("transfuse bench --dynamic needs a CUDA GPU")
    device = torch.device("cuda")
    if args.first_call_only:
        _first_call(args, device)
        raise SystemExit(0)
    torch._dynamo.config.recompile_limit = 1024
    dtype = encoder.DTYPES[args.dtype]
    master = encoder.make_model(encoder.make_config(args), 0)
    vocab = master.config.vocab_size
    shapes = request_shapes(args.requests, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    stream = [{"input_ids": torch.randint(0, vocab, (b, s), generator=gen).to(device),
               "attention_mask": torch.ones(b, s, dtype=torch.long, device=device)} for b, s in shapes]
    rows = []
    factories = _providers(args)
    for name in [p for p in args.providers.split(",") if p]:
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        model = copy.deepcopy(master).to(device=device, dtype=dtype)
        frames0 = _dynamo_frames()
        row: dict[str, Any] = {"provider": name}
        try:
            fn = factories[name](model)
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.inference_mode():
                for i, inputs in enumerate(stream):
                    fn(**inputs)
                    if i == 0:
                        torch.cuda.synchronize()
                        row["first_call_s"] = time.perf_counter() - start
            torch.cuda.synchronize()
            row["total_s"] = time.perf_counter() - start
            row["dynamo_graphs"] = _dynamo_frames() - frames0
            if name == "transfuse":
                row.update(_transfuse_details(model, stream, device))
        except Exception as e:  # noqa: BLE001 - one provider failing must not end the run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model
    results = {
        "benchmark": "dynamic",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "transformers": __import__("transformers").__version__,
        "date": time.strftime("%Y-%m-%d"),
        "requests": args.requests,
        "seed": args.seed,
        "distinct_shapes": len(set(shapes)),
        "dtype": args.dtype,
        "rows": rows,
    }
    if not args.skip_cold_start:
        results["transfuse_first_call"] = _cold_starts(args)
    return results


def _transfuse_details(model, stream, device) -> dict[str, Any]:
    import transfuse

    state = model._transfuse_state
    pool = state.backend.pool
    runners = [r for b in state.backends for r in b.runners if hasattr(r, "stats")]
    # A bucket not seen yet: the largest batch bucket at a sequence bucket the stream never used.
    used = {key for r in runners for key in r.stats}
    new_bucket_s = None
    for batch, seq in [(b, s) for s in (512, 256, 128, 64) for b in (2, 3, 5, 9, 17)]:
        inputs = {"input_ids": torch.zeros(batch, seq, dtype=torch.long, device=device),
                  "attention_mask": torch.ones(batch, seq, dtype=torch.long, device=device)}
        before = sum(len(r.stats) for r in runners)
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            model(**inputs)
        torch.cuda.synchronize()
        if sum(len(r.stats) for r in runners) > before:
            new_bucket_s = time.perf_counter() - start
            break
    return {
        "graphs_captured": pool.graphs_captured,
        "pool_mib": pool.bytes_reserved / 2**20,
        "buckets_used": len(used),
        "new_bucket_s": new_bucket_s,
        "report": transfuse.report(model),
    }


def summarize(results: dict[str, Any]) -> str:
    rows = {r["provider"]: r for r in results["rows"]}
    lines = [
        f"{results['requests']} requests ({results['distinct_shapes']} distinct shapes), bert-base {results['dtype']}, "
        f"{results['gpu']}, torch {results['torch']}, triton {results['triton']}, {results['date']}",
        "",
        "| provider | total s | first call s | Dynamo graphs | total / transfuse's |",
        "|---|---|---|---|---|",
    ]
    ours = rows.get("transfuse", {}).get("total_s")
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error']} | | | |")
            continue
        ratio = f"{r['total_s'] / ours:.2f}" if ours and name != "transfuse" else ""
        lines.append(f"| {name} | {r['total_s']:.2f} | {r['first_call_s']:.2f} | {r['dynamo_graphs']} | {ratio} |")
    t = rows.get("transfuse", {})
    if "graphs_captured" in t:
        lines += ["", f"transfuse: {t['graphs_captured']} CUDA graphs captured, pool {t['pool_mib']:.0f} MiB, "
                  f"{t['buckets_used']} buckets used, new bucket served in {t['new_bucket_s'] or float('nan'):.2f} s"]
    cold = results.get("transfuse_first_call")
    if cold:
        lines.append(f"transfuse first call in a fresh process: {cold['empty_caches']:.1f} s with empty caches, "
                     f"{cold['warm_caches']:.1f} s with warm caches")
        for label in ("empty_caches", "warm_caches"):
            lines += [f"  {label}: {text}" for text in cold.get(label + "_precompile", [])]
    return "\n".join(lines)


def write_and_print(results: dict[str, Any], args: argparse.Namespace) -> None:
    from transfuse.bench.report import save_and_print

    save_and_print(results, summarize(results), args, "dynamic")
