"""Side by side, torch.compile(mode="reduce-overhead") and transfuse on bert-base fp16: per shape the
call's latency, the host time to enqueue one call, and the GPU kernels of one call (count, total,
the largest by name). Says where transfuse loses time against the baseline.

Dev tool: PYTHONPATH=src python3 bench/profile_compare.py [--shapes 1x16,8x128,32x512] [--out DIR]"""

import argparse
import copy
import json
import os
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import BertConfig, BertModel

import transfuse
from transfuse.bench.timing import measure


def latency_ms(call, n=200):
    return measure(call, [()], warmup=0, iters=n).median_ms


def host_ms(call, n=100):
    """Host time to enqueue one call while the GPU is idle: what a caller waits before the GPU starts
    on a small shape."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def category(name: str) -> str:
    n = name.lower()
    if "attention" in n or "flash" in n or "fmha" in n:
        return "attention"
    if "gemm" in n or "xmma" in n or "cutlass" in n or "nvjet" in n or "matmul" in n or "_mm_" in n or "linear" in n:
        return "gemm"
    if "norm" in n:
        return "norm"
    if "copy" in n or "memcpy" in n or "memset" in n:
        return "copy"
    return "other"


def kernels(call, n=20):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    by_name = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0)
            by_name[e.name][0] += t / n
            by_name[e.name][1] += 1 / n
    cats = defaultdict(lambda: [0.0, 0.0])
    for name, (t, c) in by_name.items():
        cats[category(name)][0] += t
        cats[category(name)][1] += c
    top = sorted(((t, c, name[:100]) for name, (t, c) in by_name.items()), reverse=True)[:24]
    return {
        "gpu_us": sum(t for t, _ in by_name.values()),
        "kernels": sum(c for _, c in by_name.values()),
        "categories": {k: {"us": round(v[0], 1), "count": round(v[1], 1)} for k, v in cats.items()},
        "top": [{"us": round(t, 1), "count": round(c, 1), "name": name} for t, c, name in top],
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1x16,1x128,8x128,8x512,32x512")
    parser.add_argument("--providers", default="compile-ro,transfuse")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = parser.parse_args()
    torch.manual_seed(0)
    base = BertModel(BertConfig()).cuda().half().eval()
    made = {}
    for p in args.providers.split(","):
        model = copy.deepcopy(base)
        if p == "compile-ro":
            compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)

            def fn(compiled=compiled, **kw):
                torch.compiler.cudagraph_mark_step_begin()
                return compiled(**kw)

            made[p] = fn
        elif p == "transfuse":
            made[p] = transfuse.optimize(model)
        elif p == "eager":
            made[p] = model
    results = []
    for shape in args.shapes.split(","):
        batch, seq = map(int, shape.split("x"))
        ids = torch.randint(0, 30522, (batch, seq), device="cuda")
        mask = torch.ones(batch, seq, dtype=torch.long, device="cuda")
        for p, fn in made.items():
            call = lambda fn=fn: fn(input_ids=ids, attention_mask=mask)  # noqa: E731
            with torch.inference_mode():
                for _ in range(5):
                    call()
                row = {"shape": shape, "provider": p, "latency_ms": latency_ms(call), "host_ms": host_ms(call)}
                row.update(kernels(call))
            results.append(row)
            cats = " ".join(f"{k}={v['us']:.0f}us/{v['count']:.0f}" for k, v in sorted(row["categories"].items()))
            print(f"{shape:7s} {p:10s} latency {row['latency_ms']:.3f} ms  host {row['host_ms']:.3f} ms  "
                  f"gpu {row['gpu_us']:.0f} us in {row['kernels']:.0f} kernels  [{cats}]", flush=True)
            for k in row["top"]:
                print(f"      {k['us']:7.1f} us x{k['count']:4.1f}  {k['name']}")
    with open(os.path.join(args.out, "profile_compare.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=1)
    print("\nshape   provider   latency  host   gpu_us kernels")
    for r in results:
        print(f"{r['shape']:7s} {r['provider']:10s} {r['latency_ms']:.3f}  {r['host_ms']:.3f}  {r['gpu_us']:6.0f} {r['kernels']:5.0f}")


if __name__ == "__main__":
    main()
