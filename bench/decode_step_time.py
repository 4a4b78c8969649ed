"""Microseconds per decode step of generate() under transfuse, for A/B runs across processes.

    PYTHONPATH=src python3 bench/decode_step_time.py [--model llama-1.1b] [--batch 1] [--prompt 32] [--disable PASS,...] [--label L]

The model (random weights, fp16) is optimized, generate() warmed up, then generate() of 129 and of 1
new tokens (a 32-token prompt, or --prompt's: long prompts time decode over a long cache) is timed between CUDA events, seven times: us per step is the median of
(t129 - t1) / 128. Prints one line with the label, the spread and the last tokens (variants must
agree). Run each variant in its own process, alternating (A B A B), on one warm machine.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

import transfuse
from transfuse.bench.decoder import make_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-1.1b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--disable", default="", help="passes to leave out (optimize's disable=), comma-separated")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--label", default=None)
    args = parser.parse_args()
    disable = [p for p in args.disable.split(",") if p]
    label = args.label or (f"PDL={os.environ.get('TRANSFUSE_PDL', '1')} "
                           f"decode_attn={os.environ.get('TRANSFUSE_DECODE_ATTENTION', '1')} disable={','.join(disable) or '-'}")
    torch.manual_seed(0)
    model = transfuse.optimize(make_model(args.model).cuda().half().eval(), disable=disable)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), device="cuda")

    def gen(n: int) -> torch.Tensor:
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False)

    with torch.no_grad():
        for _ in range(2):
            gen(65), gen(1)
        steps = []
        for _ in range(7):
            times = []
            for n in (1, 129):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                gen(n)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            steps.append((times[1] - times[0]) / 128 * 1000)
        tokens = gen(33)[0, -4:].tolist()
    us = statistics.median(steps)
    print(f"{label:40s} {args.model} batch {args.batch} prompt {args.prompt}: {us:7.1f} us/step ({1e6 / us * args.batch:7.0f} tok/s), "
          f"min {min(steps):.1f} max {max(steps):.1f}, tokens {tokens}  [{torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}]", flush=True)


if __name__ == "__main__":
    main()
