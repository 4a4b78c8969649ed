"""Where the host time of one optimized bert-base call goes (GPU idle before the call): cProfile by
function and the torch profiler's CPU-side CUDA API calls. Dev tool:
PYTHONPATH=src python3 bench/profile_host.py [1x16]"""

import cProfile
import io
import os
import statistics
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import BertConfig, BertModel

import transfuse


def main(shape: str = "1x16", provider: str = "transfuse"):
    batch, seq = map(int, shape.split("x"))
    torch.manual_seed(0)
    model = BertModel(BertConfig()).cuda().half().eval()
    if provider == "transfuse":
        model = transfuse.optimize(model)
    else:
        compiled = torch.compile(model, mode="reduce-overhead", dynamic=False)

        def model(**kw):
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(**kw)
    ids = torch.randint(0, 30522, (batch, seq), device="cuda")
    mask = torch.ones(batch, seq, dtype=torch.long, device="cuda")
    with torch.inference_mode():
        for _ in range(5):
            model(input_ids=ids, attention_mask=mask)
        plain = []
        for _ in range(300):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(input_ids=ids, attention_mask=mask)
            plain.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        print(f"SUMMARY {provider} {shape} guards={os.environ.get('TRANSFUSE_GUARD_FILTER', 'default')}: "
              f"host {statistics.median(plain) * 1e3:.3f} ms per call (median of 300, GPU idle before each)")
        pr = cProfile.Profile()
        total = 0.0
        for _ in range(200):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pr.enable()
            model(input_ids=ids, attention_mask=mask)
            pr.disable()
            total += time.perf_counter() - t0
        torch.cuda.synchronize()
        print(f"{provider} {shape}: host {total / 200 * 1e3:.3f} ms per call under cProfile")
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        print("\n".join(s.getvalue().splitlines()[:45]))
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(30)
        print("\n".join(s.getvalue().splitlines()[:50]))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                torch.cuda.synchronize()
                model(input_ids=ids, attention_mask=mask)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main(*sys.argv[1:])
