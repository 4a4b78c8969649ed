"""Where a training step's GPU time goes: GPT-2 124M as nanoGPT or Hugging Face write it (hand-written
attention, vocab 50257), bf16 autocast, fused AdamW, under any provider of the train bench.

    PYTHONPATH=src python3 bench/profile_train.py [--arch nanogpt|hf] [--provider transfuse|transfuse-autograd|
        compile-sdpa-pad|...] [--batch 8] [--seq 1024]

The model, provider and loss are the train bench's (transfuse.bench.train), so the profile is of the
step that `transfuse bench --train` times.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from transfuse.bench import train


def profile_steps(step, warmup: int, steps: int):
    """(the CUDA profile of `steps` calls of step after `warmup` unprofiled ones, the GPU kernel time
    per step in ms). Shared with bench/profile_train_llama.py."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof, sum(e.self_device_time_total for e in prof.key_averages()) / (steps * 1e3)


def make_step(arch: str, run_model, opt, x: torch.Tensor):
    """One training step as the train bench runs it: bf16 autocast, fused AdamW. Shared with
    bench/profile_train_ops.py."""
    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = train.loss_of(arch, run_model, x, x)
        loss.backward()
        opt.step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="nanogpt", choices=list(train.ARCHS))
    parser.add_argument("--provider", default="transfuse", choices=list(train.PROVIDERS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--host", action="store_true", help="also cProfile two steps (host time by function)")
    parser.add_argument("--gc", action="store_true", help="also time steps with Python's garbage collector off")
    args = parser.parse_args()
    device = torch.device("cuda")
    master = train.make_master(args.arch, "gpt2-124m")
    model, run_model = train.prepare(args.arch, master, args.provider, device)
    vocab = master.config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, vocab, (args.batch, args.seq), device=device)

    step = make_step(args.arch, run_model, opt, x)
    prof, per_step_ms = profile_steps(step, warmup=3, steps=2)
    print(f"{args.provider}: GPU kernels over 2 steps ({per_step_ms:.2f} ms of kernel time per step)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    if args.provider.startswith("transfuse"):
        # The attention kernels' autotuned choices in this run (key -> config), beside their GPU time above.
        from transfuse.kernels import attention_train as at

        for name in ("fwd", "bwd_dkdv", "bwd_dq"):
            tuner = getattr(at, f"_attention_train_{name}_kernel_autotuned")
            for key, config in getattr(tuner, "cache", {}).items():
                print(f"autotuned {name}: {config} for key {key}")
    if args.gc:
        import gc
        import time

        for label in ("gc on", "gc off", "gc frozen"):
            if label == "gc off":
                gc.disable()
            if label == "gc frozen":
                gc.enable()
                gc.collect()
                gc.freeze()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            print(f"{label}: {(time.perf_counter() - start) / 5 * 1e3:.1f} ms per step")
        gc.unfreeze()
        gc.enable()
    if args.host:
        import cProfile
        import pstats
        import time

        torch.cuda.synchronize()
        start = time.perf_counter()
        with cProfile.Profile() as host:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        print(f"2 steps: {(time.perf_counter() - start) * 1e3:.1f} ms under cProfile")
        pstats.Stats(host).sort_stats("tottime").print_stats(args.rows)


if __name__ == "__main__":
    main()
