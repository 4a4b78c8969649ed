"""Hugging Face eager alone (transfuse not imported) on one family of bench/family_sweep.py: its two
forwards and a greedy generate() of 5 tokens, with the traceback of whichever fails. Tells a failure
of the model's own GPU path from transfuse's; run it with CUDA_LAUNCH_BLOCKING=1 so that a fault
names its kernel.

    CUDA_LAUNCH_BLOCKING=1 python3 bench/eager_generate_probe.py minimax fp16
"""
import sys
import traceback

import torch

import family_sweep as fs  # this script's folder is on sys.path

family = sys.argv[1] if len(sys.argv) > 1 else "minimax"
unit = fs.Unit(family, sys.argv[2] if len(sys.argv) > 2 else "fp16", "cuda", print)
_, eager, _, _, _ = unit.build()
try:
    with torch.inference_mode():
        for seq in fs.SEQS:
            out = eager(**unit.inputs(seq))
            torch.cuda.synchronize()
            print("forward", seq, "ok, max |logit|", out.logits.float().abs().max().item())
        ids = eager.generate(**unit.inputs(fs.SEQS[0]), max_new_tokens=5, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        print("generate ok", tuple(ids.shape))
except Exception:  # noqa: BLE001 - the point is to print it
    traceback.print_exc()
    sys.exit(1)
