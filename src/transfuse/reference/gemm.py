"""Plain-PyTorch linear with epilogue: the oracle for transfuse.kernels.gemm and transfuse::linear.

    out = act(x @ weight.T + bias) + residual

x: (..., K); weight: (N, K), or (2N, K) = [W_gate; W_up] for a gated "<act>_mul"; bias: (N,) or
(2N,); residual: (..., N). "<act>_mul" is act(gate) * up: "silu_mul" SwiGLU, "gelu_mul" and
"gelu_tanh_mul" GeGLU, "relu_mul" ReGLU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from transfuse.kernels.gemm import GATED_ACTIVATIONS

# The element-wise activations of ACTIVATIONS (kernels.gemm), out of place: the reference the kernels
# are tested against, the functions the linear pass recognises an activation by, and cuBLAS's gates.
ACTIVATION_FUNCTIONS = {
    "none": lambda h: h,
    "gelu": lambda h: F.gelu(h),
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "relu": F.relu,
    "tanh": torch.tanh,
    "silu": F.silu,
}


def linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    residual: torch.Tensor | None = None,
    upcast: bool = False,
) -> torch.Tensor:
    """act(x @ weight.T + bias) + residual, the eager PyTorch way.

    upcast=False computes in the inputs' dtype, rounding after every op (what an unfused model
    does: the baseline for "PyTorch's own error"); upcast=True computes everything in fp32 and
    returns fp32 (the oracle).
    """
    if upcast:
        x, weight = x.float(), weight.float()
        bias = bias.float() if bias is not None else None
        residual = residual.float() if residual is not None else None
    h = activate(F.linear(x, weight, bias), activation)
    return h + residual if residual is not None else h


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """The epilogue's activation on h, in h's dtype; a gated "<act>_mul" halves h's last dim. Only the
    activations the kernels implement (kernels.gemm.ACTIVATIONS): an oracle that accepted more would
    let a test pass for an epilogue no kernel has."""
    if activation in GATED_ACTIVATIONS:
        gate, up = h.chunk(2, dim=-1)
        return ACTIVATION_FUNCTIONS[activation[:-4]](gate) * up
    if activation not in ACTIVATION_FUNCTIONS:
        raise ValueError(f"unknown activation {activation!r}")
    return ACTIVATION_FUNCTIONS[activation](h)
