"""Hugging Face's rotary cos/sin tables in one kernel:

    angle[b, s, j] = inv_freq[j] * float(positions[b, s])                    (fp32, one rounding)
    cos[b, s, j] = cos[b, s, j + D/2] = cos(angle[b, s, j]) * scaling         (rounded once to dtype)
    sin[b, s, j] = sin[b, s, j + D/2] = sin(angle[b, s, j]) * scaling

inv_freq: (D/2,) any float dtype, widened to fp32 (HF's `.float()`); positions: (B, S) integer or float,
converted to fp32 (HF's `position_ids.float()`: one rounding, above 2^24). Outputs cos, sin: (B, S, D)
contiguous in `dtype`. What eager runs as a K=1 batched matmul (whose single product is exactly this
fp32 product), a concatenation, cos, sin, two multiplies and two casts: seven launches, here one.

The multiply by `scaling` is skipped when it is 1.0 (x * 1.0 == x, bit for bit). cos and sin are
libdevice's (__nv_cosf / __nv_sinf, CUDA's cosf / sinf, with full range reduction): the
argument reaches 10^5 radians (position 100k times inv_freq[0] = 1), far outside the small range in
which the approximate instructions (sin.approx / cos.approx) bound their error.
Reference: transfuse.reference.rotary_table.rotary_table_ref (Hugging Face's own formula).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from transfuse.kernels._config import INTERPRET, next_power_of_2, pdl, wait_for_previous_kernel
from transfuse.kernels.norm import _round_to

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ELEMENTS_PER_PROGRAM = 2048  # angles per program: a 4096-token prompt at D/2 = 64 fills 128 programs
_MAX_ROWS = 64

if INTERPRET:
    @triton.jit
    def _cos_sin(angle):
        # No libdevice under the interpreter (its calls return None there): numpy's float32 cos/sin,
        # which reduce the argument fully too.
        return tl.cos(angle), tl.sin(angle)
else:
    @triton.jit
    def _cos_sin(angle):
        # tl.cos / tl.sin may lower to cos.approx.f32 / sin.approx.f32, whose error grows with |angle|.
        return libdevice.cos(angle), libdevice.sin(angle)


@triton.jit(do_not_specialize=["n_rows", "S"])
def _rotary_table_fwd_kernel(
    inv_freq_ptr, stride_inv_freq,
    positions_ptr, stride_positions_batch, stride_positions_seq,
    cos_ptr, sin_ptr,
    n_rows, S, scaling,
    HALF: tl.constexpr, HAS_SCALING: tl.constexpr, BF16_RNE_BY_HAND: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (_config.pdl)
):
    """Rows [pid * BLOCK_R, (pid + 1) * BLOCK_R) of the tables viewed as (B * S, D)."""
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    b = rows64 // S
    s = rows64 % S
    position = tl.load(positions_ptr + b * stride_positions_batch + s * stride_positions_seq,
                       mask=row_ok, other=0).to(tl.float32)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < HALF
    inv_freq = tl.load(inv_freq_ptr + cols * stride_inv_freq, mask=col_ok, other=0.0).to(tl.float32)

    # The K=1 matmul's only product, rounded once: no accumulation, so nothing for an FMA to fuse.
    angle = position[:, None] * inv_freq[None, :]
    cos, sin = _cos_sin(angle)
    if HAS_SCALING:
        # scaling arrives as fp32: eager too multiplies by the Python float cast to fp32, its opmath type.
        cos = cos * scaling
        sin = sin * scaling

    ok = row_ok[:, None] & col_ok[None, :]
    out = rows64[:, None] * (2 * HALF) + cols[None, :]
    cos = _round_to(cos, cos_ptr.dtype.element_ty, BF16_RNE_BY_HAND)
    sin = _round_to(sin, sin_ptr.dtype.element_ty, BF16_RNE_BY_HAND)
    tl.store(cos_ptr + out, cos, mask=ok)
    tl.store(cos_ptr + out + HALF, cos, mask=ok)
    tl.store(sin_ptr + out, sin, mask=ok)
    tl.store(sin_ptr + out + HALF, sin, mask=ok)


def check_rotary_table_args(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> None:
    if inv_freq.dim() != 1 or not inv_freq.dtype.is_floating_point:
        raise ValueError(f"rotary_table expects a 1-D float inv_freq, got {tuple(inv_freq.shape)} {inv_freq.dtype}")
    if positions.dim() != 2 or positions.dtype == torch.bool or positions.is_complex():
        raise ValueError(f"rotary_table expects integer or float positions of shape (batch, seq), got "
                         f"{tuple(positions.shape)} {positions.dtype}")
    if dtype not in _DTYPES:
        raise TypeError(f"rotary_table writes {_DTYPES}, not {dtype}")
    if inv_freq.device != positions.device:
        raise ValueError(f"rotary_table: inv_freq is on {inv_freq.device}, positions on {positions.device}")


def _blocks(half: int, n_rows: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_R, num_warps): a decode step's few rows get a block their size, not 64."""
    block_h = max(16, next_power_of_2(half))
    block_r = max(1, min(_MAX_ROWS, _ELEMENTS_PER_PROGRAM // block_h, next_power_of_2(n_rows)))
    return block_h, block_r, max(1, min(4, block_r * block_h // 256))


def rotary_table_fwd(inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float, dtype: torch.dtype):
    """inv_freq: (D/2,); positions: (B, S). Returns (cos, sin), each (B, S, D) contiguous in dtype."""
    check_rotary_table_args(inv_freq, positions, dtype)
    half = inv_freq.shape[0]
    B, S = positions.shape
    cos = torch.empty((B, S, 2 * half), dtype=dtype, device=positions.device)
    sin = torch.empty((B, S, 2 * half), dtype=dtype, device=positions.device)
    n_rows = B * S
    if n_rows == 0 or half == 0:
        return cos, sin
    block_h, block_r, num_warps = _blocks(half, n_rows)
    grid = (triton.cdiv(n_rows, block_r),)
    _rotary_table_fwd_kernel[grid](
        inv_freq, inv_freq.stride(0), positions, positions.stride(0), positions.stride(1), cos, sin,
        n_rows, S, float(scaling),
        HALF=half, HAS_SCALING=float(scaling) != 1.0, BF16_RNE_BY_HAND=INTERPRET and dtype == torch.bfloat16,
        BLOCK_R=block_r, BLOCK_H=block_h,
        num_warps=num_warps, **pdl(cos),
    )
    return cos, sin
