"""The decode loop's token choice inside a CUDA graph: torch.argmax against kernels/argmax.py, and the
whole greedy choice (argmax + EOS bookkeeping) as torch ops against argmax_partials + decode_step.

    PYTHONPATH=src python3 bench/kernels/bench_argmax.py

Each variant is captured 50 times in one graph and timed by replays (median of 30, CUDA events):
microseconds per variant as a decode step's graph would pay them, and the logits' read bandwidth.
Prints the GPU, versions and date with the table.
"""

from __future__ import annotations

import datetime

import torch
import triton

from transfuse.bench.timing import graph_replay_us
from transfuse.kernels.argmax import argmax_fwd, argmax_partials
from transfuse.kernels.decode_step import decode_step_fwd

SHAPES = [(1, 32000), (8, 32000), (32, 32000), (1, 128256), (8, 128256)]


def _buffers(batch: int) -> dict:
    cuda = dict(device="cuda")
    return dict(tokens=torch.zeros(batch, 1, dtype=torch.long, **cuda), step=torch.zeros(1, dtype=torch.long, **cuda),
                cur_len=torch.zeros((), dtype=torch.long, **cuda), out=torch.zeros(batch, 4096, dtype=torch.long, **cuda),
                done=torch.zeros(4096, dtype=torch.bool, **cuda), all_done=torch.zeros((), dtype=torch.bool, **cuda),
                unfinished=torch.ones(batch, dtype=torch.bool, **cuda), pad=torch.zeros((), dtype=torch.long, **cuda),
                mask=torch.zeros(batch, 1 << 16, dtype=torch.bool, **cuda),
                column=torch.zeros(1, dtype=torch.long, **cuda), positions=torch.zeros(batch, 1, dtype=torch.long, **cuda))


def _torch_choice(logits, b, eos):
    """The decode loop's greedy choice before the kernels: cast, argmax, then 14 small torch ops."""
    tokens = torch.argmax(logits.float(), dim=-1)
    tokens = torch.where(b["unfinished"], tokens, b["pad"])
    b["unfinished"].logical_and_(~torch.isin(tokens, eos))
    b["out"].index_copy_(1, b["step"], tokens[:, None])
    b["all_done"].copy_(~b["unfinished"].any())
    b["done"].index_copy_(0, b["step"], b["all_done"][None])
    b["tokens"].copy_(tokens[:, None])
    b["step"].add_(1)
    b["cur_len"].add_(1)
    b["mask"].index_fill_(1, b["column"], True)
    b["column"].add_(1)
    b["positions"].add_(1)


def _kernel_choice(logits, b, eos):
    decode_step_fwd(tokens=b["tokens"], step=b["step"], cur_len=b["cur_len"], out=b["out"], done=b["done"],
                    all_done=b["all_done"], unfinished=b["unfinished"], partials=argmax_partials(logits),
                    pad=b["pad"], eos=eos, mask=b["mask"], column=b["column"], positions=b["positions"])


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, {datetime.date.today()}")
    print(f"{'shape':>14} {'dtype':>9} | {'torch.argmax':>12} {'ours':>8} {'GB/s':>6} | "
          f"{'torch choice':>12} {'kernels':>8}")
    eos = torch.tensor([2], device="cuda")
    for rows, vocab in SHAPES:
        for dtype in (torch.float16, torch.float32):
            logits = torch.randn(rows, vocab, device="cuda", dtype=dtype)
            t_torch = graph_replay_us(lambda: torch.argmax(logits, dim=-1))
            t_ours = graph_replay_us(lambda: argmax_fwd(logits))
            assert torch.equal(argmax_fwd(logits), torch.argmax(logits, dim=-1))
            gbs = logits.numel() * logits.element_size() / (t_ours * 1e-6) / 1e9
            b_torch, b_ours = _buffers(rows), _buffers(rows)
            c_torch = graph_replay_us(lambda: (b_torch["step"].zero_(), b_torch["column"].zero_(),
                                         _torch_choice(logits, b_torch, eos)))
            c_ours = graph_replay_us(lambda: (b_ours["step"].zero_(), b_ours["column"].zero_(),
                                        _kernel_choice(logits, b_ours, eos)))
            print(f"{rows:>5} x {vocab:>6} {str(dtype)[6:]:>9} | {t_torch:12.2f} {t_ours:8.2f} {gbs:6.0f} | "
                  f"{c_torch:12.2f} {c_ours:8.2f}   (choice columns include 2 counter resets)")


if __name__ == "__main__":
    main()
