"""A decode step's rotary + KV-cache write and the attention that reads the cache, as one op (forward only):

    rotary_cache_attention(Tensor(a!) keys, Tensor(b!) values, Tensor q, Tensor k, Tensor v, Tensor cos,
                           Tensor sin, Tensor start, Tensor? mask, Tensor? mask_summary, float scale,
                           bool is_causal, bool masked_rows_zero, Tensor? key_len, Tensor? sinks) -> Tensor
      = transfuse.attention(transfuse.rotary_kv_cache_write(keys, values, q, k, v, cos, sin, start),
                            keys, values, mask, mask_summary, scale, is_causal, masked_rows_zero, key_len, sinks)

    qkv_rotary_cache_attention(<qkv_rotary_cache_write's arguments>, <attention's after v>) -> (out, sum)
      = the same after transfuse.qkv_rotary_cache_write's norm + Q/K/V linear.

Where the decode attention kernel takes the call (a few query rows, no causal triangle), it rotates
q and the new keys itself and writes the cache (kernels/attention_decode.py): one launch instead of
two (batch 8 of Llama-1.1B: the write kernel took 3.1 us of a 48 us layer). With one or two rows the
norm + Q/K/V GEMV already does the rotary and the write in its epilogue (ops/qkv_rotary_cache.py),
and that stays. Elsewhere (prefill) the write kernel runs first, then the attention: the ops they
replace. The output differs from the two ops only in the order the new keys join the online softmax.
"""

from __future__ import annotations

from typing import Optional

import torch

from transfuse.kernels.attention import attention_empty_out, attention_fwd
from transfuse.kernels.kv_cache import check_rotary_kv_cache_write_args
from transfuse.ops.qkv_rotary_cache import _check, qkv_heads


@torch.library.custom_op("transfuse::rotary_cache_attention", mutates_args=("keys", "values"))
def rotary_cache_attention(
    keys: torch.Tensor,
    values: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    start: torch.Tensor,
    mask: Optional[torch.Tensor],
    mask_summary: Optional[torch.Tensor],
    scale: float,
    is_causal: bool,
    masked_rows_zero: bool,
    key_len: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    return attention_fwd(q, keys, values, mask, mask_summary, scale, is_causal, masked_rows_zero, key_len, sinks,
                         rotary=(k, v, cos, sin, start))


@rotary_cache_attention.register_fake
def _(keys, values, q, k, v, cos, sin, start, mask, mask_summary, scale, is_causal, masked_rows_zero, key_len=None,
      sinks=None):
    check_rotary_kv_cache_write_args(keys, values, q, k, v, cos, sin, start)
    return attention_empty_out(q, values)


@torch.library.custom_op("transfuse::qkv_rotary_cache_attention", mutates_args=("keys", "values"))
def qkv_rotary_cache_attention(
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
    mask: Optional[torch.Tensor],
    mask_summary: Optional[torch.Tensor],
    scale: float,
    is_causal: bool,
    masked_rows_zero: bool,
    key_len: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention output, x + residual or empty); see the module docstring."""
    q, k, v, summed = qkv_heads(x, residual, norm_weight, norm_bias, eps, weight_offset, cast_before_weight,
                                layer_norm, weight, bias, keys, values, cos, sin, start, q_heads)
    rotary = None if k is None else (k, v, cos, sin, start)  # None: the GEMV's epilogue wrote the cache
    out = attention_fwd(q, keys, values, mask, mask_summary, scale, is_causal, masked_rows_zero, key_len, sinks,
                        rotary=rotary)
    return out, summed


@qkv_rotary_cache_attention.register_fake
def _(x, residual, norm_weight, norm_bias, eps, weight_offset, cast_before_weight, layer_norm, weight, bias,
      keys, values, cos, sin, start, q_heads, mask, mask_summary, scale, is_causal, masked_rows_zero, key_len=None,
      sinks=None):
    B, n, D = _check(x, weight, bias, keys, q_heads)
    q = x.new_empty((B, q_heads, n, D))
    k = x.new_empty((B, keys.shape[1], n, D))
    check_rotary_kv_cache_write_args(keys, values, q, k, k, cos, sin, start)
    return attention_empty_out(q, values), x.new_empty(x.shape if residual is not None else (0,))
