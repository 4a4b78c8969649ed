"""HF GPT-2 then nanoGPT trained with transfuse's training graphs in one process, as the train bench
does (torch._dynamo.reset() between them): four steps each, with the traceback of any error.
Found where the eighth session's "CUDA error: invalid argument" came from
(bench/results/*-two-models-error-session9.log).

    PYTHONPATH=src python3 bench/train_two_models.py [tiny|gpt2-124m]
"""

from __future__ import annotations

import sys
import traceback

import torch

from transfuse.bench import train


def main(geometry: str = "tiny") -> None:
    batch, seq = (2, 32) if geometry == "tiny" else (8, 1024)
    device = torch.device("cuda")
    for arch in ("hf", "nanogpt"):
        master = train.make_master(arch, geometry)
        model, run = train.prepare(arch, master, "transfuse", device)  # resets Dynamo first
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        x = torch.randint(0, master.config.vocab_size, (batch, seq), device=device)
        try:
            for i in range(4):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = train.loss_of(arch, run, x, x)
                loss.backward()
                opt.step()
                torch.cuda.synchronize()
                print(arch, "step", i, "loss", loss.item(), flush=True)
        except Exception:  # noqa: BLE001 - the point is the traceback
            traceback.print_exc()
            return


if __name__ == "__main__":
    main(*sys.argv[1:])
