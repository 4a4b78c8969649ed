"""Time to first token of a warmed encoder-decoder generate(), call by call, then cProfile of one
1-token call and the transfuse report: where a slow first token goes (t5-base or bart-base
geometry, fp16, random weights, a 128-token input, batch 1).

    PYTHONPATH=src python3 bench/profile_ttft.py [bart-base|t5-base]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch

import transfuse
from transfuse.bench.seq2seq import make_model


def main(name: str = "bart-base") -> None:
    model = make_model(name).cuda().half().eval()
    transfuse.optimize(model)
    ids = torch.randint(3, model.config.vocab_size, (1, 128), device="cuda")

    def call(n: int):
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False)

    with torch.inference_mode():
        for _ in range(3):
            call(64)
            call(1)
        for n in (1, 1, 1, 64, 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            call(n)
            torch.cuda.synchronize()
            print(f"{name} {n} tokens: {(time.perf_counter() - start) * 1e3:.1f} ms", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        call(1)
        torch.cuda.synchronize()
        prof.disable()
    print(transfuse.report(model))
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    print(out.getvalue())


if __name__ == "__main__":
    main(*sys.argv[1:])
