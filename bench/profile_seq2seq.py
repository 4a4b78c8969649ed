"""Where the time of an encoder-decoder generate() goes (t5-base or bart-base geometry, fp16).

    PYTHONPATH=src python3 bench/profile_seq2seq.py [--geometry t5-base] [--search greedy|beam4] [--kernels]

Random weights, a 128-token input, batch 1. Runs transfuse's generate() to warm up, times a full
call and a one-token call, prints the report, the top host functions (cProfile) and, with --kernels,
the GPU kernels of one 9-token call.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from transfuse.bench.seq2seq import _search_kwargs, make_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--geometry", default="t5-base")
    parser.add_argument("--search", default="greedy")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--kernels", action="store_true")
    args = parser.parse_args()
    import transfuse

    model = make_model(args.geometry).cuda().half()
    transfuse.optimize(model)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, 128), device="cuda")
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
               **_search_kwargs(args.search))
    with torch.inference_mode():
        for _ in range(2):
            model.generate(ids, **gen)
        torch.cuda.synchronize()
        for label, n in (("full", args.tokens), ("first token", 1)):
            start = time.perf_counter()
            model.generate(ids, **{**gen, "max_new_tokens": n, "min_new_tokens": n})
            torch.cuda.synchronize()
            print(f"{label}: {(time.perf_counter() - start) * 1e3:.2f} ms")
        prof = cProfile.Profile()
        prof.enable()
        model.generate(ids, **gen)
        torch.cuda.synchronize()
        prof.disable()
    print(transfuse.report(model))
    if args.kernels:
        from torch.profiler import ProfilerActivity, profile

        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as kprof:
            model.generate(ids, **{**gen, "max_new_tokens": 9, "min_new_tokens": 9})
            torch.cuda.synchronize()
        print("kernels over one generate() of 9 tokens:")
        print(kprof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=80))
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.top)
    print("\n".join(out.getvalue().splitlines()[:args.top + 12]))


if __name__ == "__main__":
    main()
