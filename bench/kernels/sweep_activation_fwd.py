"""Tile sweep of the GEMM epilogue's activation kernel on its own (transfuse.kernels.activation_backward's
_activation_fwd_kernel through activation_fwd): the forward of every training MLP, and the
recomputation the backward does (passes/recompute_activations.py), 24 calls a GPT-2 step at
8192 x 3072 bf16. Against the copy floor: torch's copy of the same bytes (read pre, write out).

    PYTHONPATH=src python3 bench/kernels/sweep_activation_fwd.py
"""

from __future__ import annotations

import itertools

import torch
import triton

from transfuse.kernels import activation_backward as ab


def us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200) * 1e3


def sweep(rows: int, width: int, activation: str) -> None:
    pre = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    n = width // 2 if activation == "silu_mul" else width
    src = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    floor = us(lambda: dst.copy_(src)) * (width + n) / (2 * n)  # bytes read + written, as a copy's
    ref = ab.activation_fwd(pre, activation)
    default = ab.activation_fwd_config  # the tiles activation_fwd launches with
    results = {}
    try:
        for tile, block_n, warps in itertools.product((1024, 2048, 4096, 8192), (64, 128, 256, 512), (4, 8)):
            if block_n > tile or tile // block_n > 128:
                continue
            cfg = ab.ActivationConfig(BLOCK_M=tile // block_n, BLOCK_N=block_n, num_warps=warps)
            ab.activation_fwd_config = lambda _n, c=cfg: c
            assert torch.equal(ab.activation_fwd(pre, activation), ref)
            results[(tile, block_n, warps)] = us(lambda: ab.activation_fwd(pre, activation))
    finally:
        ab.activation_fwd_config = default
    t_default = us(lambda: ab.activation_fwd(pre, activation))
    best = sorted(results.items(), key=lambda kv: kv[1])[:5]
    print(f"activation_fwd {activation} {rows}x{width}: default {t_default:.1f} us, copy floor {floor:.1f} us; best "
          + ", ".join(f"tile {t} x {bn} cols w{w}: {v:.1f}" for (t, bn, w), v in best))


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for activation in ("gelu", "gelu_tanh", "relu"):
        sweep(8192, 3072, activation)
    sweep(4096, 2 * 5632, "silu_mul")  # Llama-1.1B's gate_up at 4 x 1024 tokens


if __name__ == "__main__":
    main()
