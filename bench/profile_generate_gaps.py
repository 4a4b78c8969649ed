"""Where a generate() decode step's time goes when the GPU is not busy: the idle gaps between GPU
activities over one steady-state generate(), and what ran on the host during the longest ones.

    PYTHONPATH=src python3 bench/profile_generate_gaps.py [--model t5-base|llama-1.1b|gpt2] [--batch 1]
        [--tokens 64] [--top 12]

Random weights, fp16, greedy, transfuse.optimize; warmed at the same shapes first. Prints the span,
the GPU busy time (union of kernel and copy intervals), the gaps by size, and for the largest gaps
the GPU activities on each side and the host ops (torch.profiler CPU events) that overlap them.
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

import transfuse
from profile_step_replay import build  # the same models: a sibling script (bench/ is on sys.path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="t5-base")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, prompt = build(args.model)
    transfuse.optimize(model)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, prompt), device="cuda")
    gen = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
               max_new_tokens=args.tokens, min_new_tokens=args.tokens)
    with torch.inference_mode():
        for _ in range(3):
            model.generate(ids, **gen)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model.generate(ids, **gen)
            torch.cuda.synchronize()
    events = prof.events()
    gpu = sorted(((e.time_range.start, e.time_range.end, e.name) for e in events
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start),
                 key=lambda t: t[0])
    cpu = [(e.time_range.start, e.time_range.end, e.name) for e in events
           if e.device_type == torch.autograd.DeviceType.CPU]
    if not gpu:
        raise SystemExit("no GPU activity recorded")
    busy, gaps, end, prev = 0.0, [], gpu[0][0], gpu[0][2]
    for start, stop, name in gpu:
        if start > end:
            gaps.append((start - end, end, start, prev, name))
        if stop > end:
            busy += stop - max(start, end)
            end, prev = stop, name
    span = end - gpu[0][0]
    print(f"{args.model} batch {args.batch}, {args.tokens} tokens: span {span / 1e3:.2f} ms, GPU busy "
          f"{busy / 1e3:.2f} ms ({busy / span:.0%}), {len(gpu)} GPU activities, {len(gaps)} gaps "
          f"totalling {sum(g[0] for g in gaps) / 1e3:.2f} ms; per token {span / args.tokens / 1e3:.3f} ms span, "
          f"{busy / args.tokens / 1e3:.3f} ms busy")
    sizes = collections.Counter()
    for g in gaps:
        bucket = "<2us" if g[0] < 2 else "2-10us" if g[0] < 10 else "10-50us" if g[0] < 50 else "50-200us" if g[0] < 200 else ">=200us"
        sizes[bucket] += g[0]
    print("gap time by gap size (ms): " + ", ".join(f"{k} {v / 1e3:.2f}" for k, v in sorted(sizes.items())))
    for length, start, stop, before, after in sorted(gaps, reverse=True)[:args.top]:
        host = collections.Counter()
        for c0, c1, name in cpu:
            overlap = min(c1, stop) - max(c0, start)
            if overlap > 0:
                host[name] += overlap
        busiest = ", ".join(f"{n[:40]} {t:.0f}us" for n, t in host.most_common(5))
        print(f"{length:8.1f} us  after {before[:45]!r} before {after[:45]!r}\n            host: {busiest}")


if __name__ == "__main__":
    main()
