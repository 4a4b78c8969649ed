"""The norm a decode GEMV applies to its rows before multiplying (RMSNorm or LayerNorm, with the
residual add before it), and what every kernel with this prologue shares (the GEMV kernels,
kernels/gemv.py for (N, K) weights and kernels/gemv_kmajor.py for (K, N) ones, and the fused QKV +
rotary + cache write, kernels/qkv_rotary_cache.py): the check of the norm's operands, its rows as
the kernels read them, the check of a `normed` output, and the launch arguments (the same pointers,
strides and constexprs in the same order), each written here once."""

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


def operands_match(x: torch.Tensor, norm: NormPrologue) -> bool:
    """Whether the norm's residual, weight and bias are of x's dtype and device (the normalised row is
    rounded to it, as the unfused op's output), the residual of x's shape, weight and bias (K,)."""
    same = [t for t in (norm.residual, norm.weight, norm.bias) if t is not None]
    return (all(t.dtype == x.dtype and t.device == x.device for t in same)
            and (norm.residual is None or norm.residual.shape == x.shape)
            and all(t.shape == (x.shape[-1],) for t in (norm.weight, norm.bias) if t is not None))


def norm_rows(x: torch.Tensor, norm: NormPrologue) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x and the norm's residual (or None) as (M, K) rows with unit stride along K, as the norm-prologue
    kernels read them (a copy only where the stride is not 1)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    res2 = norm.residual.reshape(-1, K) if norm.residual is not None else None
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if res2 is not None and res2.stride(1) != 1:
        res2 = res2.contiguous()
    return x2, res2


def check_normed(normed: torch.Tensor | None, x: torch.Tensor, launcher: str) -> None:
    """Raises unless `normed` (where a launcher stores the normalised rows) is None or a contiguous
    tensor of x's shape, dtype and device."""
    if normed is not None and (normed.shape != x.shape or normed.dtype != x.dtype or normed.device != x.device
                               or not normed.is_contiguous()):
        raise ValueError(f"{launcher}: normed must be a contiguous {tuple(x.shape)} {x.dtype} tensor on "
                         f"{x.device}, got {tuple(normed.shape)} {normed.dtype}: allocate it with torch.empty(x.shape, ...)")


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
