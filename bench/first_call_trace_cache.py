"""The warm first call of bert-base (fp16, 8x128) in fresh processes, with and without the trace
cache (trace_cache.py), alternating on one machine; and each process's latency afterwards, so that
the cost of the cache's per-call guard check shows.

    PYTHONPATH=src python3 bench/first_call_trace_cache.py --rounds 3 [--config tiny]

One cache directory for the whole run (Triton's binaries, transfuse's tuning choices and traces):
a first process with the trace cache on fills it (empty caches), then `off` and `on` processes
alternate, every one of them with warm caches. Each prints one JSON line: first-call seconds (the
call synchronised on both sides), the trace cache's status, median ms of 200 calls at 1x16 and at
8x128 after it, and the max relative error of the last output against fp32 eager of the same
weights. The table at the end lists them in order.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch


def child(args) -> None:
    import transfuse
    from transfuse.bench import encoder, timing

    device = torch.device("cuda")
    config = encoder.make_config(argparse.Namespace(config=args.config, attn="sdpa"))
    model = encoder.make_model(config, 0).to(device=device, dtype=torch.float16)
    reference = encoder.make_model(config, 0).to(device=device, dtype=torch.float32)
    transfuse.optimize(model, trace_cache=args.child == "on")
    inputs = encoder.make_inputs(8, 128, config.vocab_size, 0.25, 0, device)
    with torch.inference_mode():
        first, out = timing.time_first_call(model, inputs, cuda=True)
        small = encoder.make_inputs(1, 16, config.vocab_size, 0.0, 1, device)
        ms_small = timing.measure(model, [small], warmup=20, iters=200, cuda=True).median_ms
        ms_large = timing.measure(model, [inputs], warmup=20, iters=200, cuda=True).median_ms
        ref = reference(**inputs).last_hidden_state
        got = model(**inputs).last_hidden_state.float()
        keep = inputs["attention_mask"].bool()
        err = ((got - ref)[keep].abs().max() / ref[keep].abs().max()).item()
    status = [line.strip() for line in transfuse.report(model).splitlines() if "trace cache" in line]
    print(json.dumps({"mode": args.child, "first_call_s": round(first, 3), "ms_1x16": round(ms_small, 4),
                      "ms_8x128": round(ms_large, 4), "max_rel_err": err, "trace_cache": status}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--config", default="bert-base")
    parser.add_argument("--child", choices=("on", "off"))
    args = parser.parse_args()
    if args.child:
        return child(args)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(cache, "triton"),
                   TRANSFUSE_CACHE_DIR=os.path.join(cache, "transfuse"))
        env.pop("TRANSFUSE_TRACE_CACHE", None)
        for label, mode in [("empty caches", "on")] + [("warm", m) for _ in range(args.rounds) for m in ("off", "on")]:
            proc = subprocess.run([sys.executable, __file__, "--child", mode, "--config", args.config], env=env,
                                  capture_output=True, text=True, timeout=600)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
            if not lines:
                print(proc.stderr[-3000:], file=sys.stderr)
                continue
            row = json.loads(lines[-1])
            row["caches"] = label
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| caches | trace cache | first call s | 1x16 ms | 8x128 ms | max rel err | status |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['caches']} | {r['mode']} | {r['first_call_s']:.2f} | {r['ms_1x16']:.4f} | {r['ms_8x128']:.4f} | "
              f"{r['max_rel_err']:.1e} | {'; '.join(r['trace_cache'])[:120]} |")


if __name__ == "__main__":
    main()
