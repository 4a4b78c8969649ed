"""A decode step's KV-cache write and the attention that reads the cache, as one op (forward only):

    kv_cache_attention(Tensor(a!) keys, Tensor(b!) values, Tensor q, Tensor k, Tensor v, Tensor start,
                       Tensor? mask, Tensor? mask_summary, float scale, bool is_causal,
                       bool masked_rows_zero, Tensor? key_len, Tensor? sinks) -> Tensor
      = transfuse.kv_cache_write(keys, values, k, v, start); transfuse.attention(q, keys, values, mask, ...)

    rotary_cache_attention(keys!, values!, q, k, v, cos, sin, start, <attention's after v>) -> Tensor
      = transfuse.attention(transfuse.rotary_kv_cache_write(keys, values, q, k, v, cos, sin, start),
                            keys, values, mask, mask_summary, scale, is_causal, masked_rows_zero, key_len, sinks)

    qkv_rotary_cache_attention(<qkv_rotary_cache_write's arguments>, <attention's after v>) -> (out, sum)
      = the same after transfuse.qkv_rotary_cache_write's norm + Q/K/V linear.

Where the decode attention kernel takes the call (as many new keys as query rows, a few, no causal
triangle), it writes the cache itself, rotating q and the new keys for the rotary forms
(kernels/attention_decode.py): one launch instead of two (batch 8 of Llama-1.1B: the write kernel
took 3.1 us of a 48 us layer). With one or two rows the norm + Q/K/V GEMV already does the rotary and
the write in its epilogue (ops/qkv_rotary_cache.py), and that stays. Elsewhere (prefill) the write
kernel runs first, then the attention: the ops they replace. The output differs from the two ops
only in the order the new keys join the online softmax.
"""

from __future__ import annotations

from typing import Optional

import torch

from transfuse.kernels.attention import attention_empty_out, attention_fwd
from transfuse.kernels.kv_cache import check_kv_cache_write_args, check_rotary_kv_cache_write_args
from transfuse.ops.qkv_rotary_cache import _check, qkv_heads


@torch.library.custom_op("transfuse::kv_cache_attention", mutates_args=("keys", "values"))
def kv_cache_attention(
    keys: torch.Tensor,
    values: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
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
                         new_kv=(k, v, None, None, start))


@kv_cache_attention.register_fake
def _(keys, values, q, k, v, start, mask, mask_summary, scale, is_causal, masked_rows_zero, key_len=None, sinks=None):
    check_kv_cache_write_args(keys, values, k, v, start)
    return attention_empty_out(q, values)


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
                         new_kv=(k, v, cos, sin, start))


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
    new_kv = None if k is None else (k, v, cos, sin, start)  # None: the GEMV's epilogue wrote the cache
    out = attention_fwd(q, keys, values, mask, mask_summary, scale, is_causal, masked_rows_zero, key_len, sinks,
                        new_kv=new_kv)
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
