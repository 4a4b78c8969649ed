"""Microbenchmark of transfuse.rotary_table (Hugging Face's cos/sin tables in one kernel) against the
eager formula (a K=1 bmm, cat, cos, sin, two multiplies, two casts) and torch.compile of it.

    PYTHONPATH=src python3 bench/kernels/bench_rotary_table.py               # ~30 s, compiles included
    PYTHONPATH=src python3 bench/kernels/bench_rotary_table.py --no-compile

Two timings per implementation: `graph us`, microseconds per call as a decode step's CUDA graph pays
them (50 calls captured in one graph, median of 30 replays: launch gaps included, host overhead not),
and `bench us`, triton.testing.do_bench's median (one call per launch from the host). GB/s counts the
bytes the fused op must move at least (positions and inv_freq read, both tables written once).
Prints the GPU, versions and date with the table.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import triton
from triton.testing import do_bench

from transfuse.bench.timing import graph_replay_us
from transfuse.kernels.rotary_table import rotary_table_fwd
from transfuse.reference.rotary_table import rotary_table_ref

# (batch, seq, head_dim, dtype): decode steps of 1 and 8 sequences (Llama-3 head dim 128, TinyLlama
# 64), a Phi-2-like head dim of 80, prompts of 512 and 4096 tokens.
CASES = [
    (1, 1, 64, torch.float16), (1, 1, 128, torch.bfloat16), (8, 1, 128, torch.bfloat16), (8, 1, 80, torch.float16),
    (1, 512, 128, torch.bfloat16), (1, 4096, 128, torch.bfloat16), (4, 2048, 64, torch.float16),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, {datetime.date.today()}")
    names = ["eager", "ours"] + ([] if args.no_compile else ["compile"])
    print(f"{'B x S x D':>16} {'dtype':>9} | " + " ".join(f"{n + ' graph us':>16} {n + ' bench us':>16}" for n in names)
          + f" | {'ours GB/s':>9}")
    for batch, seq, dim, dtype in CASES:
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float, device="cuda") / dim))
        positions = torch.randint(0, 131072, (batch, seq), device="cuda")
        fns = {"eager": lambda: rotary_table_ref(inv_freq, positions, 1.0, dtype),
               "ours": lambda: rotary_table_fwd(inv_freq, positions, 1.0, dtype)}
        if not args.no_compile:
            torch._dynamo.reset()
            fns["compile"] = torch.compile(lambda: rotary_table_ref(inv_freq, positions, 1.0, dtype))
        ours, eager = fns["ours"](), fns["eager"]()
        for a, b in zip(ours, eager):  # the same table as eager's (1 ulp apart at most, see the tests)
            assert (a.float() - b.float()).abs().max().item() <= 2 * torch.finfo(dtype).eps
        cells = []
        for name in names:
            cells += [graph_replay_us(fns[name]), do_bench(fns[name], return_mode="median") * 1e3]
        moved = (positions.numel() * positions.element_size() + inv_freq.numel() * 4
                 + 2 * batch * seq * dim * ours[0].element_size())
        gbs = moved / (cells[2] * 1e-6) / 1e9
        print(f"{batch:>4} x {seq:>4} x {dim:>3} {str(dtype)[6:]:>9} | " + " ".join(f"{c:16.2f}" for c in cells)
              + f" | {gbs:9.0f}")


if __name__ == "__main__":
    main()
