"""Where the host time of one generate() decode step goes, for transfuse and HF's static cache.

    PYTHONPATH=src python3 bench/profile_decode.py [--layers 22] [--tokens 64] [--provider transfuse]

llama-1.1b geometry (random weights, fp16), batch 1, a 32-token prompt. Runs generate() twice to
warm up, then a third under cProfile; prints ms per step, the report and the top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from transfuse.bench.decoder import GEOMETRIES


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--provider", default="transfuse", choices=["transfuse", "static"])
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--kernels", action="store_true", help="also a torch.profiler table of GPU kernels over 8 steps")
    args = parser.parse_args()
    import transformers

    _, kwargs = GEOMETRIES["llama-1.1b"]
    config = transformers.LlamaConfig(**{**kwargs, "num_hidden_layers": args.layers})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().cuda().half()
    gen = dict(max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    if args.provider == "transfuse":
        import transfuse

        transfuse.optimize(model)
    else:
        gen["cache_implementation"] = "static"
    ids = torch.randint(3, config.vocab_size, (args.batch, 32), device="cuda")
    with torch.inference_mode():
        for _ in range(2):
            model.generate(ids, **gen)
        torch.cuda.synchronize()
        for label, n in (("full", args.tokens), ("prefill", 1)):
            start = time.perf_counter()
            model.generate(ids, **{**gen, "max_new_tokens": n, "min_new_tokens": n})
            torch.cuda.synchronize()
            print(f"{label}: {(time.perf_counter() - start) * 1e3:.2f} ms")
        prof = cProfile.Profile()
        prof.enable()
        model.generate(ids, **gen)
        torch.cuda.synchronize()
        prof.disable()
    if args.provider == "transfuse":
        print(transfuse.report(model))
    if args.kernels:
        from torch.profiler import ProfilerActivity, profile

        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as kprof:
            model.generate(ids, **{**gen, "max_new_tokens": 9, "min_new_tokens": 9})
            torch.cuda.synchronize()
        print("GPU kernels over one generate() of 9 tokens (prefill + 8 decode steps):")
        print(kprof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
        print("\n".join(out.getvalue().splitlines()[:args.top + 12]))


if __name__ == "__main__":
    main()
