"""Which graph ops a training step's GPU time belongs to: the train bench's GPT-2 124M step under
transfuse with CUDA graphs off, profiled with the CPU side on, so each kernel is charged to the aten or
transfuse op that launched it (with input shapes). bench/profile_train.py gives the kernels alone.

    PYTHONPATH=src python3 bench/profile_train_ops.py [--arch nanogpt|hf] [--rows 40]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import transfuse
from profile_train import make_step  # this script's folder is on sys.path
from transfuse.bench import train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="nanogpt", choices=list(train.ARCHS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=40)
    args = parser.parse_args()
    device = torch.device("cuda")
    master = train.make_master(args.arch, "gpt2-124m")
    model, _ = train.prepare(args.arch, master, "transfuse-autograd", device)  # the model, padded as the bench does
    transfuse.restore(model)
    run_model = transfuse.optimize(model, cuda_graphs=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, master.config.vocab_size, (args.batch, args.seq), device=device)

    step = make_step(args.arch, run_model, opt, x)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages(group_by_input_shape=True) if e.device_type.name == "CPU"
              and e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events)
    print(f"transfuse, CUDA graphs off, one step: {total / 1e3:.2f} ms of kernel time charged to ops")
    for e in events[: args.rows]:
        print(f"{e.self_device_time_total / 1e3:8.3f} ms  {e.count:4d}x  {e.key[:60]:60s} {str(e.input_shapes)[:110]}")


if __name__ == "__main__":
    main()
