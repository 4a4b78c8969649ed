"""torch.ops.transfuse.rms_norm_linear / layer_norm_linear: an RMSNorm or a LayerNorm (with the
residual add before it) and the (first) linear that reads it, as one op.

    rms_norm_linear(Tensor x, Tensor? residual, Tensor? norm_weight, float eps, float weight_offset,
                    bool cast_before_weight, Tensor weight, Tensor? bias, str activation,
                    bool store_normed=False, bool store_sum=True) -> (Tensor out, Tensor sum, Tensor normed)

out = transfuse.linear(rms_norm(s), weight, bias, activation, None) with s = x + residual (rounded to
x's dtype) or s = x; sum = s when there is a residual (add_rms_norm's second output, the next
residual) unless store_sum is False, else an empty (0,) tensor; normed = rms_norm(s) when
store_normed, else an empty (0,) tensor. The norm's flags are transfuse.rms_norm's. A post-norm layer
never reads the sum (its residual is the normalised rows): store_sum=False keeps the unfused path
from writing it.

    layer_norm_linear(Tensor x, Tensor? residual, Tensor? norm_weight, Tensor? norm_bias, float eps,
                      Tensor weight, Tensor? bias, str activation, bool store_normed=False,
                      bool store_sum=True)
        -> (Tensor out, Tensor sum, Tensor normed)

the same with transfuse.layer_norm / add_layer_norm (GPT-2's ln_1 -> c_attn, ln_2 -> c_fc; with
store_normed, BART's and BERT's post-norm layers, whose normalised rows are also the next residual).

Why: in a decode step (one or two rows) each of a layer's two or three norms is a launch of its own
that costs as much as a small GEMV, for 2 * K values. With 1-2 rows the GEMV (kernels.gemv) loads
whole rows of x in every program anyway, so each program normalises them itself
(kernels.gemv.norm_gemv_fwd): one launch instead of two, and where the normalised rows are read
again (store_normed) one program column stores them on the way. With more rows, or shapes the GEMV
does not take, the op runs the norm kernel and then transfuse.linear's own dispatch: the two ops it
replaces. The normalised row is rounded to x's dtype where the unfused norm rounds it, so both paths
feed the linear the same values. Forward only (the pass that creates it runs on inference graphs).
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
            and weight.shape[0] > 0 and gemv.norm_gemv_applies(x, weight, prologue))


def _run_fused(x, prologue, weight, bias, activation, store_normed, store_sum):
    normed = torch.empty(x.shape, device=x.device, dtype=x.dtype) if store_normed else None
    out, summed = gemv.norm_gemv_fwd(x, prologue, weight, bias, activation, normed=normed)
    # (1-2 rows: the kernel's sum store is a few KB; it is simply not returned)
    return out, summed if store_sum else x.new_empty((0,)), normed if store_normed else x.new_empty((0,))


def _unused(normed: torch.Tensor, store_normed: bool) -> torch.Tensor:
    return normed if store_normed else normed.new_empty((0,))


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
    store_normed: bool = False,
    store_sum: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x [+ residual])), x + residual or empty, the normalised rows or empty); see
    the module docstring."""
    prologue = gemv.NormPrologue(residual, norm_weight, eps, weight_offset, cast_before_weight)
    if _fused(x, weight, prologue):
        return _run_fused(x, prologue, weight, bias, activation, store_normed, store_sum)
    if residual is None:
        normed = norm_kernels.rms_norm_fwd(x, norm_weight, eps, weight_offset, cast_before_weight)
        summed = x.new_empty((0,))
    else:
        normed, summed = norm_kernels.add_rms_norm_fwd(x, residual, norm_weight, eps, weight_offset,
                                                        cast_before_weight, store_sum)
    return linear_dispatch(normed, weight, bias, activation, None), summed, _unused(normed, store_normed)


@rms_norm_linear.register_fake
def _(x, residual, norm_weight, eps, weight_offset, cast_before_weight, weight, bias, activation, store_normed=False,
      store_sum=True):
    norm_kernels.check_rms_norm_args(x, norm_weight, weight_offset, cast_before_weight, residual)
    return _fake_outputs(x, residual, weight, bias, activation, store_normed, store_sum)


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
    store_normed: bool = False,
    store_sum: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(linear(layer_norm(x [+ residual])), x + residual or empty, the normalised rows or empty);
    see the module docstring."""
    prologue = gemv.NormPrologue(residual, norm_weight, eps, 0.0, False, norm_bias, True)
    if _fused(x, weight, prologue):
        return _run_fused(x, prologue, weight, bias, activation, store_normed, store_sum)
    if residual is None:
        normed = norm_kernels.layer_norm_fwd(x, norm_weight, norm_bias, eps)
        summed = x.new_empty((0,))
    else:
        normed, summed = norm_kernels.add_layer_norm_fwd(x, residual, norm_weight, norm_bias, eps, store_sum)
    return linear_dispatch(normed, weight, bias, activation, None), summed, _unused(normed, store_normed)


@layer_norm_linear.register_fake
def _(x, residual, norm_weight, norm_bias, eps, weight, bias, activation, store_normed=False, store_sum=True):
    norm_kernels.check_layer_norm_args(x, norm_weight, norm_bias, residual)
    return _fake_outputs(x, residual, weight, bias, activation, store_normed, store_sum)


def _fake_outputs(x, residual, weight, bias, activation, store_normed, store_sum):
    n_out = gemm_kernels.check_linear_args(x, weight, bias, activation, None)
    return (x.new_empty((*x.shape[:-1], n_out)), x.new_empty(x.shape if residual is not None and store_sum else (0,)),
            x.new_empty(x.shape if store_normed else (0,)))
