"""A decode step's merged Q/K/V projection with its norm, rotary embedding and KV-cache write, in one
launch:

    qkv = linear(norm(x), weight, bias)            # kernels.gemv.norm_gemv_fwd: x (B, n, K), n new tokens
    q, k, v = qkv's [HQ | HK | HK] heads of D columns, as (B, H, n, D)
    q_rot = rotary(q)                               # returned, a new contiguous (B, HQ, n, D) tensor
    keys[:, :, start + i] = rotary(k)[:, :, i]      # positions start + i < L only
    values[:, :, start + i] = v[:, :, i]

rotary is the rotate-half form, x * cos + rotate_half(x) * sin, with cos and sin (B or 1, 1, n, D)
shared by the heads; start is a 0-d device tensor (the cache's length), read by the kernel so that one
CUDA graph serves every step. Reference: the two launches it replaces, kernels.gemv.norm_gemv_fwd and
kernels.kv_cache.rotary_kv_cache_write_fwd.

Why: after the norm-GEMV, the rotary + cache write was a launch of its own per layer, 2.6 us of
kernel and a launch gap for a few KB (Llama-1.1B decode on an H100: ~60 us of a 1.05 ms step).
Here the GEMV's epilogue does it on values already in registers.

Program layout: a rotate-half rotary mixes column c of a head with column c + D/2, so each program
owns BLOCK_P column pairs (c, c + D/2) and streams both weight rows into two accumulators, as the
gated GEMV streams rows n and n + N. Pair j is column j % (D/2) of head j // (D/2) among the
HQ + 2 HK heads. The per-column arithmetic is norm_gemv_fwd's (same K step, lanes and warps, so the
same sums), then the bias and one rounding to x's dtype (the linear's stored output), then the
rotary in fp32 and one rounding (kernels.rotary's formula). Bit for bit the two launches it
replaces under the interpreter; on a GPU the compiler may contract the rotary's multiply-adds
otherwise in the two kernels (a last-bit difference; the GPU test holds it to the unfused pair's
own error against fp32).

Measured (H100, torch 2.11, triton 3.6, llama-1.1B fp16 batch 1 decode, 2026-11-26,
bench/decode_step_time.py): 1,039 -> 996 us a step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transfuse.kernels import gemv
from transfuse.kernels._config import INTERPRET, pdl, wait_for_previous_kernel
from transfuse.kernels.gemv import _normed_rows
from transfuse.kernels.norm_prologue import NormPrologue, launch_args, norm_rows


@triton.jit(do_not_specialize=["M", "n", "L"])
def _qkv_rotary_cache_fwd_kernel(
    x_ptr, stride_x_m,
    w_ptr, stride_w_n,  # unit stride along K
    bias_ptr,
    nres_ptr, stride_nres_m, nw_ptr, nb_ptr, sum_ptr, stride_sum_m, normed_ptr, stride_normed_m,  # the norm
    eps, weight_offset,  # (launch_args)
    q_out_ptr,  # (B, HQ, n, D) contiguous
    keys_ptr, stride_keys_b, stride_keys_h, stride_keys_s,  # unit stride along D
    values_ptr, stride_values_b, stride_values_h, stride_values_s,
    cos_ptr, stride_cos_b, stride_cos_s, sin_ptr, stride_sin_b, stride_sin_s,  # unit stride along D
    start_ptr,
    M, n, L, K,  # M = B * n rows of x, n new tokens a sequence, L cache positions
    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # M's power-of-two bucket; rows past M re-read row m % M, never stored
    BLOCK_P: tl.constexpr,  # column pairs a program
    BLOCK_K: tl.constexpr,  # >= K: the whole row is one step (the norm needs it)
    VEC: tl.constexpr,
    NORM: tl.constexpr = True,  # launch_args' flags; always a norm here
    NORM_RESIDUAL: tl.constexpr = False,
    NORM_WEIGHT: tl.constexpr = False,
    NORM_BIAS: tl.constexpr = False,
    LAYER_NORM: tl.constexpr = False,
    CAST_BEFORE_WEIGHT: tl.constexpr = False,
    STORE_NORMED: tl.constexpr = False,
    BF16_RNE_BY_HAND: tl.constexpr = False,
    PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (_config.pdl)
):
    HALF: tl.constexpr = D // 2
    PAIRS: tl.constexpr = (HQ + 2 * HK) * HALF
    LANES: tl.constexpr = BLOCK_K // VEC
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)

    offs_m = tl.arange(0, BLOCK_M)
    pairs = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    pair_ok = pairs < PAIRS
    # Out-of-range rows and pairs wrap back into range (never stored): the loads need no masks.
    pairs = pairs % PAIRS
    head = pairs // HALF
    col = pairs % HALF
    lo = (head * D + col).to(tl.int64)  # the pair's first column of the linear's output
    rows = (offs_m % M).to(tl.int64)

    # gemv._gemv_fwd_kernel's (M, N, LANES, VEC) tiles, N being the pairs' first or second columns
    offs_k = tl.arange(0, LANES)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    offs_k = offs_k[None, None, :, :]
    mask_k = offs_k < K
    w_lo_ptrs = w_ptr + lo[None, :, None, None] * stride_w_n + offs_k
    w_hi_ptrs = w_lo_ptrs + HALF * stride_w_n
    wait_for_previous_kernel(PDL)

    acc_lo = tl.zeros((BLOCK_M, BLOCK_P, LANES), dtype=tl.float32)
    acc_hi = acc_lo
    x = _normed_rows(x_ptr, rows, stride_x_m, offs_k, mask_k, offs_m < M, pid == 0,
                     nres_ptr, stride_nres_m, nw_ptr, nb_ptr, sum_ptr, stride_sum_m, normed_ptr, stride_normed_m,
                     eps, weight_offset, K, NORM_RESIDUAL, NORM_WEIGHT, NORM_BIAS, LAYER_NORM, CAST_BEFORE_WEIGHT,
                     BF16_RNE_BY_HAND, STORE_NORMED)
    w_lo = tl.load(w_lo_ptrs, mask=mask_k, other=0.0, eviction_policy="evict_first")
    acc_lo += tl.sum(x * w_lo.to(tl.float32), axis=3)
    w_hi = tl.load(w_hi_ptrs, mask=mask_k, other=0.0, eviction_policy="evict_first")
    acc_hi += tl.sum(x * w_hi.to(tl.float32), axis=3)
    acc_lo = tl.sum(acc_lo, axis=2)
    acc_hi = tl.sum(acc_hi, axis=2)

    if HAS_BIAS:
        acc_lo += tl.load(bias_ptr + lo).to(tl.float32)[None, :]
        acc_hi += tl.load(bias_ptr + lo + HALF).to(tl.float32)[None, :]
    # the linear's output as it would be stored, and read back by the rotary
    a = acc_lo.to(DTYPE).to(tl.float32)
    b = acc_hi.to(DTYPE).to(tl.float32)

    # row m is token s = m % n of sequence m // n
    seq = rows // n
    tok = rows % n
    c_lo = tl.load(cos_ptr + (seq * stride_cos_b + tok * stride_cos_s)[:, None] + col[None, :]).to(tl.float32)
    c_hi = tl.load(cos_ptr + (seq * stride_cos_b + tok * stride_cos_s)[:, None] + (col + HALF)[None, :]).to(tl.float32)
    s_lo = tl.load(sin_ptr + (seq * stride_sin_b + tok * stride_sin_s)[:, None] + col[None, :]).to(tl.float32)
    s_hi = tl.load(sin_ptr + (seq * stride_sin_b + tok * stride_sin_s)[:, None] + (col + HALF)[None, :]).to(tl.float32)
    # kernels.rotary._rotate: x * cos + (sign * partner) * sin, sign -1 on the first half
    is_v = (head >= HQ + HK)[None, :]
    out_lo = tl.where(is_v, a, a * c_lo + (-b) * s_lo)
    out_hi = tl.where(is_v, b, b * c_hi + a * s_hi)

    ok = (offs_m < M)[:, None] & pair_ok[None, :]
    is_q = (head < HQ)[None, :]
    q_ptrs = q_out_ptr + ((seq[:, None] * HQ + head[None, :]) * n + tok[:, None]) * D + col[None, :]
    tl.store(q_ptrs, out_lo.to(q_out_ptr.dtype.element_ty), mask=ok & is_q)
    tl.store(q_ptrs + HALF, out_hi.to(q_out_ptr.dtype.element_ty), mask=ok & is_q)

    pos = tl.load(start_ptr).to(tl.int64) + tok
    in_cache = ok & (pos < L)[:, None]
    is_k = ~is_q & ~is_v
    k_ptrs = (keys_ptr + (seq * stride_keys_b + pos * stride_keys_s)[:, None]
              + (head - HQ).to(tl.int64)[None, :] * stride_keys_h + col[None, :])
    tl.store(k_ptrs, out_lo.to(keys_ptr.dtype.element_ty), mask=in_cache & is_k)
    tl.store(k_ptrs + HALF, out_hi.to(keys_ptr.dtype.element_ty), mask=in_cache & is_k)
    v_ptrs = (values_ptr + (seq * stride_values_b + pos * stride_values_s)[:, None]
              + (head - HQ - HK).to(tl.int64)[None, :] * stride_values_h + col[None, :])
    tl.store(v_ptrs, out_lo.to(values_ptr.dtype.element_ty), mask=in_cache & is_v)
    tl.store(v_ptrs + HALF, out_hi.to(values_ptr.dtype.element_ty), mask=in_cache & is_v)


# Under the interpreter: a few pairs a program, so that tiny test heads span several programs.
_INTERPRET_PAIRS = 4


def _cos_sin_rows(t: torch.Tensor, B: int, n: int, D: int) -> torch.Tensor | None:
    """cos or sin as a (B, n, D) view with unit stride along D, when it is shared by the heads
    ((B or 1, 1, n, D) or (B or 1, n, D)); None otherwise."""
    if t.dim() == 4:
        if t.shape[1] != 1:
            return None
        t = t[:, 0]
    if t.dim() != 3 or t.shape[-1] != D:
        return None
    try:
        t = t.expand(B, n, D)
    except RuntimeError:
        return None
    return t if t.stride(-1) == 1 else None


def qkv_rotary_cache_applies(x: torch.Tensor, norm: NormPrologue, weight: torch.Tensor, bias: torch.Tensor | None,
                             keys: torch.Tensor, values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             q_heads: int) -> bool:
    """Whether the fused kernel takes this: a decode-size x (B, n, K) the norm-GEMV takes at its fast
    row counts, weight (N, K) with unit stride along K, N = (q_heads + 2 * HK) * D for the cache's
    (B, HK, L, D), an even D, cache and cos/sin of x's dtype with unit stride along D, cos/sin shared
    by the heads. Otherwise the op runs the two kernels it fuses."""
    if x.dim() != 3 or keys.dim() != 4 or values.shape != keys.shape or keys.shape[0] != x.shape[0]:
        return False
    B, n, _ = x.shape
    HK, D = keys.shape[1], keys.shape[3]
    same = [t for t in (keys, values, cos, sin, bias) if t is not None]
    return (D % 2 == 0 and weight.dim() == 2 and weight.shape[0] == (q_heads + 2 * HK) * D
            and weight.stride(1) == 1
            and gemv.norm_gemv_applies(x, weight, norm, gemv.GEMV_FAST_M_MAX)
            and all(t.dtype == x.dtype and t.device == x.device for t in same)
            and (bias is None or (bias.shape == (weight.shape[0],) and bias.stride(0) == 1))
            and keys.stride(-1) == 1 and values.stride(-1) == 1
            and _cos_sin_rows(cos, B, n, D) is not None and _cos_sin_rows(sin, B, n, D) is not None)


def qkv_rotary_cache_fwd(x: torch.Tensor, norm: NormPrologue, weight: torch.Tensor, bias: torch.Tensor | None,
                         keys: torch.Tensor, values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         start: torch.Tensor, q_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_rot, s): see the module docstring; s = x + norm.residual (rounded to x's dtype) when there
    is a residual, else an empty (0,) tensor, as norm_gemv_fwd's second output."""
    if not qkv_rotary_cache_applies(x, norm, weight, bias, keys, values, cos, sin, q_heads):
        raise ValueError("qkv_rotary_cache_fwd: these inputs are not the fused kernel's (see "
                         "qkv_rotary_cache_applies); run norm_gemv_fwd and rotary_kv_cache_write_fwd")
    B, n, K = x.shape
    HK, L, D = keys.shape[1], keys.shape[2], keys.shape[3]
    x2, res2 = norm_rows(x, norm)
    M = x2.shape[0]
    q_out = torch.empty((B, q_heads, n, D), device=x.device, dtype=x.dtype)
    summed = torch.empty((M, K) if res2 is not None else (0,), device=x.device, dtype=x.dtype)
    summed_out = summed.view(B, n, K) if res2 is not None else summed
    if M == 0:
        return q_out, summed_out
    norm_args, norm_flags = launch_args(norm._replace(residual=res2), x2, summed)
    cos3, sin3 = _cos_sin_rows(cos, B, n, D), _cos_sin_rows(sin, B, n, D)
    # norm_gemv_fwd's K step and warps, so that every column's sum is the same as there
    N = weight.shape[0]
    conf, block_k, vec, num_warps = gemv.norm_gemv_step(M, N, K, x)
    block_p = _INTERPRET_PAIRS if INTERPRET else max(1, conf.block_n // 2)
    _qkv_rotary_cache_fwd_kernel[(triton.cdiv(N // 2, block_p),)](
        x2, x2.stride(0),
        weight, weight.stride(0),
        bias if bias is not None else weight,
        *norm_args,
        q_out,
        keys, keys.stride(0), keys.stride(1), keys.stride(2),
        values, values.stride(0), values.stride(1), values.stride(2),
        cos3, cos3.stride(0), cos3.stride(1), sin3, sin3.stride(0), sin3.stride(1),
        start.reshape(1),
        M, n, L, K,
        HQ=q_heads, HK=HK, D=D, HAS_BIAS=bias is not None,
        BLOCK_M=gemv.gemv_bucket(M), BLOCK_P=block_p, BLOCK_K=block_k, VEC=vec,
        **norm_flags, BF16_RNE_BY_HAND=INTERPRET and x.dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=1, **pdl(x2),
    )
    return q_out, summed_out


def split_heads(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int):
    """q, k, v (B, H, n, D) views of a (B, n, (HQ + 2 HK) * D) linear output: the unfused path's inputs."""
    B, n = qkv.shape[0], qkv.shape[1]
    heads = qkv.view(B, n, q_heads + 2 * kv_heads, head_dim).transpose(1, 2)
    return heads[:, :q_heads], heads[:, q_heads:q_heads + kv_heads], heads[:, q_heads + kv_heads:]

