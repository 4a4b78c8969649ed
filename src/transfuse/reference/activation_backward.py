"""Plain-PyTorch activation step of a training linear: the oracle for
transfuse.kernels.activation_backward.

    activation_ref(pre, activation, residual)     = act(pre) + residual
    activation_bwd_ref(grad_out, pre, activation) = the gradient torch's autograd sends to pre

pre: (..., N), or (..., 2N) = [gate | up] for a gated "<act>_mul" (act(gate) * up); residual, grad_out:
(..., N). The backward is torch.autograd.grad through activation_ref: by construction the formulas
eager autograd uses, in whichever dtype the inputs have.
"""

from __future__ import annotations

import torch

from transfuse.reference.gemm import activate


def activation_ref(pre: torch.Tensor, activation: str, residual: torch.Tensor | None = None,
                   upcast: bool = False) -> torch.Tensor:
    """act(pre) + residual, the eager way: in the inputs' dtype, rounding after every op, or with
    upcast=True in fp32 (returns fp32)."""
    if upcast:
        pre = pre.float()
        residual = residual.float() if residual is not None else None
    h = activate(pre, activation)
    return h + residual if residual is not None else h


def activation_bwd_ref(grad_out: torch.Tensor, pre: torch.Tensor, activation: str,
                       upcast: bool = False) -> torch.Tensor:
    """d activation_ref(pre) / d pre applied to grad_out, by torch.autograd; fp32 with upcast=True."""
    pre = (pre.float() if upcast else pre).detach().requires_grad_(True)
    out = activation_ref(pre, activation)
    (grad_pre,) = torch.autograd.grad(out, pre, grad_out.to(out.dtype))
    return grad_pre
