"""Microbenchmark of the bias gradient (transfuse.kernels.bias_grad) against torch's dy.sum(0).

    PYTHONPATH=src python3 bench/kernels/bench_bias_grad.py              # the table (~10 s)
    PYTHONPATH=src python3 bench/kernels/bench_bias_grad.py --compile    # + torch.compile's sum
    PYTHONPATH=src python3 bench/kernels/bench_bias_grad.py --sweep      # tiles vs the heuristic

Shapes: GPT-2 small's training linears at batch 8 x seq 1024 (8192 rows; N = 768 for attn.c_proj
and mlp.c_proj, 2304 for attn.c_attn, 3072 for mlp.c_fc), bf16. The kernel is memory-bound: GB/s
counts dy read once (the output is negligible). The "act bwd" rows compare the activation-gradient
kernel followed by bias_grad with the same kernel summing its own output (activation_bias_bwd);
their GB/s counts grad_out and pre read and grad_pre written once.

Timing: one CUDA-event pair around each call, L2 flushed (a 256 MB write) before each, 10 warm-up
calls, median of 50.
"""

import argparse
import datetime
import statistics

import torch
import triton

from transfuse.kernels.activation_backward import activation_bias_bwd, activation_bwd
from transfuse.kernels.bias_grad import BiasGradConfig, bias_grad, bias_grad_config

ROWS = 8192
WIDTHS = (768, 2304, 3072)
WARMUP, REPS = 10, 50


def median_ms(fn) -> float:
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(REPS):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / ms / 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile", action="store_true", help="also time torch.compile's column sum")
    parser.add_argument("--sweep", action="store_true", help="time other tiles and programs per SM")
    args = parser.parse_args()

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.date.today()}; {ROWS} rows, bf16, median of {REPS}, L2 flushed")
    print(f"{'case':<34}{'N':>6}{'us':>9}{'GB/s':>8}{'vs torch':>10}")
    compiled_sum = torch.compile(lambda t: t.sum(0)) if args.compile else None
    for n in WIDTHS:
        dy = torch.randn(ROWS, n, device="cuda").bfloat16()
        torch.testing.assert_close(bias_grad(dy).float(), dy.float().sum(0), rtol=2e-2, atol=0.5)
        nbytes = dy.numel() * dy.element_size()
        base = median_ms(lambda: dy.sum(0))
        rows = [("torch dy.sum(0)", base), ("transfuse bias_grad", median_ms(lambda: bias_grad(dy)))]
        if compiled_sum is not None:
            rows.append(("torch.compile sum(0)", median_ms(lambda: compiled_sum(dy))))
        if args.sweep:
            default = bias_grad_config(n)
            for block_m, block_n, warps, per_sm in [(32, 128, 4, 2), (32, 128, 4, 8), (16, 256, 4, 4),
                                                     (64, 64, 4, 4), (64, 128, 8, 4), (8, 512, 4, 4)]:
                config = BiasGradConfig(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, programs_per_sm=per_sm)
                if config != default:
                    rows.append((f"  M{block_m} N{block_n} w{warps} x{per_sm}/SM",
                                 median_ms(lambda c=config: bias_grad(dy, config=c))))
        for name, ms in rows:
            print(f"{name:<34}{n:>6}{ms * 1e3:>9.1f}{gbps(nbytes, ms):>8.0f}{base / ms:>9.2f}x")
        # the activation kernel: a second read of grad_pre, or the sum while writing it
        pre, grad_out = torch.randn_like(dy), torch.randn_like(dy)
        act_bytes = 3 * nbytes
        split = median_ms(lambda: bias_grad(activation_bwd(grad_out, pre, "gelu_tanh")))
        fused = median_ms(lambda: activation_bias_bwd(grad_out, pre, "gelu_tanh"))
        alone = median_ms(lambda: activation_bwd(grad_out, pre, "gelu_tanh"))
        for name, ms in [("act bwd alone (no dbias)", alone), ("act bwd, then bias_grad", split),
                         ("act bwd summing as it writes", fused)]:
            print(f"{name:<34}{n:>6}{ms * 1e3:>9.1f}{gbps(act_bytes, ms):>8.0f}{'':>10}")


if __name__ == "__main__":
    main()
