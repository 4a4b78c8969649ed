"""torch.ops.transfuse.rms_norm_linear / layer_norm_linear: an RMSNorm or a LayerNorm (with the
residual add before it) and the one linear that reads it, as one op.

    rms_norm_linear(Tensor x, Tensor? residual, Tensor? norm_weight, float eps, float weight_offset,
                    bool cast_before_weight, Tensor weight, Tensor? bias, str activation)
        -> (Tensor out, Tensor sum)

out = transfuse.linear(rms_norm(s), weight, bias, activation, None) with s = x + residual (rounded to
x's dtype) or s = x; sum = s when there is a residual (add_rms_norm's second output, the next
residual), else an empty (0,) tensor. The norm's flags are transfuse.rms_norm's.

    layer_norm_linear(Tensor x, Tensor? residual, Tensor? norm_weight, Tensor? norm_bias, float eps,
                      Tensor weight, Tensor? bias, str activation) -> (Tensor out, Tensor sum)

the same with transfuse.layer_norm / add_layer_norm (GPT-2's ln_1 -> c_attn, ln_2 -> c_fc).

Why: in a decode step (one or two rows) each of a layer's two norms is a launch of its own
that costs as much as a small GEMV, for 2 * K values. With 1-2 rows the GEMV (kernels.gemv) loads
whole rows of x in every program anyway, so each program normalises them itself
(kernels.gemv.norm_gemv_fwd): one launch instead of two. With more rows, or shapes the GEMV does not
take, the op runs the norm kernel and then transfuse.linear's own dispatch: the two ops it replaces.
The normalised row is rounded to x's dtype where the unfused norm rounds it, so both paths feed the
linear the same values. Forward only (the pass that creates it runs on inference graphs).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from transfuse.kernels import gemm as gemm_kernels
from transfuse.kernels import gemv
from transfuse.kernels import norm as norm_kernels
from transfuse.kernels._config import INTERPRET
from transfuse.ops.gemm import gemm_backend, linear_dispatch


def _fused(x: torch.Tensor, weight: torch.Tensor, prologue: gemv.NormPrologue) -> bool:
    rows = math.prod(x.shape[:-1])
    return ((x.is_cuda or INTERPRET) and gemm_backend() != "torch" and 0 < rows <= gemv.GEMV_FAST_M_MAX
            and gemv.norm_gemv_applies(x, weight, prologue))


@torch.library.custom_op("transfuse::rms_norm_linear", mutates_args=())
def rms_norm_linear(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    norm_weight: Optional[torch.Tensor],
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x [+ residual])), x + residual or empty); see the module docstring."""
    prologue = gemv.NormPrologue(residual, norm_weight, eps, weight_offset, cast_before_weight)
    if _fused(x, weight, prologue):
        return gemv.norm_gemv_fwd(x, prologue, weight, bias, activation)
    if residual is None:
        normed = norm_kernels.rms_norm_fwd(x, norm_weight, eps, weight_offset, cast_before_weight)
        summed = x.new_empty((0,))
    else:
        normed, summed = norm_kernels.add_rms_norm_fwd(x, residual, norm_weight, eps, weight_offset,
                                                        cast_before_weight, True)
    return linear_dispatch(normed, weight, bias, activation, None), summed


@rms_norm_linear.register_fake
def _(x, residual, norm_weight, eps, weight_offset, cast_before_weight, weight, bias, activation):
    norm_kernels.check_rms_norm_args(x, norm_weight, weight_offset, cast_before_weight, residual)
    return _fake_outputs(x, residual, weight, bias, activation)


@torch.library.custom_op("transfuse::layer_norm_linear", mutates_args=())
def layer_norm_linear(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    norm_weight: Optional[torch.Tensor],
    norm_bias: Optional[torch.Tensor],
    eps: float,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(layer_norm(x [+ residual])), x + residual or empty); see the module docstring."""
    prologue = gemv.NormPrologue(residual, norm_weight, eps, 0.0, False, norm_bias, True)
    if _fused(x, weight, prologue):
        return gemv.norm_gemv_fwd(x, prologue, weight, bias, activation)
    if residual is None:
        normed = norm_kernels.layer_norm_fwd(x, norm_weight, norm_bias, eps)
        summed = x.new_empty((0,))
    else:
        normed, summed = norm_kernels.add_layer_norm_fwd(x, residual, norm_weight, norm_bias, eps, True)
    return linear_dispatch(normed, weight, bias, activation, None), summed


@layer_norm_linear.register_fake
def _(x, residual, norm_weight, norm_bias, eps, weight, bias, activation):
    norm_kernels.check_layer_norm_args(x, norm_weight, norm_bias, residual)
    return _fake_outputs(x, residual, weight, bias, activation)


def _fake_outputs(x, residual, weight, bias, activation):
    n_out = gemm_kernels.check_linear_args(x, weight, bias, activation, None)
    return x.new_empty((*x.shape[:-1], n_out)), x.new_empty(x.shape if residual is not None else (0,))
