"""Tiles and programs per SM for the memory-bound kernels of a GPT-2 training step's backward, and
the weight-gradient GEMM's fp32 output, at batch 8 x seq 1024 (8192 rows), bf16:

* activation_bias_bwd (GELU gradient + the c_fc bias sum, 12 calls a step, N = 3072)
* bias_grad (the column sum of the c_attn gradient, N = 2304; 768 for the projections)
* the weight gradient under autocast: eager's bf16 mm then a cast to the fp32 parameter's dtype,
  against one mm writing fp32 (aten::mm.dtype, cuBLAS's fp32 output)

Every time is one call's median from replays of a CUDA graph of 12 calls (bench_gemv.graph_us); the
inputs (>= 37 MB each) exceed L2 at these widths. GB/s counts each input read once and each output
written once, against the copy bandwidth measured in the same run.

    PYTHONPATH=src python3 bench/kernels/sweep_train_memory_bound.py"""
import datetime
import itertools

import torch
import triton

from bench_gemv import copy_gbps, graph_us  # this script's folder is on sys.path
from transfuse.kernels import activation_backward as ab
from transfuse.kernels import bias_grad as bg

ROWS = 8192
COPIES = 12


def us(fn) -> float:
    return graph_us(lambda _: fn(), COPIES, 30)


def gbps(nbytes: int, t_us: float) -> float:
    return nbytes / t_us / 1e3


def sweep_activation(n: int, activation: str, copy: float) -> None:
    pre = torch.randn(ROWS, n, device="cuda").bfloat16()
    grad = torch.randn_like(pre)
    nbytes = 3 * pre.numel() * 2
    ref_g, ref_b = ab.activation_bias_bwd(grad, pre, activation)
    gelu = "tanh" if activation == "gelu_tanh" else "none"
    t_torch = us(lambda: torch.ops.aten.gelu_backward(grad, pre, approximate=gelu).sum(0))
    print(f"activation_bias_bwd {activation} N={n}: torch gelu_backward + sum {t_torch:.1f} us; "
          f"floor {nbytes / copy / 1e3:.1f} us")
    default_config, default_per_sm = ab.activation_dbias_config, ab._DBIAS_PROGRAMS_PER_SM
    results = {}
    try:
        for (bm, bn), warps, per_sm in itertools.product(
                [(8, 256), (16, 256), (32, 128), (16, 128), (32, 256), (64, 64), (8, 512)], (4, 8), (2, 4, 8, 16)):
            cfg = ab.ActivationConfig(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
            ab.activation_dbias_config = lambda _n, c=cfg: c
            ab._DBIAS_PROGRAMS_PER_SM = per_sm
            g, b = ab.activation_bias_bwd(grad, pre, activation)
            assert torch.equal(g, ref_g)
            torch.testing.assert_close(b.float(), ref_b.float(), rtol=1e-2, atol=1e-1)
            results[(bm, bn, warps, per_sm)] = us(lambda: ab.activation_bias_bwd(grad, pre, activation))
    finally:
        ab.activation_dbias_config, ab._DBIAS_PROGRAMS_PER_SM = default_config, default_per_sm
    t_default = us(lambda: ab.activation_bias_bwd(grad, pre, activation))
    t_alone = us(lambda: ab.activation_bwd(grad, pre, activation))
    print(f"  default {t_default:.1f} us ({gbps(nbytes, t_default):.0f} GB/s); without the sum {t_alone:.1f} us")
    for key in sorted(results, key=results.get)[:8]:
        print(f"  M{key[0]} N{key[1]} w{key[2]} x{key[3]}/SM: {results[key]:.1f} us "
              f"({gbps(nbytes, results[key]):.0f} GB/s)")


def sweep_bias_grad(n: int, copy: float) -> None:
    dy = torch.randn(ROWS, n, device="cuda").bfloat16()
    nbytes = dy.numel() * 2
    ref = dy.float().sum(0)
    t_torch = us(lambda: dy.sum(0))
    t_default = us(lambda: bg.bias_grad(dy))
    results = {}
    for (bm, bn), warps, per_sm in itertools.product(
            [(32, 128), (16, 256), (64, 64), (8, 512), (64, 128), (32, 256)], (4, 8), (2, 4, 8, 16)):
        cfg = bg.BiasGradConfig(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, programs_per_sm=per_sm)
        torch.testing.assert_close(bg.bias_grad(dy, config=cfg).float(), ref, rtol=1e-2, atol=1e-1)
        results[(bm, bn, warps, per_sm)] = us(lambda c=cfg: bg.bias_grad(dy, config=c))
    print(f"bias_grad N={n}: torch sum(0) {t_torch:.1f} us, default {t_default:.1f} us "
          f"({gbps(nbytes, t_default):.0f} GB/s), floor {nbytes / copy / 1e3:.1f} us")
    for key in sorted(results, key=results.get)[:6]:
        print(f"  M{key[0]} N{key[1]} w{key[2]} x{key[3]}/SM: {results[key]:.1f} us "
              f"({gbps(nbytes, results[key]):.0f} GB/s)")


def weight_grad_dtype(n_in: int, n_out: int) -> None:
    dy = torch.randn(ROWS, n_out, device="cuda").bfloat16()
    x = torch.randn(ROWS, n_in, device="cuda").bfloat16()
    a, b = dy.t(), x  # dW = dy^T x: (n_out, n_in), as F.linear's backward forms it
    ref = (a.float() @ b.float())
    err_cast = ((torch.mm(a, b).float() - ref).norm() / ref.norm()).item()
    err_fp32 = ((torch.ops.aten.mm.dtype(a, b, torch.float32) - ref).norm() / ref.norm()).item()
    t_cast = us(lambda: torch.mm(a, b).float())
    t_mm = us(lambda: torch.mm(a, b))
    t_fp32 = us(lambda: torch.ops.aten.mm.dtype(a, b, torch.float32))
    print(f"dW ({n_out} x {n_in}) over {ROWS} rows: bf16 mm {t_mm:.1f} us, + cast {t_cast:.1f} us, "
          f"mm.dtype fp32 {t_fp32:.1f} us; rel err vs fp32 {err_cast:.1e} / {err_fp32:.1e}")


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.date.today()}; {ROWS} rows, bf16, one call of a {COPIES}-call CUDA graph, median of 30")
    copy = copy_gbps()
    print(f"copy bandwidth {copy:.0f} GB/s")
    for n_in, n_out in [(768, 3072), (3072, 768), (768, 2304), (768, 768)]:
        weight_grad_dtype(n_in, n_out)
    for n in (2304, 768, 3072):
        sweep_bias_grad(n, copy)
    sweep_activation(3072, "gelu", copy)
    sweep_activation(3072, "gelu_tanh", copy)


if __name__ == "__main__":
    main()
