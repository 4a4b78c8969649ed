"""Normalisation over the last dimension: LayerNorm and RMSNorm, each optionally fused with the
residual add that precedes it in a transformer block.

x: (..., N), normalised over N; every leading dim is a row. Statistics per row in fp32:

    LayerNorm (Ba, Kiros & Hinton 2016):   mean = sum(x) / N,  var = sum((x - mean)^2) / N  (biased)
                                           y = (x - mean) * rsqrt(var + eps) * weight + bias
    RMSNorm (Zhang & Sennrich 2019):       rstd = rsqrt(sum(x^2) / N + eps),   h = x * rstd
        CAST_BEFORE_WEIGHT (Llama, T5):    y = h.to(x.dtype) * (weight + weight_offset)
        otherwise (Gemma, F.rms_norm):     y = h * (weight + weight_offset)      (then .to(x.dtype))

With a residual, the row normalised is s = x + residual rounded to x.dtype first, which is what
eager `norm(x + residual)` computes in half precision; s itself is returned when asked for (pre-norm
models feed it to the next block) and never written otherwise (BERT's post-norm has no other user).

Each program normalises ROWS_PER_PROGRAM whole rows held in registers (BLOCK_N >= N), so x and the
residual are read from memory exactly once and the output written once: the kernels are bound by
memory bandwidth, and one pass is the least traffic there is.
"""

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from transfuse.kernels._config import INTERPRET, next_power_of_2, pdl, wait_for_previous_kernel

# A row must fit the registers of one program: at 65536 a 1024-thread program already holds 64 fp32
# per thread and tensor. Hidden sizes of real transformers are well below (Llama-3 405B: 16384).
MAX_N = 65536

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The dtypes narrower than each (that promote to it): an RMSNorm weight may be one of them.
_NARROWER = {dt: tuple(d for d in _SUPPORTED_DTYPES if d != dt and torch.promote_types(d, dt) == dt)
             for dt in _SUPPORTED_DTYPES}

# Up to this many rows each row gets its own program: a few rows' latency is one program's, and
# grouping them leaves SMs idle. Measured on an H100 (bench/kernels/bench_norm_small_rows.py,
# 2026-11-26, bench/results/2026-11-26-*-norm-small-rows-session17.log), x768 fp16 add_layer_norm:
# 16 rows 2.05 -> 1.48 us, 128 rows 2.08 -> 1.80, 1024 rows 2.60 -> 2.31 (4 rows a program -> 1); at
# 4096 and 16384 rows grouping is as fast or faster.
SPREAD_ROWS_MAX = 1024


@dataclass(frozen=True)
class NormConfig:
    BLOCK_N: int  # power of two >= N: one row is one register tile
    ROWS_PER_PROGRAM: int  # rows normalised together; > 1 only for short rows
    num_warps: int


def norm_config(n_rows: int, n_cols: int) -> NormConfig:
    """Launch shape from the row length (and, for short rows, the row count). No autotuning: a
    first call may happen inside CUDA-graph capture, where candidates cannot be timed, and for a
    one-pass memory-bound kernel the choice follows N closely. `bench_norm.py --sweep` measures
    every candidate against this choice.

    Each thread should hold a handful of 16-byte vectors per tensor: few enough to stay in
    registers, enough to keep several loads in flight (4 warps at N <= 1024, 8 from 2048, 16 from
    8192, 32 from 32768). Rows shorter than 1024 are grouped so a program still moves a few KiB, once
    there are more than SPREAD_ROWS_MAX of them; fewer rows get a program each."""
    block_n = max(next_power_of_2(n_cols), 16)
    if block_n >= 32768:
        num_warps = 32
    elif block_n >= 8192:
        num_warps = 16
    elif block_n >= 2048:
        num_warps = 8
    else:
        num_warps = 4
    rows = 1
    # Under the interpreter a program costs milliseconds of Python whatever its size: rows grouped.
    if block_n <= 1024 and (n_rows > SPREAD_ROWS_MAX or INTERPRET):
        # Measured on an H200 (bench_norm.py --sweep, 2026-11-21): 16384x768 fp16 add_layer_norm
        # ran in 24 us with 4 rows on 2 warps against 50 us with 1 row on 4 warps.
        rows = min(4096 // block_n, 16, next_power_of_2(max(n_rows, 1)))
        if n_rows >= 4096:
            num_warps = 2
    return NormConfig(BLOCK_N=block_n, ROWS_PER_PROGRAM=rows, num_warps=num_warps)


@triton.jit
def _round_to(x, DTYPE: tl.constexpr, BF16_RNE_BY_HAND: tl.constexpr):
    """fp32 `x` rounded to DTYPE (round to nearest even), returned as DTYPE.

    Triton's interpreter truncates fp32 -> bf16 instead of rounding, so under it the rounding is
    done on the bits; on a GPU the conversion instruction rounds and BF16_RNE_BY_HAND is False.
    Remove the branch once the interpreter rounds to nearest even."""
    if BF16_RNE_BY_HAND and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        # NaN payloads must not carry into the sign bit
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # noqa: PLR0124  (x != x: NaN)
    return x.to(DTYPE)


@triton.jit
def _layer_norm_rows(x, mask, cols, col_mask, n_cols, eps, weight_ptr, bias_ptr,
                     HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """LayerNorm of the fp32 rows x: (ROWS, BLOCK_N), zero outside `mask`; returns fp32, not yet
    rounded to the output dtype. Shared by every kernel that ends in a LayerNorm (this file's and
    kernels/embedding.py's) so that they all round the same way."""
    mean = tl.sum(x, axis=1) / n_cols
    # Two passes over registers, not sum(x^2) - mean^2: no cancellation when |mean| >> std.
    x_centered = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(x_centered * x_centered, axis=1) / n_cols
    rstd = tl.math.rsqrt(var + eps)
    y = x_centered * rstd[:, None]
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y * weight[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = y + bias[None, :]
    return y


@triton.jit
def program_rows(n_rows, size_d1, n_cols, BLOCK_N: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr):
    """This program's rows of a (d0, d1) row grid and its columns: (rows, rows_d0, rows_d1, row_mask,
    cols, col_mask, mask), row indices int64. Row r is position (r // size_d1, r % size_d1), so two
    leading strides address any layout whose leading dims do not collapse (shared with embedding.py)."""
    pid = tl.program_id(0)
    rows = pid * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    row_mask = rows < n_rows
    rows_d0 = (rows // size_d1).to(tl.int64)
    rows_d1 = (rows % size_d1).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    return rows.to(tl.int64), rows_d0, rows_d1, row_mask, cols, col_mask, row_mask[:, None] & col_mask[None, :]


@triton.jit(do_not_specialize=["n_rows", "size_d1"])  # row counts change with every input shape
def _layer_norm_fwd_kernel(
    x_ptr, stride_x_d0, stride_x_d1,
    residual_ptr, stride_residual_d0, stride_residual_d1,
    weight_ptr, bias_ptr,
    out_ptr, stride_out_row,
    sum_ptr, stride_sum_row,
    n_rows, size_d1, n_cols, eps,
    BLOCK_N: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STORE_SUM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BF16_RNE_BY_HAND: tl.constexpr,
    PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (_config.pdl)
):
    wait_for_previous_kernel(PDL)
    # Row r of the (n_rows, n_cols) view is x[r // size_d1, r % size_d1, :] of x seen as
    # (d0, d1, n_cols): two leading strides cover every layout that is not contiguous only
    # because of a transpose or a slice of the leading dims.
    rows, rows_d0, rows_d1, row_mask, cols, col_mask, mask = program_rows(n_rows, size_d1, n_cols, BLOCK_N,
                                                                          ROWS_PER_PROGRAM)

    x_ptrs = x_ptr + (rows_d0 * stride_x_d0 + rows_d1 * stride_x_d1)[:, None] + cols[None, :]
    # Statistics in fp32 whatever the input dtype: an fp16 sum over a 4096-wide row overflows or
    # loses every low bit, and the interpreter computes bf16 arithmetic wrongly.
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual_ptrs = (residual_ptr + (rows_d0 * stride_residual_d0 + rows_d1 * stride_residual_d1)[:, None]
                         + cols[None, :])
        residual = tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)
        # Eager adds in x's dtype before normalising: round the sum the same way, bit for bit.
        s = _round_to(x + residual, x_ptr.dtype.element_ty, BF16_RNE_BY_HAND)
        if STORE_SUM:
            tl.store(sum_ptr + rows[:, None] * stride_sum_row + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)

    y = _layer_norm_rows(x, mask, cols, col_mask, n_cols, eps, weight_ptr, bias_ptr, HAS_WEIGHT, HAS_BIAS)
    y = _round_to(y, out_ptr.dtype.element_ty, BF16_RNE_BY_HAND)
    tl.store(out_ptr + rows[:, None] * stride_out_row + cols[None, :], y, mask=mask)


@triton.jit(do_not_specialize=["n_rows", "size_d1"])  # row counts change with every input shape
def _rms_norm_fwd_kernel(
    x_ptr, stride_x_d0, stride_x_d1,
    residual_ptr, stride_residual_d0, stride_residual_d1,
    weight_ptr,
    out_ptr, stride_out_row,
    sum_ptr, stride_sum_row,
    n_rows, size_d1, n_cols, eps, weight_offset,
    BLOCK_N: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STORE_SUM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    BF16_RNE_BY_HAND: tl.constexpr,
    PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (_config.pdl)
):
    wait_for_previous_kernel(PDL)
    # Row addressing as in _layer_norm_fwd_kernel.
    rows, rows_d0, rows_d1, row_mask, cols, col_mask, mask = program_rows(n_rows, size_d1, n_cols, BLOCK_N,
                                                                          ROWS_PER_PROGRAM)

    x_ptrs = x_ptr + (rows_d0 * stride_x_d0 + rows_d1 * stride_x_d1)[:, None] + cols[None, :]
    # Sum of squares in fp32: in fp16 it overflows (65504) as soon as a row of 4096 holds values
    # around 4, and every Hugging Face RMSNorm upcasts for that reason.
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual_ptrs = (residual_ptr + (rows_d0 * stride_residual_d0 + rows_d1 * stride_residual_d1)[:, None]
                         + cols[None, :])
        residual = tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)
        # Eager adds in x's dtype before normalising: round the sum the same way, bit for bit.
        s = _round_to(x + residual, x_ptr.dtype.element_ty, BF16_RNE_BY_HAND)
        if STORE_SUM:
            tl.store(sum_ptr + rows[:, None] * stride_sum_row + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)

    mean_square = tl.sum(x * x, axis=1) / n_cols
    rstd = tl.math.rsqrt(mean_square + eps)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        if CAST_BEFORE_WEIGHT:
            # Llama rounds the normalised row to the input dtype and multiplies by the weight in
            # that dtype; the product of two half-precision numbers is exact in fp32, so one
            # rounding at the store reproduces it.
            y = _round_to(y, x_ptr.dtype.element_ty, BF16_RNE_BY_HAND).to(tl.float32)
        weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset
        y = y * weight[None, :]
    y = _round_to(y, out_ptr.dtype.element_ty, BF16_RNE_BY_HAND)
    tl.store(out_ptr + rows[:, None] * stride_out_row + cols[None, :], y, mask=mask)


# ---------------------------------------------------------------------------------------------
# Launchers: check, allocate, pick the grid, launch.


def _check_input(x: torch.Tensor, name: str = "x") -> None:
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"transfuse norm: {name} must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"transfuse norm: {name} must have at least one dim (the normalised one)")
    if x.shape[-1] > MAX_N:
        raise ValueError(f"transfuse norm: the last dim of {name} is {x.shape[-1]}, more than MAX_N={MAX_N}")


def _check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    # A narrower residual is what autocast leaves: an fp32 residual stream plus a bf16 linear's
    # output, which eager adds in fp32 (type promotion), as the kernel does in x's dtype.
    if (residual.shape != x.shape or residual.device != x.device or residual.dtype not in _SUPPORTED_DTYPES
            or torch.promote_types(x.dtype, residual.dtype) != x.dtype):
        raise ValueError(
            "transfuse norm: residual must have the shape and device of x and x's dtype or a narrower one, got "
            f"{tuple(residual.shape)} {residual.dtype} {residual.device} for x "
            f"{tuple(x.shape)} {x.dtype} {x.device}"
        )


def check_out_dtype(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    """The output dtype of a norm asked for out_dtype (None: x's): x's or a narrower one, so that the
    result is `norm(x).to(out_dtype)` with one rounding (from fp32) either way."""
    if out_dtype is None:
        return x.dtype
    if out_dtype not in _SUPPORTED_DTYPES or torch.promote_types(out_dtype, x.dtype) != x.dtype:
        raise TypeError(f"transfuse norm: out_dtype must be x's dtype ({x.dtype}) or a narrower float dtype, "
                        f"got {out_dtype}")
    return out_dtype


def _check_affine(param: torch.Tensor | None, x: torch.Tensor, name: str, allowed: tuple) -> None:
    if param is None:
        return
    if param.shape != (x.shape[-1],):
        raise ValueError(f"transfuse norm: {name} must have shape ({x.shape[-1]},), got {tuple(param.shape)}")
    if param.dtype not in allowed:
        names = " or ".join(str(d) for d in allowed)
        raise TypeError(f"transfuse norm: {name} must be {names} for x of {x.dtype}, got {param.dtype}")
    if param.device != x.device:
        raise ValueError(f"transfuse norm: {name} is on {param.device}, x on {x.device}")


def check_layer_norm_args(x, weight, bias, residual=None, out_dtype=None) -> torch.dtype:
    """Raise on arguments the kernel does not take; return the output dtype (x's unless out_dtype
    says otherwise: the affine parameters may be x's dtype or fp32, as F.layer_norm allows, and are
    applied in fp32, and the result is rounded once, to the output dtype)."""
    _check_input(x)
    if residual is not None:
        _check_residual(x, residual)
    _check_affine(weight, x, "weight", (x.dtype, torch.float32))
    _check_affine(bias, x, "bias", (x.dtype, torch.float32))
    return check_out_dtype(x, out_dtype)


def check_rms_norm_args(x, weight, weight_offset, cast_before_weight, residual=None, out_dtype=None) -> torch.dtype:
    """Raise on arguments the kernel does not take; return the output dtype, which is x's unless
    out_dtype says otherwise (the result then rounded once to it, as a cast after the norm rounds).

    cast_before_weight=True (Llama, T5): `weight * h.to(x.dtype)` promotes to the wider of the two
    dtypes in eager, so the weight must have x's dtype, or a narrower one, for the output to be x's.
    With cast_before_weight=False (Gemma, F.rms_norm) the product is taken in fp32 and cast to x's
    dtype, so the weight may also be fp32. A narrower weight (fp16 or bf16 for an fp32 x: Mamba's
    fp32 residual stream under half weights) is widened exactly, and the product is the fp32 one
    eager's type promotion takes. weight=None means no scale, where an offset would mean nothing."""
    _check_input(x)
    if residual is not None:
        _check_residual(x, residual)
    narrower = _NARROWER.get(x.dtype, ())
    allowed = (x.dtype, *narrower) if cast_before_weight else (x.dtype, torch.float32, *narrower)
    _check_affine(weight, x, "weight", allowed)
    if weight is None and weight_offset != 0.0:
        raise ValueError("transfuse norm: weight_offset must be 0.0 when there is no weight")
    return check_out_dtype(x, out_dtype)


def _leading_layout(tensors: list[torch.Tensor]) -> tuple[int, list[tuple[int, int]]] | None:
    """Describe the rows of every tensor (same shape, last-dim stride 1) as one (d0, d1) grid:
    returns size_d1 and each tensor's (stride_d0, stride_d1), or None when the leading dims do not
    collapse to two for all of them."""
    shape = tensors[0].shape[:-1]
    dims = [i for i, size in enumerate(shape) if size != 1]  # size-1 dims have no stride that matters
    groups: list[list[int]] = []  # consecutive dims that are one dim for every tensor
    for i in dims:
        if groups and all(t.stride(groups[-1][-1]) == t.stride(i) * shape[i] for t in tensors):
            groups[-1].append(i)
        else:
            groups.append([i])
    if len(groups) > 2:
        return None
    while len(groups) < 2:
        groups.insert(0, [])
    size_d1 = 1
    for i in groups[1]:
        size_d1 *= shape[i]
    strides = []
    for t in tensors:
        stride_d0 = t.stride(groups[0][-1]) if groups[0] else 0
        stride_d1 = t.stride(groups[1][-1]) if groups[1] else 0
        strides.append((stride_d0, stride_d1))
    return size_d1, strides


def _row_views(x: torch.Tensor, residual: torch.Tensor | None):
    """x (and residual) with a unit last-dim stride, the (d0, d1) row grid and their strides."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    tensors = [x] if residual is None else [x, residual]
    layout = _leading_layout(tensors)
    if layout is None:
        x = x.contiguous()
        residual = None if residual is None else residual.contiguous()
        tensors = [x] if residual is None else [x, residual]
        layout = _leading_layout(tensors)
    size_d1, strides = layout
    residual_strides = strides[1] if residual is not None else (0, 0)
    return x, residual, size_d1, strides[0], residual_strides


def _device_guard(x: torch.Tensor):
    # Triton launches on the current device; make it x's.
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _check_runnable(x: torch.Tensor) -> None:
    if not x.is_cuda and not INTERPRET:
        raise RuntimeError(
            f"transfuse norm kernels run on CUDA tensors (or anywhere under TRITON_INTERPRET=1); x is on {x.device}"
        )


def _norm_fwd(kind, x, residual, weight, bias, eps, weight_offset, cast_before_weight, store_sum, out_dtype,
              config):
    """Shared launcher body: returns (out, sum) where sum is an empty (0,) tensor unless stored."""
    has_residual = residual is not None
    store_sum = store_sum and has_residual
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    sum_out = torch.empty(x.shape if store_sum else (0,), dtype=x.dtype, device=x.device)
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    if n_rows == 0 or n_cols == 0:
        return out, sum_out
    _check_runnable(x)
    if n_rows >= 2**31:
        raise ValueError(f"transfuse norm: {n_rows} rows do not fit the int32 row index")
    x, residual, size_d1, (stride_x_d0, stride_x_d1), (stride_residual_d0, stride_residual_d1) = _row_views(
        x, residual)
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    config = config or norm_config(n_rows, n_cols)
    grid = (triton.cdiv(n_rows, config.ROWS_PER_PROGRAM),)
    # Unused pointers get x: a valid address the kernel never dereferences (constexpr-guarded).
    common = {
        "BLOCK_N": config.BLOCK_N,
        "ROWS_PER_PROGRAM": config.ROWS_PER_PROGRAM,
        "HAS_RESIDUAL": has_residual,
        "STORE_SUM": store_sum,
        "HAS_WEIGHT": weight is not None,
        "BF16_RNE_BY_HAND": INTERPRET and torch.bfloat16 in (x.dtype, out_dtype),
        "num_warps": config.num_warps,
        **pdl(x),
    }
    residual_arg = residual if has_residual else x
    sum_arg = sum_out if store_sum else x
    weight_arg = weight if weight is not None else x
    with _device_guard(x):
        if kind == "layer":
            _layer_norm_fwd_kernel[grid](
                x, stride_x_d0, stride_x_d1,
                residual_arg, stride_residual_d0, stride_residual_d1,
                weight_arg, bias if bias is not None else x,
                out, n_cols,
                sum_arg, n_cols,
                n_rows, size_d1, n_cols, eps,
                HAS_BIAS=bias is not None,
                **common,
            )
        else:
            _rms_norm_fwd_kernel[grid](
                x, stride_x_d0, stride_x_d1,
                residual_arg, stride_residual_d0, stride_residual_d1,
                weight_arg,
                out, n_cols,
                sum_arg, n_cols,
                n_rows, size_d1, n_cols, eps, weight_offset,
                CAST_BEFORE_WEIGHT=cast_before_weight,
                **common,
            )
    return out, sum_out


def layer_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    out_dtype: torch.dtype | None = None,
    config: NormConfig | None = None,
) -> torch.Tensor:
    """F.layer_norm(x, (N,), weight, bias, eps). x: (..., N); weight, bias: (N,) of x's dtype or
    fp32. Returns a contiguous tensor of x's shape, in x's dtype or out_dtype: the fp32 result
    rounded once to it, what `F.layer_norm(x, ...).to(out_dtype)` gives for fp32 x."""
    out_dtype = check_layer_norm_args(x, weight, bias, out_dtype=out_dtype)
    out, _ = _norm_fwd("layer", x, None, weight, bias, eps, 0.0, False, False, out_dtype, config)
    return out


def add_layer_norm_fwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    store_sum: bool,
    *,
    out_dtype: torch.dtype | None = None,
    config: NormConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual (in x's dtype); returns (layer_norm(s), s), or (layer_norm(s), empty (0,))
    when store_sum is False. residual: x's shape, x's dtype or a narrower one (promoted as eager
    adds them). layer_norm(s) in x's dtype or out_dtype, as layer_norm_fwd."""
    out_dtype = check_layer_norm_args(x, weight, bias, residual, out_dtype)
    return _norm_fwd("layer", x, residual, weight, bias, eps, 0.0, False, store_sum, out_dtype, config)


def rms_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    *,
    out_dtype: torch.dtype | None = None,
    config: NormConfig | None = None,
) -> torch.Tensor:
    """RMSNorm of x: (..., N) over N, in the Hugging Face flavour the flags name (module docstring).
    Returns a contiguous tensor of x's shape, in x's dtype or out_dtype."""
    out_dtype = check_rms_norm_args(x, weight, weight_offset, cast_before_weight, out_dtype=out_dtype)
    out, _ = _norm_fwd("rms", x, None, weight, None, eps, weight_offset, cast_before_weight, False, out_dtype,
                       config)
    return out


def add_rms_norm_fwd(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    store_sum: bool,
    *,
    out_dtype: torch.dtype | None = None,
    config: NormConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual (in x's dtype; residual may be narrower, promoted as eager adds); returns
    (rms_norm(s), s), or (rms_norm(s), empty (0,)) when store_sum is False; rms_norm(s) in x's dtype
    or out_dtype."""
    out_dtype = check_rms_norm_args(x, weight, weight_offset, cast_before_weight, residual, out_dtype)
    return _norm_fwd("rms", x, residual, weight, None, eps, weight_offset, cast_before_weight, store_sum,
                     out_dtype, config)
