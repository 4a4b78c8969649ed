"""The training MLP's gated activation kernels on their own: activation_fwd (act(gate) * up) and
activation_bwd (both halves' gradients) for every gate the GEMM epilogue knows, at a Llama-1.1B
gate_up (4 x 1024 tokens, 2 x 5632 wide) and a Gemma-2B one (4 x 1024, 2 x 16384), bf16. Against
the copy floor: torch's copy of the same number of bytes. Run it with two source trees on
PYTHONPATH to compare them; a gate the tree does not know is skipped.

    PYTHONPATH=src python3 bench/kernels/bench_gated_activation.py
"""

from __future__ import annotations

import torch
import triton

from transfuse.kernels import activation_backward as ab

SHAPES = ((4096, 2 * 5632), (4096, 2 * 16384))
GATES = ("silu_mul", "gelu_mul", "gelu_tanh_mul", "relu_mul")


def us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200) * 1e3


def copy_us(nbytes: int) -> float:
    """A copy that moves nbytes: it reads nbytes / 2 and writes as many."""
    src = torch.empty(nbytes // 4, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return us(lambda: dst.copy_(src))


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16, "
          "triton.testing.do_bench median (warm-up 25 ms, 200 ms)")
    print(f"{'gate':14} {'rows x width':>14} {'fwd us':>8} {'floor':>7} {'bwd us':>8} {'floor':>7}")
    for rows, width in SHAPES:
        pre = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn(rows, width // 2, device="cuda", dtype=torch.bfloat16)
        fwd_floor = copy_us(pre.numel() * 2 * 3 // 2)  # read gate+up, write half
        bwd_floor = copy_us(pre.numel() * 2 * 5 // 2)  # read gate+up and grad, write both halves
        for gate in GATES:
            try:
                ab.activation_fwd(pre, gate)
            except Exception as e:  # noqa: BLE001  (an older tree without this gate)
                print(f"{gate:14} {rows:>6} x {width:<6}  not in this tree ({type(e).__name__})")
                continue
            fwd = us(lambda: ab.activation_fwd(pre, gate))
            bwd = us(lambda: ab.activation_bwd(grad, pre, gate))
            print(f"{gate:14} {rows:>6} x {width:<6} {fwd:8.1f} {fwd_floor:7.1f} {bwd:8.1f} {bwd_floor:7.1f}")


if __name__ == "__main__":
    main()
