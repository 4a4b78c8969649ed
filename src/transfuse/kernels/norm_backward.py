"""Backward of the normalisations in transfuse.kernels.norm: LayerNorm and RMSNorm over the last
dimension, each optionally fused with the residual add before it, in every variant the forward has.

x: (..., N); every leading dim is a row. dy: (..., N), the gradient of the output, in x's dtype.
The statistics are recomputed from the row, which the backward reads anyway for xhat, rather than
saved by the forward: no extra traffic, and the forward ops keep their signatures.

With xhat the normalised row, r = rstd and g = dy * (weight + weight_offset) (g = dy without a
weight), both in fp32:

    LayerNorm:  xhat = (s - mean) * r,   ds = r * (g - mean(g) - xhat * mean(g * xhat))
                dweight = sum_rows(dy * xhat),   dbias = sum_rows(dy)
    RMSNorm:    h = s * r,               ds = r * (g - h * mean(g * h))
                dweight = sum_rows(dy * h')

(the eps inside r changes nothing in the derivation: d r / d s_j = -r^3 (s_j - mean) / N either
way). Rounding the output to x's dtype is straight-through for the gradient, as in eager autograd.
With CAST_BEFORE_WEIGHT, Llama's `weight * h.to(x.dtype)` has its rounding points in the backward
too, where eager autograd has them: the weight multiplies the rounded row, so h' = h.to(x.dtype)
(h' = h otherwise), and the gradient reaching h through the rounding, g, is rounded to x's dtype.

With a residual, s = x + residual rounded to x's dtype exactly as the forward rounds it, so the
statistics are the forward's; dx = dresidual = ds + dsum, where dsum is the gradient of the sum
output when the forward returned it (pre-norm models feed it to the next block). ds + dsum is
added in fp32 and rounded once.

dx is written in one pass per row. dweight and dbias are sums over all rows: each program walks a
contiguous group of rows in tiles of BLOCK_M, accumulates fp32 partial sums in registers and
writes one partial row to an (n_programs, N) fp32 buffer (about 3 MB at N = 768 on an H100,
against 12.6 MB for the rows of an 8 x 1024 x 768 bf16 batch). One second kernel sums the partial
rows of dweight and dbias together and rounds each sum once to its parameter's dtype. torch's
column sum took 8.7 us for each of the two (1056, 768) buffers in GPT-2 124M's training step
(0.44 ms of a 20 ms step over 25 norms; H200, bench/profile_train_ops.py, 2026-11-26); the one
launch takes 3.4 us.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from transfuse.kernels._config import INTERPRET, next_power_of_2, num_sms
from transfuse.kernels.norm import (
    _SUPPORTED_DTYPES,
    _check_runnable,
    _device_guard,
    _leading_layout,
    _round_to,
    check_layer_norm_args,
    check_rms_norm_args,
)


@dataclass(frozen=True)
class NormBwdConfig:
    BLOCK_N: int  # power of two >= N: one row is one register tile
    BLOCK_M: int  # rows handled together in one iteration; > 1 only for short rows
    num_warps: int
    n_programs: int  # programs in the grid, each one writing one partial row of dweight/dbias


# Programs per SM: enough for each SM to overlap one program's loads with another's reductions,
# few enough that the (n_programs, N) fp32 partial buffers stay a small fraction of the traffic.
# Measured in GPT-2 124M's training step (nanoGPT, batch 8 x 1024, bf16 autocast; H100, 2026-11-26,
# bench/results/2026-11-26-nvidia-h100-80gb-hbm3-train-norm-session17.log): the 8192 x 768 backward
# took 62.3 us at 2 programs an SM, 42.7 at 8, 43.5 at 16; the step's kernels 22.5 -> 22.3 ms.
_PROGRAMS_PER_SM = 8
# Under the interpreter programs run one after another in Python; a few of them still exercise the
# partial-sum reduction and the row groups of unequal length.
_INTERPRET_PROGRAMS = 4


def _max_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return _PROGRAMS_PER_SM * num_sms(device)
    return _INTERPRET_PROGRAMS


def norm_bwd_config(n_rows: int, n_cols: int, max_programs: int) -> NormBwdConfig:
    """Launch shape from the row length and row count. No autotuning, for the forward's reason (a
    first call may happen inside CUDA-graph capture).

    The backward holds about twice the forward's live tiles (the row, dy, g, xhat and the two
    accumulators), so a tile is kept to 2048 elements on 4 warps for short rows (16 fp32 per thread
    and tensor) and the warps follow N as in the forward for long ones."""
    block_n = max(next_power_of_2(n_cols), 16)
    if block_n >= 32768:
        num_warps = 32
    elif block_n >= 8192:
        num_warps = 16
    elif block_n >= 2048:
        num_warps = 8
    else:
        num_warps = 4
    block_m = max(1, min(2048 // block_n, 16, next_power_of_2(max(n_rows, 1))))
    n_programs = max(1, min(triton.cdiv(max(n_rows, 1), block_m), max_programs))
    return NormBwdConfig(BLOCK_N=block_n, BLOCK_M=block_m, num_warps=num_warps, n_programs=n_programs)


@triton.jit
def _load_rows(x_ptr, stride_x_d0, stride_x_d1, residual_ptr, stride_residual_d0, stride_residual_d1,
               rows_d0, rows_d1, cols, mask,
               HAS_RESIDUAL: tl.constexpr, BF16_RNE_BY_HAND: tl.constexpr):
    """The row the forward normalised, in fp32: x, or x + residual rounded to x's dtype as the
    forward rounds it (bit for bit, so the statistics are the forward's)."""
    # Widened right after the load: the interpreter computes bf16 arithmetic wrongly.
    x = tl.load(x_ptr + (rows_d0 * stride_x_d0 + rows_d1 * stride_x_d1)[:, None] + cols[None, :],
                mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual_ptrs = (residual_ptr + (rows_d0 * stride_residual_d0 + rows_d1 * stride_residual_d1)[:, None]
                         + cols[None, :])
        residual = tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)
        x = _round_to(x + residual, x_ptr.dtype.element_ty, BF16_RNE_BY_HAND).to(tl.float32)
    return x


@triton.jit(do_not_specialize=["n_rows", "size_d1", "rows_per_program"])  # change with every input shape
def _layer_norm_bwd_kernel(
    dy_ptr, stride_dy_d0, stride_dy_d1,
    x_ptr, stride_x_d0, stride_x_d1,
    residual_ptr, stride_residual_d0, stride_residual_d1,
    dsum_ptr, stride_dsum_d0, stride_dsum_d1,
    weight_ptr,
    dx_ptr, dx_cast_ptr, stride_dx_row,
    dweight_partial_ptr, dbias_partial_ptr, dx_sum_partial_ptr, stride_partial_row,
    n_rows, size_d1, n_cols, rows_per_program, eps,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_DSUM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    STORE_DX: tl.constexpr,
    STORE_DWEIGHT: tl.constexpr,
    STORE_DBIAS: tl.constexpr,
    STORE_DX_SUM: tl.constexpr,
    STORE_DX_CAST: tl.constexpr,
    BF16_RNE_BY_HAND: tl.constexpr,
):
    # Row r of the (n_rows, n_cols) view is t[r // size_d1, r % size_d1, :] of each input t seen as
    # (d0, d1, n_cols), as in the forward kernels; dx is written contiguous.
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dweight_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    dbias_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    dx_sum_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for tile_start in range(row_start, row_end, BLOCK_M):
        rows = tile_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        rows_d0 = (rows // size_d1).to(tl.int64)
        rows_d1 = (rows % size_d1).to(tl.int64)
        rows = rows.to(tl.int64)
        mask = row_mask[:, None] & col_mask[None, :]

        x = _load_rows(x_ptr, stride_x_d0, stride_x_d1, residual_ptr, stride_residual_d0, stride_residual_d1,
                       rows_d0, rows_d1, cols, mask, HAS_RESIDUAL, BF16_RNE_BY_HAND)
        # The forward's statistics, computed the same way (two passes over registers).
        mean = tl.sum(x, axis=1) / n_cols
        x_centered = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(x_centered * x_centered, axis=1) / n_cols
        rstd = tl.math.rsqrt(var + eps)
        xhat = x_centered * rstd[:, None]  # zero outside the mask

        dy = tl.load(dy_ptr + (rows_d0 * stride_dy_d0 + rows_d1 * stride_dy_d1)[:, None] + cols[None, :],
                     mask=mask, other=0.0).to(tl.float32)
        if STORE_DWEIGHT:
            dweight_acc += tl.sum(dy * xhat, axis=0)
        if STORE_DBIAS:
            dbias_acc += tl.sum(dy, axis=0)
        if STORE_DX:
            g = dy
            if HAS_WEIGHT:
                g = dy * weight[None, :]
            # masked columns hold g = 0 and xhat = 0, so the sums over BLOCK_N are sums over N
            mean_g = tl.sum(g, axis=1) / n_cols
            mean_g_xhat = tl.sum(g * xhat, axis=1) / n_cols
            dx = (g - mean_g[:, None] - xhat * mean_g_xhat[:, None]) * rstd[:, None]
            if HAS_DSUM:
                dsum_ptrs = (dsum_ptr + (rows_d0 * stride_dsum_d0 + rows_d1 * stride_dsum_d1)[:, None]
                             + cols[None, :])
                dx += tl.load(dsum_ptrs, mask=mask, other=0.0).to(tl.float32)
            dx = _round_to(dx, dx_ptr.dtype.element_ty, BF16_RNE_BY_HAND)
            tl.store(dx_ptr + rows[:, None] * stride_dx_row + cols[None, :], dx, mask=mask)
            if STORE_DX_CAST:
                # dx.to(dtype) as eager's autocast backward casts it for a narrower residual
                dx = _round_to(dx.to(tl.float32), dx_cast_ptr.dtype.element_ty, BF16_RNE_BY_HAND)
                tl.store(dx_cast_ptr + rows[:, None] * stride_dx_row + cols[None, :], dx, mask=mask)
            if STORE_DX_SUM:
                # The column sums of the dx tensor summed (the cast one if any) as stored, as torch's
                # sum reads it; masked elements hold -mean_g * rstd, not 0.
                dx_sum_acc += tl.sum(tl.where(mask, dx.to(tl.float32), 0.0), axis=0)
    if STORE_DWEIGHT:
        tl.store(dweight_partial_ptr + pid * stride_partial_row + cols, dweight_acc, mask=col_mask)
    if STORE_DBIAS:
        tl.store(dbias_partial_ptr + pid * stride_partial_row + cols, dbias_acc, mask=col_mask)
    if STORE_DX_SUM:
        tl.store(dx_sum_partial_ptr + pid * stride_partial_row + cols, dx_sum_acc, mask=col_mask)


@triton.jit(do_not_specialize=["n_rows", "size_d1", "rows_per_program"])  # change with every input shape
def _rms_norm_bwd_kernel(
    dy_ptr, stride_dy_d0, stride_dy_d1,
    x_ptr, stride_x_d0, stride_x_d1,
    residual_ptr, stride_residual_d0, stride_residual_d1,
    dsum_ptr, stride_dsum_d0, stride_dsum_d1,
    weight_ptr,
    dx_ptr, dx_cast_ptr, stride_dx_row,
    dweight_partial_ptr, stride_partial_row,
    n_rows, size_d1, n_cols, rows_per_program, eps, weight_offset,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_DSUM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    STORE_DX: tl.constexpr,
    STORE_DWEIGHT: tl.constexpr,
    STORE_DX_CAST: tl.constexpr,
    BF16_RNE_BY_HAND: tl.constexpr,
):
    # Row addressing as in _layer_norm_bwd_kernel.
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        # masked columns get weight_offset, but dy is 0 there, so g is too
        weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset
    dweight_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for tile_start in range(row_start, row_end, BLOCK_M):
        rows = tile_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        rows_d0 = (rows // size_d1).to(tl.int64)
        rows_d1 = (rows % size_d1).to(tl.int64)
        rows = rows.to(tl.int64)
        mask = row_mask[:, None] & col_mask[None, :]

        x = _load_rows(x_ptr, stride_x_d0, stride_x_d1, residual_ptr, stride_residual_d0, stride_residual_d1,
                       rows_d0, rows_d1, cols, mask, HAS_RESIDUAL, BF16_RNE_BY_HAND)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        h = x * rstd[:, None]  # zero outside the mask

        dy = tl.load(dy_ptr + (rows_d0 * stride_dy_d0 + rows_d1 * stride_dy_d1)[:, None] + cols[None, :],
                     mask=mask, other=0.0).to(tl.float32)
        if STORE_DWEIGHT:
            if CAST_BEFORE_WEIGHT:
                # Llama's weight multiplies h.to(x.dtype): its gradient sees the rounded row.
                dweight_acc += tl.sum(dy * _round_to(h, x_ptr.dtype.element_ty, BF16_RNE_BY_HAND).to(tl.float32),
                                      axis=0)
            else:
                dweight_acc += tl.sum(dy * h, axis=0)
        if STORE_DX:
            g = dy
            if HAS_WEIGHT:
                g = dy * weight[None, :]
                if CAST_BEFORE_WEIGHT:
                    # Llama's product is taken in x's dtype, so eager's gradient of the rounded
                    # row is rounded too; rounding here keeps dx eager's, bit for bit mostly.
                    g = _round_to(g, x_ptr.dtype.element_ty, BF16_RNE_BY_HAND).to(tl.float32)
            mean_g_h = tl.sum(g * h, axis=1) / n_cols
            dx = (g - h * mean_g_h[:, None]) * rstd[:, None]
            if HAS_DSUM:
                dsum_ptrs = (dsum_ptr + (rows_d0 * stride_dsum_d0 + rows_d1 * stride_dsum_d1)[:, None]
                             + cols[None, :])
                dx += tl.load(dsum_ptrs, mask=mask, other=0.0).to(tl.float32)
            dx = _round_to(dx, dx_ptr.dtype.element_ty, BF16_RNE_BY_HAND)
            tl.store(dx_ptr + rows[:, None] * stride_dx_row + cols[None, :], dx, mask=mask)
            if STORE_DX_CAST:
                dx = _round_to(dx.to(tl.float32), dx_cast_ptr.dtype.element_ty, BF16_RNE_BY_HAND)
                tl.store(dx_cast_ptr + rows[:, None] * stride_dx_row + cols[None, :], dx, mask=mask)
    if STORE_DWEIGHT:
        tl.store(dweight_partial_ptr + pid * stride_partial_row + cols, dweight_acc, mask=col_mask)


@triton.jit(do_not_specialize=["n_partials"])
def _sum_partials_kernel(
    partial_ptr, stride_partial_which, stride_partial_row,
    out0_ptr, out1_ptr, out2_ptr,
    n_partials, n_cols,
    BF16_RNE_BY_HAND: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out{which}[n] = sum over p of partial[which, p, n] in fp32, in p order, rounded once to the
    output's dtype. Grid (column blocks, 1 to 3): axis 1 picks the sum (dweight, dbias, dx's)."""
    which = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    base = partial_ptr + which.to(tl.int64) * stride_partial_which
    # A 2-D accumulator reduced once at the end: the loop's adds do not wait on each other.
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(base + rows[:, None] * stride_partial_row + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if which == 0:
        tl.store(out0_ptr + cols, _round_to(total, out0_ptr.dtype.element_ty, BF16_RNE_BY_HAND), mask=col_mask)
    elif which == 1:
        tl.store(out1_ptr + cols, _round_to(total, out1_ptr.dtype.element_ty, BF16_RNE_BY_HAND), mask=col_mask)
    else:
        tl.store(out2_ptr + cols, _round_to(total, out2_ptr.dtype.element_ty, BF16_RNE_BY_HAND), mask=col_mask)


# ---------------------------------------------------------------------------------------------
# Launchers: check, allocate, pick the grid, launch.


def _check_grad(grad: torch.Tensor | None, x: torch.Tensor, name: str, any_dtype: bool = False) -> None:
    """grad must have x's shape, device and dtype; with any_dtype, any float dtype of the kernels (dy
    of a forward that wrote another dtype than x's: it is widened to fp32 as it is loaded)."""
    if grad is None:
        return
    dtype_ok = grad.dtype in _SUPPORTED_DTYPES if any_dtype else grad.dtype == x.dtype
    if grad.shape != x.shape or not dtype_ok or grad.device != x.device:
        raise ValueError(
            f"transfuse norm backward: {name} must have the shape, dtype and device of x, got "
            f"{tuple(grad.shape)} {grad.dtype} {grad.device} for x {tuple(x.shape)} {x.dtype} {x.device}"
        )


def _row_views(tensors: list[torch.Tensor | None]):
    """The tensors (x's shape, None allowed) with a unit last-dim stride, the (d0, d1) row grid
    they share and each one's (stride_d0, stride_d1); (0, 0) for None. As the forward's row views,
    for any number of tensors: dy and dsum come from autograd in whatever layout (a transposed or
    sliced one is read in place; the expanded grad of `out.sum()`, stride 0 along the row too, is
    copied, as the kernels step through a row one element at a time)."""
    tensors = [t if t is None or t.stride(-1) == 1 else t.contiguous() for t in tensors]
    present = [t for t in tensors if t is not None]
    layout = _leading_layout(present)
    if layout is None:
        tensors = [None if t is None else t.contiguous() for t in tensors]
        present = [t for t in tensors if t is not None]
        layout = _leading_layout(present)
    size_d1, strides = layout
    strides = iter(strides)
    return tensors, size_d1, [(0, 0) if t is None else next(strides) for t in tensors]


def _norm_bwd(kind, dy, x, residual, dsum, weight, eps, weight_offset, cast_before_weight, compute_dx,
              compute_dweight, compute_dbias, config, dweight_dtype, dbias_dtype, compute_dx_sum=False,
              dx_cast=None, dx_sum_dtype=None):
    """Shared launcher body: returns (dx, dweight, dbias, dx_sum, dx_cast) with the sums in
    dweight_dtype, dbias_dtype and dx_sum in dx_sum_dtype (default: dx_cast's, x's without one), None
    for what was not asked; dx_cast: dx in the dtype `dx_cast` names, also written by the kernel."""
    dx_sum_dtype = dx_sum_dtype or dx_cast or x.dtype
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    compute_dweight = compute_dweight and weight is not None
    if compute_dx_sum and not (compute_dx and kind == "layer"):
        raise ValueError("transfuse norm backward: the column sum of dx needs compute_dx (layer norm only)")
    if dx_cast is not None and not compute_dx:
        raise ValueError("transfuse norm backward: dx_cast needs compute_dx")
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if compute_dx else None
    dx2 = torch.empty(x.shape, dtype=dx_cast, device=x.device) if dx_cast is not None else None
    if n_rows == 0 or n_cols == 0 or not (compute_dx or compute_dweight or compute_dbias):
        zeros = [torch.zeros(n_cols, dtype=dt, device=x.device) if asked else None
                 for asked, dt in ((compute_dweight, dweight_dtype), (compute_dbias, dbias_dtype),
                                   (compute_dx_sum, dx_sum_dtype))]
        return (dx, *zeros, dx2)
    _check_runnable(x)
    if n_rows >= 2**31:
        raise ValueError(f"transfuse norm backward: {n_rows} rows do not fit the int32 row index")
    (dy, x, residual, dsum), size_d1, strides = _row_views([dy, x, residual, dsum])
    weight = weight.contiguous() if weight is not None else None
    config = config or norm_bwd_config(n_rows, n_cols, _max_programs(x.device))
    # Whole tiles per program: only the last program's last tile is partial.
    rows_per_program = triton.cdiv(triton.cdiv(n_rows, config.n_programs), config.BLOCK_M) * config.BLOCK_M
    n_programs = triton.cdiv(n_rows, rows_per_program)
    # One buffer for every partial sum, so that one launch reduces them all.
    asked = [compute_dweight, compute_dbias, compute_dx_sum]
    n_sums = sum(asked)
    partials = torch.empty((n_sums, n_programs, n_cols), dtype=torch.float32, device=x.device) if n_sums else None
    slots = iter(range(n_sums))
    dweight_partial, dbias_partial, dx_sum_partial = (partials[next(slots)] if a else None for a in asked)
    # Unused pointers get x: a valid address the kernel never dereferences (constexpr-guarded).
    pointers_and_strides = []
    for t, (stride_d0, stride_d1) in zip((dy, x, residual, dsum), strides, strict=True):
        pointers_and_strides += [t if t is not None else x, stride_d0, stride_d1]
    common = {
        "BLOCK_N": config.BLOCK_N,
        "BLOCK_M": config.BLOCK_M,
        "HAS_RESIDUAL": residual is not None,
        "HAS_DSUM": dsum is not None,
        "HAS_WEIGHT": weight is not None,
        "STORE_DX": compute_dx,
        "STORE_DWEIGHT": compute_dweight,
        "BF16_RNE_BY_HAND": INTERPRET and torch.bfloat16 in (x.dtype, dx_cast),
        "num_warps": config.num_warps,
    }
    weight_arg = weight if weight is not None else x
    dx_arg = dx if dx is not None else x
    dx_cast_arg = dx2 if dx2 is not None else dx_arg
    dweight_arg = dweight_partial if dweight_partial is not None else x
    with _device_guard(x):
        if kind == "layer":
            _layer_norm_bwd_kernel[(n_programs,)](
                *pointers_and_strides,
                weight_arg,
                dx_arg, dx_cast_arg, n_cols,
                dweight_arg, dbias_partial if dbias_partial is not None else x,
                dx_sum_partial if dx_sum_partial is not None else x, n_cols,
                n_rows, size_d1, n_cols, rows_per_program, eps,
                STORE_DBIAS=compute_dbias, STORE_DX_SUM=compute_dx_sum, STORE_DX_CAST=dx2 is not None,
                **common,
            )
        else:
            _rms_norm_bwd_kernel[(n_programs,)](
                *pointers_and_strides,
                weight_arg,
                dx_arg, dx_cast_arg, n_cols,
                dweight_arg, n_cols,
                n_rows, size_d1, n_cols, rows_per_program, eps, weight_offset,
                CAST_BEFORE_WEIGHT=cast_before_weight, STORE_DX_CAST=dx2 is not None,
                **common,
            )
        dweight, dbias, dx_sum = (torch.empty(n_cols, dtype=dt, device=x.device) if a else None
                                  for a, dt in zip(asked, (dweight_dtype, dbias_dtype, dx_sum_dtype)))
        if n_sums:
            outs = [t for t in (dweight, dbias, dx_sum) if t is not None]
            # Narrow column blocks, many programs: 1056 x 768 partials (x2) in 3.4 us against 6.3 at
            # 32 x 32 and 14.5 for torch's two sums (H200, bench/kernels/bench_norm_partials.py).
            block_p, block_n, warps = (4, 16, 1) if INTERPRET else (32, 16, 8)
            _sum_partials_kernel[(triton.cdiv(n_cols, block_n), n_sums)](
                partials, partials.stride(0), partials.stride(1),
                outs[0], outs[min(1, n_sums - 1)], outs[-1],
                n_programs, n_cols,
                BF16_RNE_BY_HAND=INTERPRET and any(t.dtype == torch.bfloat16 for t in outs),
                BLOCK_P=block_p, BLOCK_N=block_n, num_warps=warps, num_stages=1,
            )
    return dx, dweight, dbias, dx_sum, dx2


def layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    dsum: torch.Tensor | None = None,
    compute_dx: bool = True,
    compute_dweight: bool = True,
    compute_dbias: bool = True,
    compute_dx_sum: bool = False,
    dx_cast: torch.dtype | None = None,
    dx_sum_dtype: torch.dtype | None = None,
    config: NormBwdConfig | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of layer_norm_fwd(x, weight, bias, eps), or with residual of
    add_layer_norm_fwd(x, residual, weight, bias, eps, ...), given dy: (..., N) the gradient of
    the output (in the output's dtype, which may differ from x's: out_dtype) and dsum that of the sum output (None when the sum was not returned or has no
    gradient), which is added to dx. Where the forward stored the sum s, pass x=s and no residual:
    s is the row the forward normalised, and one tensor is read instead of two.

    Returns (dx, dweight, dbias, dx_sum, dx_cast): dx contiguous in x's dtype (with a residual it is
    also dresidual), dweight and dbias (N,) in their parameters' dtypes; None for what was not asked
    for or has no parameter. bias is read only for its dtype. dx_cast (a dtype; needs compute_dx):
    dx.to(dx_cast) written in the same pass, the gradient of a residual narrower than x (autocast's
    bf16 projection added to an fp32 residual stream). compute_dx_sum (needs compute_dx): dx_sum is
    that tensor (dx_cast's, or dx) summed over its rows in fp32, (N,) rounded once to dx_sum_dtype
    (default: that tensor's dtype): the bias gradient of a linear whose output the norm's residual
    add took (the backward graph's column sum of dx; CUDA autocast sums bf16 straight into fp32)."""
    check_layer_norm_args(x, weight, bias, residual)
    _check_grad(dy, x, "dy", any_dtype=True)
    _check_grad(dsum, x, "dsum")
    return _norm_bwd("layer", dy, x, residual, dsum, weight, eps, 0.0, False, compute_dx, compute_dweight,
                     compute_dbias and bias is not None, config, _dtype_of(weight), _dtype_of(bias),
                     compute_dx_sum, dx_cast, dx_sum_dtype)


def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    *,
    residual: torch.Tensor | None = None,
    dsum: torch.Tensor | None = None,
    compute_dx: bool = True,
    compute_dweight: bool = True,
    dx_cast: torch.dtype | None = None,
    config: NormBwdConfig | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of rms_norm_fwd(x, weight, eps, weight_offset, cast_before_weight), or with
    residual of add_rms_norm_fwd, given dy and dsum as in layer_norm_bwd. Returns (dx, dweight,
    dx_cast): dx contiguous in x's dtype (also dresidual), dweight (N,) in weight's dtype, dx_cast
    as in layer_norm_bwd; None for what was not asked for or has no parameter."""
    check_rms_norm_args(x, weight, weight_offset, cast_before_weight, residual)
    _check_grad(dy, x, "dy", any_dtype=True)
    _check_grad(dsum, x, "dsum")
    dx, dweight, _, _, dx2 = _norm_bwd("rms", dy, x, residual, dsum, weight, eps, weight_offset, cast_before_weight,
                                       compute_dx, compute_dweight, False, config, _dtype_of(weight), torch.float32,
                                       dx_cast=dx_cast)
    return dx, dweight, dx2


def _dtype_of(param: torch.Tensor | None) -> torch.dtype:
    return param.dtype if param is not None else torch.float32
