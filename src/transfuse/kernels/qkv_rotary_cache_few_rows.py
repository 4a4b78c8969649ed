"""A batched decode step's merged Q/K/V projection with its rotary embedding and KV-cache write, in
one launch on tensor cores, for 3-32 rows of already normalised x:

    qkv = x @ weight.T + bias                       # x (B, n, K): B sequences of n new tokens
    q, k, v = qkv's [HQ | HK | HK] heads of D columns, as (B, H, n, D)
    q_rot = rotary(q)                               # returned, a new contiguous (B, HQ, n, D) tensor
    keys[:, :, start + i] = rotary(k)[:, :, i]      # positions start + i < L only
    values[:, :, start + i] = v[:, :, i]

The epilogue is kernels/qkv_rotary_cache.py's (the 1-2 row GEMV version, which also folds the norm
in): bias, one rounding to x's dtype (the linear's stored output), the rotate-half rotary in fp32
and one more rounding. The main loop is gemm_few_rows's swap-AB product (weight rows on the MMA's M
side, x's rows padded to 16 or 32 on its N side), with the weight rows of each program taken in
rotary pairs: BLOCK_P columns c of the output and their partners c + D/2, two accumulators, as the
gated linear streams its gate and up rows. Reference: the two launches it replaces,
transfuse.linear then kernels.kv_cache.rotary_kv_cache_write_fwd.

Why: from 3 rows the norm stays a launch of its own (folding it into a tensor-core main loop stalls
the weight's stream: bench/results/2026-11-28-nvidia-h200-norm-few-rows-session32.log), but the
rotary and cache write only need the linear's output tile, which this kernel holds in registers at
its end: one launch (3.1 us of kernel and a gap between kernels, Llama-1.1B at batch 8 on an H200)
saved per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transfuse.kernels._config import INTERPRET, pdl, wait_for_previous_kernel
from transfuse.kernels.gemm import _WIDEN_DOT_OPERANDS, _dot_precision
from transfuse.kernels.gemm_few_rows import FEW_ROWS_MAX, few_rows_applies
from transfuse.kernels.qkv_rotary_cache import _cos_sin_rows, _rotary_cache_epilogue

# (pairs a program, K step, stages, warps): 16 pairs are 32 weight rows, gemm_few_rows's plain tile
# (Llama-1.1B's q/k/v then has 80 programs, as there).
_CONFIG = (16, 256, 5, 4)
_INTERPRET_CONFIG = (4, 16, 1, 4)


@triton.jit(do_not_specialize=["M", "n", "L"])
def _qkv_rotary_cache_few_rows_kernel(
    x_ptr, stride_x_m,  # (M, K) rows, unit stride along K
    w_ptr, stride_w_n, stride_w_k,
    bias_ptr,
    q_out_ptr,  # (B, HQ, n, D) contiguous
    keys_ptr, stride_keys_b, stride_keys_h, stride_keys_s,  # unit stride along D
    values_ptr, stride_values_b, stride_values_h, stride_values_s,
    cos_ptr, stride_cos_b, stride_cos_s, sin_ptr, stride_sin_b, stride_sin_s,  # unit stride along D
    start_ptr,
    M, n, L, K,  # M = B * n rows of x, n new tokens a sequence, L cache positions
    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K is whole BLOCK_K steps: no K masks
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # 16 or 32: x's rows, padded (rows past M re-read row m % M, never stored)
    BLOCK_P: tl.constexpr,  # column pairs a program
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    HALF: tl.constexpr = D // 2
    PAIRS: tl.constexpr = (HQ + 2 * HK) * HALF
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    pairs = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    pair_ok = pairs < PAIRS
    pairs = pairs % PAIRS  # out-of-range pairs wrap back into range (never stored)
    head = pairs // HALF
    col = pairs % HALF
    lo = (head * D + col).to(tl.int64)  # the pair's first column of the linear's output
    rows = (offs_m % M).to(tl.int64)

    offs_k = tl.arange(0, BLOCK_K)
    # (BLOCK_P, BLOCK_K) tiles of the pairs' first and second weight rows: the dots' A operands
    w_lo_ptrs = w_ptr + lo[:, None] * stride_w_n + offs_k[None, :] * stride_w_k
    w_hi_ptrs = w_lo_ptrs + HALF * stride_w_n
    x_ptrs = x_ptr + rows[None, :] * stride_x_m + offs_k[:, None]  # (BLOCK_K, BLOCK_M) of x.T: B
    wait_for_previous_kernel(PDL)
    acc_lo = tl.zeros((BLOCK_P, BLOCK_M), dtype=tl.float32)
    acc_hi = acc_lo
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs)
            w_lo = tl.load(w_lo_ptrs)
            w_hi = tl.load(w_hi_ptrs)
        else:
            k_mask = k + offs_k < K
            xt = tl.load(x_ptrs, mask=k_mask[:, None], other=0.0)
            w_lo = tl.load(w_lo_ptrs, mask=k_mask[None, :], other=0.0)
            w_hi = tl.load(w_hi_ptrs, mask=k_mask[None, :], other=0.0)
        if _WIDEN_DOT_OPERANDS:
            xt = xt.to(tl.float32)
            w_lo = w_lo.to(tl.float32)
            w_hi = w_hi.to(tl.float32)
        acc_lo = tl.dot(w_lo, xt, acc_lo, input_precision=DOT_PRECISION)
        acc_hi = tl.dot(w_hi, xt, acc_hi, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_lo_ptrs += BLOCK_K * stride_w_k
        w_hi_ptrs += BLOCK_K * stride_w_k

    _rotary_cache_epilogue(tl.trans(acc_lo), tl.trans(acc_hi), rows, (offs_m < M)[:, None] & pair_ok[None, :],
                           head, col, lo, n, L,
                           bias_ptr, q_out_ptr, keys_ptr, stride_keys_b, stride_keys_h, stride_keys_s,
                           values_ptr, stride_values_b, stride_values_h, stride_values_s,
                           cos_ptr, stride_cos_b, stride_cos_s, sin_ptr, stride_sin_b, stride_sin_s, start_ptr,
                           HQ, HK, D, HAS_BIAS)


def qkv_rotary_cache_few_rows_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                      keys: torch.Tensor, values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                      q_heads: int) -> bool:
    """Whether the kernel takes this: x (B, n, K) of gemm_few_rows's 1-32 rows of fp16 or bf16,
    weight (N, K) with N = (q_heads + 2 * HK) * D for the cache's (B, HK, L, D), an even D, the cache,
    bias and cos/sin of x's dtype and device, unit stride along D, cos/sin shared by the heads."""
    if x.dim() != 3 or keys.dim() != 4 or values.shape != keys.shape or keys.shape[0] != x.shape[0]:
        return False
    B, n, _ = x.shape
    HK, D = keys.shape[1], keys.shape[3]
    same = [t for t in (keys, values, cos, sin, bias) if t is not None]
    return (D % 2 == 0 and weight.dim() == 2 and weight.shape[0] == (q_heads + 2 * HK) * D
            and few_rows_applies(x, weight)
            and all(t.dtype == x.dtype and t.device == x.device for t in same)
            and (bias is None or (bias.shape == (weight.shape[0],) and bias.stride(0) == 1))
            and keys.stride(-1) == 1 and values.stride(-1) == 1
            and _cos_sin_rows(cos, B, n, D) is not None and _cos_sin_rows(sin, B, n, D) is not None)


def qkv_rotary_cache_few_rows_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                  keys: torch.Tensor, values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                  start: torch.Tensor, q_heads: int) -> torch.Tensor:
    """q_rot, with rotary(k) and v written into keys/values at start (see the module docstring); x is
    the normalised (B, n, K) input of the projection."""
    if not qkv_rotary_cache_few_rows_applies(x, weight, bias, keys, values, cos, sin, q_heads):
        raise ValueError("qkv_rotary_cache_few_rows_fwd: these inputs are not the kernel's (see "
                         "qkv_rotary_cache_few_rows_applies); run transfuse.linear and rotary_kv_cache_write_fwd")
    B, n, K = x.shape
    HK, L, D = keys.shape[1], keys.shape[2], keys.shape[3]
    x2 = x.reshape(B * n, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    q_out = torch.empty((B, q_heads, n, D), device=x.device, dtype=x.dtype)
    cos3, sin3 = _cos_sin_rows(cos, B, n, D), _cos_sin_rows(sin, B, n, D)
    block_p, block_k, num_stages, num_warps = _INTERPRET_CONFIG if INTERPRET else _CONFIG
    _qkv_rotary_cache_few_rows_kernel[(triton.cdiv(weight.shape[0] // 2, block_p),)](
        x2, x2.stride(0),
        weight, weight.stride(0), weight.stride(1),
        bias if bias is not None else weight,
        q_out,
        keys, keys.stride(0), keys.stride(1), keys.stride(2),
        values, values.stride(0), values.stride(1), values.stride(2),
        cos3, cos3.stride(0), cos3.stride(1), sin3, sin3.stride(0), sin3.stride(1),
        start.reshape(1),
        M, n, L, K,
        HQ=q_heads, HK=HK, D=D, HAS_BIAS=bias is not None,
        EVEN_K=K % block_k == 0, DOT_PRECISION=_dot_precision(x.dtype),
        BLOCK_M=16 if M <= 16 else FEW_ROWS_MAX, BLOCK_P=block_p, BLOCK_K=block_k,
        num_stages=num_stages, num_warps=num_warps, **pdl(x2),
    )
    return q_out
