"""torch.ops.transfuse.qkv_rotary_cache_write: a decode step's norm, merged Q/K/V linear, rotary
embedding and KV-cache write as one op (one launch where kernels.qkv_rotary_cache takes the inputs).

    qkv_rotary_cache_write(Tensor x, Tensor? residual, Tensor? norm_weight, Tensor? norm_bias, float eps,
                           float weight_offset, bool cast_before_weight, bool layer_norm, Tensor weight,
                           Tensor? bias, Tensor(a!) keys, Tensor(b!) values, Tensor cos, Tensor sin,
                           Tensor start, int q_heads) -> (Tensor q_rot, Tensor sum)

The two ops it replaces (bit for bit under the interpreter; on a GPU up to the compiler's
contraction of the rotary's multiply-adds, a last-bit difference):

    qkv, sum = transfuse.rms_norm_linear(x, residual, norm_weight, eps, weight_offset, cast_before_weight,
                                         weight, bias, "none")     # layer_norm_linear when layer_norm
    q, k, v = qkv's [q_heads | HK | HK] heads of D columns, as (B, H, n, D) views (HK, D: the cache's)
    q_rot = transfuse.rotary_kv_cache_write(keys, values, q, k, v, cos, sin, start)

Where the fused kernel does not apply (more rows than a decode step, heads not shared by cos/sin,
other layouts) the op runs exactly those two. Forward only.
"""

from __future__ import annotations

from typing import Optional

import torch

from transfuse.kernels import gemm as gemm_kernels
from transfuse.kernels import qkv_rotary_cache as kernels
from transfuse.kernels._config import INTERPRET
from transfuse.kernels.kv_cache import check_rotary_kv_cache_write_args, rotary_kv_cache_write_fwd
from transfuse.kernels.norm_prologue import NormPrologue
from transfuse.ops.gemm import gemm_backend


def _check(x, weight, bias, keys, q_heads) -> tuple[int, int, int]:
    if x.dim() != 3:
        raise ValueError(f"qkv_rotary_cache_write: x must be (batch, tokens, hidden), got {tuple(x.shape)}")
    if keys.dim() != 4:
        raise ValueError(f"qkv_rotary_cache_write: the cache must be (batch, kv_heads, positions, head_dim), "
                         f"got {tuple(keys.shape)}")
    HK, D = keys.shape[1], keys.shape[3]
    n_out = gemm_kernels.check_linear_args(x, weight, bias, "none", None)
    if n_out != (q_heads + 2 * HK) * D:
        raise ValueError(f"qkv_rotary_cache_write: the linear gives {n_out} columns, not (q_heads {q_heads} + "
                         f"2 x kv_heads {HK}) x head_dim {D}")
    return x.shape[0], x.shape[1], D


def qkv_heads(x, residual, norm_weight, norm_bias, eps, weight_offset, cast_before_weight, layer_norm, weight, bias,
              keys, values, cos, sin, start, q_heads):
    """(q, k, v, sum): where the fused kernel takes the inputs, q rotated with rotary(k) and v written
    into the cache (k = v = None); otherwise the norm + linear alone, q, k, v its unrotated views
    and nothing written (the caller writes them: here, or in the decode attention)."""
    _check(x, weight, bias, keys, q_heads)
    prologue = NormPrologue(residual, norm_weight, eps, weight_offset, cast_before_weight, norm_bias, layer_norm)
    if ((x.is_cuda or INTERPRET) and gemm_backend() != "torch"
            and kernels.qkv_rotary_cache_applies(x, prologue, weight, bias, keys, values, cos, sin, q_heads)):
        q_rot, summed = kernels.qkv_rotary_cache_fwd(x, prologue, weight, bias, keys, values, cos, sin, start, q_heads)
        return q_rot, None, None, summed
    if layer_norm:
        qkv, summed, _ = torch.ops.transfuse.layer_norm_linear(x, residual, norm_weight, norm_bias, eps, weight, bias, "none")
    else:
        qkv, summed, _ = torch.ops.transfuse.rms_norm_linear(x, residual, norm_weight, eps, weight_offset,
                                                             cast_before_weight, weight, bias, "none")
    q, k, v = kernels.split_heads(qkv, q_heads, keys.shape[1], keys.shape[3])
    return q, k, v, summed


@torch.library.custom_op("transfuse::qkv_rotary_cache_write", mutates_args=("keys", "values"))
def qkv_rotary_cache_write(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    norm_weight: Optional[torch.Tensor],
    norm_bias: Optional[torch.Tensor],
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    layer_norm: bool,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    keys: torch.Tensor,
    values: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    start: torch.Tensor,
    q_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotary(q), x + residual or empty) with rotary(k) and v written into keys/values at start;
    see the module docstring."""
    q, k, v, summed = qkv_heads(x, residual, norm_weight, norm_bias, eps, weight_offset, cast_before_weight,
                                layer_norm, weight, bias, keys, values, cos, sin, start, q_heads)
    if k is None:
        return q, summed
    return rotary_kv_cache_write_fwd(keys, values, q, k, v, cos, sin, start), summed


@qkv_rotary_cache_write.register_fake
def _(x, residual, norm_weight, norm_bias, eps, weight_offset, cast_before_weight, layer_norm, weight, bias,
      keys, values, cos, sin, start, q_heads):
    B, n, D = _check(x, weight, bias, keys, q_heads)
    q = x.new_empty((B, q_heads, n, D))
    k = x.new_empty((B, keys.shape[1], n, D))
    check_rotary_kv_cache_write_args(keys, values, q, k, k, cos, sin, start)
    return q, x.new_empty(x.shape if residual is not None else (0,))
