"""Rotary position embedding, rotate-half form, in one pass over x:

    out = x * cos + rotate_half(x) * sin,    rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])

x: (B, H, S, D) with any strides (the Q or K slice of a merged QKV output, transposed); cos, sin
broadcastable to x (Hugging Face's (B, 1, S, D)), x's dtype or fp32 (under autocast Hugging Face's
tables stay fp32 while x is bf16). Arithmetic in fp32, one rounding at the end (eager rounds after
each of its three ops: the difference is at most an ulp or two, and the fused result is the closer
one to fp32). Output: a new contiguous tensor of x's shape, in x's dtype or out_dtype (eager's
promotion gives fp32 for fp32 tables, which the caller may narrow when only casts read it).
Reference: transfuse.reference.rotary.rotary_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transfuse.kernels._config import next_power_of_2, pdl, wait_for_previous_kernel

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def _rotate(
    x_ptr, cos_ptr, sin_ptr, b, h, s, ok,
    stride_xb, stride_xh, stride_xs,
    stride_cb, stride_ch, stride_cs,
    stride_sb, stride_sh, stride_ss,
    HALF: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """x * cos + rotate_half(x) * sin in fp32 for rows (b, h, s) (int64 vectors) of x, masked by ok
    (rows, BLOCK_D). Shared with the fused cache write (kernels/kv_cache.py), which stores elsewhere."""
    cols = tl.arange(0, BLOCK_D)
    first_half = cols < HALF
    partner = tl.where(first_half, cols + HALF, cols - HALF)
    sign = tl.where(first_half, -1.0, 1.0)

    x_row = (b * stride_xb + h * stride_xh + s * stride_xs)[:, None]
    x = tl.load(x_ptr + x_row + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    x_partner = tl.load(x_ptr + x_row + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + (b * stride_cb + h * stride_ch + s * stride_cs)[:, None] + cols[None, :],
                  mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + (b * stride_sb + h * stride_sh + s * stride_ss)[:, None] + cols[None, :],
                  mask=ok, other=0.0).to(tl.float32)
    return x * cos + sign[None, :] * x_partner * sin


@triton.jit
def _rotate_rows(
    x_ptr, cos_ptr, sin_ptr, out_ptr, block,
    n_rows, H, S,
    stride_xb, stride_xh, stride_xs,
    stride_cb, stride_ch, stride_cs,
    stride_sb, stride_sh, stride_ss,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Rows [block * BLOCK_R, (block + 1) * BLOCK_R) of x viewed as (B * H * S, D)."""
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    s = rows64 % S
    bh = rows64 // S
    h = bh % H
    b = bh // H
    cols = tl.arange(0, BLOCK_D)
    ok = row_ok[:, None] & (cols < D)[None, :]
    out = _rotate(x_ptr, cos_ptr, sin_ptr, b, h, s, ok, stride_xb, stride_xh, stride_xs,
                  stride_cb, stride_ch, stride_cs, stride_sb, stride_sh, stride_ss, HALF, BLOCK_D)
    tl.store(out_ptr + rows64[:, None] * D + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["n_rows", "H", "S"])
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    n_rows, H, S,
    stride_xb, stride_xh, stride_xs,
    stride_cb, stride_ch, stride_cs,
    stride_sb, stride_sh, stride_ss,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (_config.pdl)
):
    wait_for_previous_kernel(PDL)
    _rotate_rows(x_ptr, cos_ptr, sin_ptr, out_ptr, tl.program_id(0), n_rows, H, S,
                 stride_xb, stride_xh, stride_xs, stride_cb, stride_ch, stride_cs, stride_sb, stride_sh, stride_ss,
                 D, HALF, BLOCK_D, BLOCK_R)


@triton.jit(do_not_specialize=["q_blocks", "q_rows", "k_rows", "HQ", "HK", "S"])
def _rotary_pair_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    q_blocks, q_rows, k_rows, HQ, HK, S,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_cqb, stride_cqh, stride_cqs, stride_sqb, stride_sqh, stride_sqs,
    stride_ckb, stride_ckh, stride_cks, stride_skb, stride_skh, stride_sks,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (_config.pdl)
):
    """Q and K of one attention in one launch: the first q_blocks programs rotate Q, the rest K."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    if pid < q_blocks:
        _rotate_rows(q_ptr, cos_ptr, sin_ptr, q_out_ptr, pid, q_rows, HQ, S,
                     stride_qb, stride_qh, stride_qs, stride_cqb, stride_cqh, stride_cqs,
                     stride_sqb, stride_sqh, stride_sqs, D, HALF, BLOCK_D, BLOCK_R)
    else:
        _rotate_rows(k_ptr, cos_ptr, sin_ptr, k_out_ptr, pid - q_blocks, k_rows, HK, S,
                     stride_kb, stride_kh, stride_ks, stride_ckb, stride_ckh, stride_cks,
                     stride_skb, stride_skh, stride_sks, D, HALF, BLOCK_D, BLOCK_R)


def check_rotary_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"rotary expects x of shape (batch, heads, seq, head_dim), got {tuple(x.shape)}")
    if x.shape[-1] % 2:
        raise ValueError(f"rotary needs an even head dim, got {x.shape[-1]}")
    if x.dtype not in _DTYPES or cos.dtype not in (x.dtype, torch.float32) or sin.dtype != cos.dtype:
        raise TypeError(f"rotary supports x in {_DTYPES} with cos and sin both in x's dtype or float32; got "
                        f"{x.dtype}, {cos.dtype}, {sin.dtype}")
    for name, t in (("cos", cos), ("sin", sin)):
        try:
            fits = t.dim() <= 4 and torch.broadcast_shapes(t.shape, x.shape) == x.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"rotary: {name} of shape {tuple(t.shape)} does not broadcast to x's {tuple(x.shape)}")
        if t.device != x.device:
            raise ValueError(f"rotary: {name} is on {t.device}, x on {x.device}")


def _broadcast_strides(t: torch.Tensor, shape) -> tuple[torch.Tensor, tuple[int, int, int]]:
    t = t.expand(shape)
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, (t.stride(0), t.stride(1), t.stride(2))


def _blocks(D: int) -> tuple[int, int]:
    block_d = max(16, next_power_of_2(D))
    return block_d, max(1, min(64, _ELEMENTS_PER_PROGRAM // block_d))


def _out_dtype(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    if out_dtype is not None and out_dtype not in _DTYPES:
        raise TypeError(f"rotary: out_dtype must be one of {_DTYPES}, got {out_dtype}")
    return x.dtype if out_dtype is None else out_dtype


def rotary_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    check_rotary_args(x, cos, sin)
    B, H, S, D = x.shape
    out = torch.empty((B, H, S, D), dtype=_out_dtype(x, out_dtype), device=x.device)
    n_rows = B * H * S
    if n_rows == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, cos_strides = _broadcast_strides(cos, x.shape)
    sin, sin_strides = _broadcast_strides(sin, x.shape)
    block_d, block_r = _blocks(D)
    grid = (triton.cdiv(n_rows, block_r),)
    _rotary_kernel[grid](
        x, cos, sin, out, n_rows, H, S,
        x.stride(0), x.stride(1), x.stride(2), *cos_strides, *sin_strides,
        D=D, HALF=D // 2, BLOCK_D=block_d, BLOCK_R=block_r, num_warps=4, **pdl(x),
    )
    return out


def check_rotary_pair_args(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    check_rotary_args(q, cos, sin)
    check_rotary_args(k, cos, sin)
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3] or q.dtype != k.dtype:
        raise ValueError(f"rotary_pair: q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} must share "
                         "batch, seq, head dim and dtype (heads may differ)")


def rotary_pair_fwd(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    out_dtype: torch.dtype | None = None):
    """rotary_fwd(q, cos, sin), rotary_fwd(k, cos, sin) in one launch (decode runs many tiny ones)."""
    check_rotary_pair_args(q, k, cos, sin)
    B, HQ, S, D = q.shape
    HK = k.shape[1]
    dtype = _out_dtype(q, out_dtype)
    q_out = torch.empty((B, HQ, S, D), dtype=dtype, device=q.device)
    k_out = torch.empty((B, HK, S, D), dtype=dtype, device=k.device)
    q_rows, k_rows = B * HQ * S, B * HK * S
    if q_rows == 0:
        return q_out, k_out
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    cos_q, cq = _broadcast_strides(cos, q.shape)
    sin_q, sq = _broadcast_strides(sin, q.shape)
    cos_k, ck = _broadcast_strides(cos, k.shape)
    sin_k, sk = _broadcast_strides(sin, k.shape)
    if cos_q.data_ptr() != cos_k.data_ptr() or sin_q.data_ptr() != sin_k.data_ptr():
        # A broadcast needed a copy (cos with a non-unit last stride): two launches, same result.
        return rotary_fwd(q, cos, sin, out_dtype), rotary_fwd(k, cos, sin, out_dtype)
    block_d, block_r = _blocks(D)
    q_blocks = triton.cdiv(q_rows, block_r)
    grid = (q_blocks + triton.cdiv(k_rows, block_r),)
    _rotary_pair_kernel[grid](
        q, k, cos_q, sin_q, q_out, k_out, q_blocks, q_rows, k_rows, HQ, HK, S,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        *cq, *sq, *ck, *sk,
        D=D, HALF=D // 2, BLOCK_D=block_d, BLOCK_R=block_r, num_warps=4, **pdl(q),
    )
    return q_out, k_out
