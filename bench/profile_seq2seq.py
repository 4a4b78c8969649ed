"""Where the time of an encoder-decoder generate() goes (t5-base or bart-base geometry, fp16).

    PYTHONPATH=src python3 bench/profile_seq2seq.py [--geometry t5-base] [--search greedy|beam4] [--kernels]
        [--cprofile-tokens 1]

Random weights, a 128-token input, batch 1. Warms up generate() at both lengths, times a full call
and three one-token calls, prints the report, the top host functions of one call (cProfile; of a
one-token call with --cprofile-tokens 1) and, with --kernels, the GPU kernels of one 9-token call.
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
    parser.add_argument("--cprofile-tokens", type=int, default=None,
                        help="tokens of the cProfile'd call (default --tokens; 1 profiles a time to first token)")
    args = parser.parse_args()
    import transfuse

    model = make_model(args.geometry).cuda().half()
    transfuse.optimize(model)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, 128), device="cuda")
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens, min_new_tokens=args.tokens,
               **_search_kwargs(args.search))
    def call(n):
        return model.generate(ids, **{**gen, "max_new_tokens": n, "min_new_tokens": n})

    with torch.inference_mode():
        for _ in range(3):  # both lengths warmed: a shape's graphs are captured the second time it comes
            call(args.tokens)
            call(1)
        torch.cuda.synchronize()
        for label, n in (("full", args.tokens), ("first token", 1), ("first token", 1), ("first token", 1)):
            start = time.perf_counter()
            call(n)
            torch.cuda.synchronize()
            print(f"{label}: {(time.perf_counter() - start) * 1e3:.2f} ms")
        prof = cProfile.Profile()
        prof.enable()
        call(args.cprofile_tokens or args.tokens)
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
