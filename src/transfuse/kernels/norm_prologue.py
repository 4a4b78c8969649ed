"""The norm a decode GEMV applies to its rows before multiplying (RMSNorm or LayerNorm, with the
residual add before it), and the launch arguments that describe it to both GEMV kernels
(kernels/gemv.py for (N, K) weights, kernels/gemv_kmajor.py for (K, N) ones): the same pointers,
strides and constexprs in the same order, packed here once."""

from __future__ import annotations

from typing import NamedTuple

import torch


class NormPrologue(NamedTuple):
    """The norm that norm_gemv_fwd applies to x before the GEMV, as transfuse's norm ops define it:
    residual (same shape as x) or None, weight (K,) or None, and for a LayerNorm (`layer`) its
    bias (K,) or None; weight_offset and cast_before_weight are rms_norm's (0 and False for a
    LayerNorm)."""
    residual: torch.Tensor | None
    weight: torch.Tensor | None
    eps: float
    weight_offset: float
    cast_before_weight: bool
    bias: torch.Tensor | None = None
    layer: bool = False


def launch_args(norm: NormPrologue | None, x2: torch.Tensor, summed: torch.Tensor | None = None,
                normed: torch.Tensor | None = None) -> tuple[tuple, dict]:
    """(the kernels' norm arguments: residual, its row stride, weight, bias, sum, its row stride,
    normalised rows, their row stride, eps, weight_offset; the NORM constexprs). `norm.residual` is
    already (M, K) like x2, `summed` is where x + residual goes and `normed` (M, K), if given, where
    the normalised rows go (a post-norm layer reads them again as its next residual). Without a
    norm, stand-ins that are never read and no flags (the kernels' defaults: no prologue)."""
    if norm is None:
        return (x2, 0, x2, x2, x2, 0, x2, 0, 0.0, 0.0), {}
    res = norm.residual
    args = (res if res is not None else x2, res.stride(0) if res is not None else 0,
            norm.weight if norm.weight is not None else x2, norm.bias if norm.bias is not None else x2,
            summed, summed.stride(0) if res is not None else 0,
            normed if normed is not None else x2, normed.stride(0) if normed is not None else 0,
            float(norm.eps), float(norm.weight_offset))
    flags = dict(NORM=True, NORM_RESIDUAL=res is not None, NORM_WEIGHT=norm.weight is not None,
                 NORM_BIAS=norm.bias is not None, LAYER_NORM=norm.layer, CAST_BEFORE_WEIGHT=norm.cast_before_weight,
                 STORE_NORMED=normed is not None)
    return args, flags
