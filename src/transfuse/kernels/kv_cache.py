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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transfuse.kernels._config import next_power_of_2

_ELEMENTS_PER_PROGRAM = 4096


@triton.jit
def _write_rows(cache_ptr, new_ptr, start, block, n_rows, H, n, L,
                stride_cb, stride_ch, stride_cs, stride_nb, stride_nh, stride_ns,
                D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = (block * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    i = rows % n
    bh = rows // n
    h = bh % H
    b = bh // H
    pos = start + i
    cols = tl.arange(0, BLOCK_D)
    ok = ((rows < n_rows) & (pos < L))[:, None] & (cols < D)[None, :]
    src = tl.load(new_ptr + (b * stride_nb + h * stride_nh + i * stride_ns)[:, None] + cols[None, :], mask=ok)
    tl.store(cache_ptr + (b * stride_cb + h * stride_ch + pos * stride_cs)[:, None] + cols[None, :],
             src.to(cache_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["k_blocks", "n_rows", "H", "n", "L"])
def _kv_cache_write_kernel(
    keys_ptr, values_ptr, k_ptr, v_ptr, start_ptr,
    k_blocks, n_rows, H, n, L,
    stride_keys_b, stride_keys_h, stride_keys_s, stride_values_b, stride_values_h, stride_values_s,
    stride_k_b, stride_k_h, stride_k_s, stride_v_b, stride_v_h, stride_v_s,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """The first k_blocks programs write keys, the rest values."""
    pid = tl.program_id(0)
    start = tl.load(start_ptr).to(tl.int64)
    if pid < k_blocks:
        _write_rows(keys_ptr, k_ptr, start, pid, n_rows, H, n, L,
                    stride_keys_b, stride_keys_h, stride_keys_s, stride_k_b, stride_k_h, stride_k_s, D, BLOCK_D, BLOCK_R)
    else:
        _write_rows(values_ptr, v_ptr, start, pid - k_blocks, n_rows, H, n, L,
                    stride_values_b, stride_values_h, stride_values_s, stride_v_b, stride_v_h, stride_v_s,
                    D, BLOCK_D, BLOCK_R)


def check_kv_cache_write_args(keys, values, k, v, start) -> None:
    for name, t in (("keys", keys), ("values", values), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"kv_cache_write: {name} must be (batch, heads, seq, head_dim), got {tuple(t.shape)}")
    if keys.shape != values.shape or k.shape != v.shape:
        raise ValueError(f"kv_cache_write: keys {tuple(keys.shape)} / values {tuple(values.shape)} and k {tuple(k.shape)} "
                         f"/ v {tuple(v.shape)} must match pairwise")
    if k.shape[:2] != keys.shape[:2] or k.shape[3] != keys.shape[3]:
        raise ValueError(f"kv_cache_write: k {tuple(k.shape)} does not fit the cache {tuple(keys.shape)}")
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
    block_d = max(16, next_power_of_2(D))
    block_r = max(1, min(64, _ELEMENTS_PER_PROGRAM // block_d))
    k_blocks = triton.cdiv(n_rows, block_r)
    _kv_cache_write_kernel[(2 * k_blocks,)](
        keys, values, k, v, start.reshape(1),
        k_blocks, n_rows, H, n, keys.shape[2],
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        D=D, BLOCK_D=block_d, BLOCK_R=block_r, num_warps=4,
    )
