"""Where the time of a short generate() goes before the decode loop: llama-1.1B geometry (random
weights, fp16), batch 1, a 32-token prompt.

    PYTHONPATH=src python3 bench/profile_prefill.py [--model llama-1.1b] [--prompt 32]

Prints, after warm-up: the optimized model's forward over the prompt (CUDA events, the replayed
graph), generate() of 1 and of 2 new tokens (wall clock, synchronised), then cProfile of 20 calls of
generate(max_new_tokens=1) by own time and by cumulative time, and the GPU kernels of one such call
(torch.profiler), so that host overhead and GPU time can be told apart.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

import transfuse
from transfuse.bench.decoder import make_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-1.1b")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = transfuse.optimize(make_model(args.model).cuda().half().eval())
    ids = torch.randint(3, model.config.vocab_size, (1, args.prompt), device="cuda")
    mask = torch.ones_like(ids)

    def gen(n: int):
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    with torch.no_grad():
        for _ in range(3):
            gen(1), gen(2), gen(8)
            model(input_ids=ids, attention_mask=mask)
        forward = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(input_ids=ids, attention_mask=mask)
            end.record()
            torch.cuda.synchronize()
            forward.append(start.elapsed_time(end))
        walls = {}
        for n in (1, 2, 8):
            times = []
            for _ in range(20):
                torch.cuda.synchronize()
                t = time.perf_counter()
                gen(n)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t) * 1e3)
            walls[n] = statistics.median(times)
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        print(f"forward over the prompt (model(...), events): {statistics.median(forward):.3f} ms")
        print("generate() wall ms: " + ", ".join(f"{n} new: {ms:.3f}" for n, ms in walls.items())
              + f"  (per extra step {(walls[8] - walls[2]) / 6:.3f})")
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(20):
            gen(1)
        torch.cuda.synchronize()
        profiler.disable()
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(args.top)
            print(out.getvalue())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            gen(1)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
