"""A static KV cache's write of new keys and values, both in one launch:

    keys[:, :, start + i]   = k[:, :, i]      for i < n
    values[:, :, start + i] = v[:, :, i]

keys, values: (B, H, L, D) the cache layers (any strides, unit stride along D); k, v: (B, H, n, D)
the new entries (any strides); start: a 0-d integer tensor on the device, the number of positions
already written (Hugging Face's StaticLayer.cumulative_length), read by the kernel so that one CUDA
graph serves every step. Eager writes these with an arange, an add and two index_copy_ (four
launches per layer per decode step). Positions at or past L are not written (index_copy_ would
fail on them; callers size the cache for the whole generation).
Reference: transfuse.reference.kv_cache.kv_cache_write_ref.

Fused with the rotary embedding of the same attention (Llama-style decode): q and k rotated as
transfuse.kernels.rotary does it (fp32, one rounding), q into a new tensor and k straight into the
cache, and v written, in one launch instead of two (the rotated k never makes a round trip through
memory). Reference: transfuse.reference.kv_cache.rotary_kv_cache_write_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transfuse.kernels._config import next_power_of_2, pdl, wait_for_previous_kernel
from transfuse.kernels.rotary import _blocks, _broadcast_strides, _rotate, _rotate_rows, check_rotary_pair_args

_ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def _cache_rows(start, block, n_rows, H, n, L, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows [block * BLOCK_R, +BLOCK_R) of the new entries seen as (B * H * n, D): their batch, head,
    index i among the new entries and cache position start + i (int64), the columns, and the mask
    (rows that exist, positions inside the cache, columns < D)."""
    rows = (block * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    i = rows % n
    bh = rows // n
    pos = start + i
    cols = tl.arange(0, BLOCK_D)
    ok = ((rows < n_rows) & (pos < L))[:, None] & (cols < D)[None, :]
    return bh // H, bh % H, i, pos, cols, ok


@triton.jit
def _write_rows(cache_ptr, new_ptr, start, block, n_rows, H, n, L,
                stride_cb, stride_ch, stride_cs, stride_nb, stride_nh, stride_ns,
                D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    b, h, i, pos, cols, ok = _cache_rows(start, block, n_rows, H, n, L, D, BLOCK_D, BLOCK_R)
    src = tl.load(new_ptr + (b * stride_nb + h * stride_nh + i * stride_ns)[:, None] + cols[None, :], mask=ok)
    tl.store(cache_ptr + (b * stride_cb + h * stride_ch + pos * stride_cs)[:, None] + cols[None, :],
             src.to(cache_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["k_blocks", "n_rows", "H", "n", "L"])
def _kv_cache_write_kernel(
    keys_ptr, values_ptr, k_ptr, v_ptr, start_ptr,
    k_blocks, n_rows, H, n, L,
    stride_keys_b, stride_keys_h, stride_keys_s, stride_values_b, stride_values_h, stride_values_s,
    stride_k_b, stride_k_h, stride_k_s, stride_v_b, stride_v_h, stride_v_s,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (_config.pdl)
):
    """The first k_blocks programs write keys (head dim D), the rest values (head dim DV)."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    start = tl.load(start_ptr).to(tl.int64)
    if pid < k_blocks:
        _write_rows(keys_ptr, k_ptr, start, pid, n_rows, H, n, L,
                    stride_keys_b, stride_keys_h, stride_keys_s, stride_k_b, stride_k_h, stride_k_s, D, BLOCK_D, BLOCK_R)
    else:
        _write_rows(values_ptr, v_ptr, start, pid - k_blocks, n_rows, H, n, L,
                    stride_values_b, stride_values_h, stride_values_s, stride_v_b, stride_v_h, stride_v_s,
                    DV, BLOCK_DV, BLOCK_R)


@triton.jit
def _rotate_rows_into_cache(cache_ptr, k_ptr, cos_ptr, sin_ptr, start, block, n_rows, H, n, L,
                            stride_cb, stride_ch, stride_cs, stride_kb, stride_kh, stride_ks,
                            stride_cosb, stride_cosh, stride_coss, stride_sinb, stride_sinh, stride_sins,
                            D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    """_write_rows of rotary(k): k's rows rotated by the rotary kernel's own helper (same fp32 math),
    rounded once to the cache's dtype (k's, checked), stored at start + i."""
    b, h, i, pos, cols, ok = _cache_rows(start, block, n_rows, H, n, L, D, BLOCK_D, BLOCK_R)
    out = _rotate(k_ptr, cos_ptr, sin_ptr, b, h, i, ok, stride_kb, stride_kh, stride_ks,
                  stride_cosb, stride_cosh, stride_coss, stride_sinb, stride_sinh, stride_sins, HALF, BLOCK_D)
    tl.store(cache_ptr + (b * stride_cb + h * stride_ch + pos * stride_cs)[:, None] + cols[None, :],
             out.to(cache_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["q_blocks", "k_blocks", "q_rows", "k_rows", "HQ", "HK", "n", "L"])
def _rotary_kv_cache_write_kernel(
    keys_ptr, values_ptr, q_ptr, k_ptr, v_ptr, q_out_ptr, start_ptr,
    cos_q_ptr, sin_q_ptr, cos_k_ptr, sin_k_ptr,
    q_blocks, k_blocks, q_rows, k_rows, HQ, HK, n, L,
    stride_keys_b, stride_keys_h, stride_keys_s, stride_values_b, stride_values_h, stride_values_s,
    stride_q_b, stride_q_h, stride_q_s, stride_k_b, stride_k_h, stride_k_s, stride_v_b, stride_v_h, stride_v_s,
    stride_cos_q_b, stride_cos_q_h, stride_cos_q_s, stride_sin_q_b, stride_sin_q_h, stride_sin_q_s,
    stride_cos_k_b, stride_cos_k_h, stride_cos_k_s, stride_sin_k_b, stride_sin_k_h, stride_sin_k_s,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (_config.pdl)
):
    """Programs [0, q_blocks) rotate q, the next k_blocks rotate k into keys, the last k_blocks write
    v into values."""
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    if pid < q_blocks:
        _rotate_rows(q_ptr, cos_q_ptr, sin_q_ptr, q_out_ptr, pid, q_rows, HQ, n,
                     stride_q_b, stride_q_h, stride_q_s, stride_cos_q_b, stride_cos_q_h, stride_cos_q_s,
                     stride_sin_q_b, stride_sin_q_h, stride_sin_q_s, D, HALF, BLOCK_D, BLOCK_R)
    elif pid < q_blocks + k_blocks:
        start = tl.load(start_ptr).to(tl.int64)
        _rotate_rows_into_cache(keys_ptr, k_ptr, cos_k_ptr, sin_k_ptr, start, pid - q_blocks, k_rows, HK, n, L,
                                stride_keys_b, stride_keys_h, stride_keys_s, stride_k_b, stride_k_h, stride_k_s,
                                stride_cos_k_b, stride_cos_k_h, stride_cos_k_s, stride_sin_k_b, stride_sin_k_h,
                                stride_sin_k_s, D, HALF, BLOCK_D, BLOCK_R)
    else:
        start = tl.load(start_ptr).to(tl.int64)
        _write_rows(values_ptr, v_ptr, start, pid - q_blocks - k_blocks, k_rows, HK, n, L,
                    stride_values_b, stride_values_h, stride_values_s, stride_v_b, stride_v_h, stride_v_s,
                    D, BLOCK_D, BLOCK_R)


def check_kv_cache_write_args(keys, values, k, v, start) -> None:
    for name, t in (("keys", keys), ("values", values), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"kv_cache_write: {name} must be (batch, heads, seq, head_dim), got {tuple(t.shape)}")
    # values may have a head dim of their own (DeepSeek's latent attention: keys 192, values 128)
    if keys.shape[:3] != values.shape[:3] or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"kv_cache_write: keys {tuple(keys.shape)} / values {tuple(values.shape)} and k {tuple(k.shape)} "
                         f"/ v {tuple(v.shape)} must match pairwise but for the head dim")
    if k.shape[:2] != keys.shape[:2] or k.shape[3] != keys.shape[3] or v.shape[3] != values.shape[3]:
        raise ValueError(f"kv_cache_write: k {tuple(k.shape)} / v {tuple(v.shape)} do not fit the cache "
                         f"{tuple(keys.shape)} / {tuple(values.shape)}")
    if start.numel() != 1 or start.dtype.is_floating_point or start.device != keys.device:
        raise ValueError(f"kv_cache_write: start must be one integer on {keys.device}, got {start.dtype} {tuple(start.shape)}")


def kv_cache_write_fwd(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       start: torch.Tensor) -> None:
    check_kv_cache_write_args(keys, values, k, v, start)
    B, H, n, D = k.shape
    n_rows = B * H * n
    if n_rows == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("kv_cache_write: the cache needs a unit stride along head_dim")
    DV = v.shape[3]
    block_d, block_dv = max(16, next_power_of_2(D)), max(16, next_power_of_2(DV))
    block_r = max(1, min(64, _ELEMENTS_PER_PROGRAM // max(block_d, block_dv)))
    k_blocks = triton.cdiv(n_rows, block_r)
    _kv_cache_write_kernel[(2 * k_blocks,)](
        keys, values, k, v, start.reshape(1),
        k_blocks, n_rows, H, n, keys.shape[2],
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        D=D, BLOCK_D=block_d, DV=DV, BLOCK_DV=block_dv, BLOCK_R=block_r, num_warps=4, **pdl(keys),
    )


def check_rotary_kv_cache_write_args(keys, values, q, k, v, cos, sin, start) -> None:
    check_rotary_pair_args(q, k, cos, sin)
    check_kv_cache_write_args(keys, values, k, v, start)
    if v.shape[3] != k.shape[3]:
        raise ValueError(f"rotary_kv_cache_write: one head dim for keys and values, got {k.shape[3]} and {v.shape[3]}")
    if keys.dtype != k.dtype:  # one rounding, to k's dtype, as rotary_pair + kv_cache_write round
        raise ValueError(f"rotary_kv_cache_write: keys are {keys.dtype}, k is {k.dtype}; they must match")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("rotary_kv_cache_write: the cache needs a unit stride along head_dim")


def rotary_kv_cache_write_fwd(keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """rotary_pair_fwd(q, k, cos, sin) then kv_cache_write_fwd(keys, values, k_rot, v, start), in one
    launch; returns q_rot (a new contiguous tensor)."""
    check_rotary_kv_cache_write_args(keys, values, q, k, v, cos, sin, start)
    B, HQ, n, D = q.shape
    HK = k.shape[1]
    q_out = torch.empty((B, HQ, n, D), dtype=q.dtype, device=q.device)
    q_rows, k_rows = B * HQ * n, B * HK * n
    if q_rows == 0:
        return q_out
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    # cos/sin expanded to each of q's and k's shapes: stride 0 along broadcast dims, a copy only when
    # the last stride is not 1 (then q and k get their own copy, so they take separate pointers).
    (cos_q, cq), (sin_q, sq) = _broadcast_strides(cos, q.shape), _broadcast_strides(sin, q.shape)
    (cos_k, ck), (sin_k, sk) = _broadcast_strides(cos, k.shape), _broadcast_strides(sin, k.shape)
    block_d, block_r = _blocks(D)  # rotary's blocks: q_rot's rows come out as rotary_pair's
    q_blocks, k_blocks = triton.cdiv(q_rows, block_r), triton.cdiv(k_rows, block_r)
    _rotary_kv_cache_write_kernel[(q_blocks + 2 * k_blocks,)](
        keys, values, q, k, v, q_out, start.reshape(1), cos_q, sin_q, cos_k, sin_k,
        q_blocks, k_blocks, q_rows, k_rows, HQ, HK, n, keys.shape[2],
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        *cq, *sq, *ck, *sk,
        D=D, HALF=D // 2, BLOCK_D=block_d, BLOCK_R=block_r, num_warps=4, **pdl(keys),
    )
    return q_out
