"""The activation step of a linear in training (transfuse::linear_train), which keeps the
pre-activation for its backward: the backward's activation gradient, and the forward's epilogue
applied to the stored pre-activation.

    pre:      (M, N), or (M, 2N) = [gate | up] for a gated "<act>_mul"; unit stride along columns
    grad_out: (M, N)  any strides (autograd may hand an expanded gradient)
    residual: (M, N)  any strides
    forward:  out      = act(pre) + residual                  <act>_mul: act(gate) * up + residual
    backward: grad_pre = grad_out * act'(pre)                  <act>_mul: [grad_out * up * act'(gate) |
                                                                          grad_out * act(gate)]
    dbias:    (N,), or (2N,) when gated: the column sums of grad_pre (activation_bias_bwd only)

out and grad_pre are contiguous, in pre's dtype. The linear's bias gradient is the column sum of
grad_pre: activation_bias_bwd adds it up while the tiles are in registers (each program then walks a
chunk of rows and writes one fp32 partial row, which transfuse.kernels.bias_grad's reduce finishes),
sparing the backward a second read of grad_pre. The sum is of grad_pre as stored, rounded, which
is what eager's linear backward sums.

Everything is computed in fp32 after the loads (the interpreter computes bf16 arithmetic wrongly,
and a GPU gains nothing from 16-bit math in a memory-bound kernel) and rounded once, at the store.

The derivatives are the ones torch's autograd uses (aten's GELU, SiLU, tanh and threshold
backward kernels), written with s(z) = 1 / (1 + exp(-z)):

    gelu       Phi(x) + x phi(x) = 0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) / sqrt(2 pi)
    gelu_tanh  0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) u',  u = sqrt(2/pi) (x + 0.044715 x^3),
               u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2); with t = s(2u), 1 + tanh u = 2t and
               1 - tanh^2 u = 4t (1 - t), so it is t + 2 x t (1 - t) u'
    relu       1 where x > 0, else 0 (torch tests the output, relu(x) > 0, which is the same set)
    tanh       1 - tanh^2 x = 4t (1 - t),  t = s(2x)
    silu       s(x) (1 + x (1 - s(x)))

The sigmoid forms need no tanh (not in core triton.language) and saturate without NaN: where
exp(-z) overflows to inf, s = 0 and the derivative is 0 (and t (1 - t) is 0 at t = 1), as torch's.

Why the forward epilogue is here: the training op's GEMM is transfuse.linear's bare one (cuBLAS at
training sizes) writing pre, and this one kernel then applies the activation, gate and residual,
where eager runs one kernel per op and keeps the same pre for its backward. (A GEMM epilogue
storing pre and out together would also save this kernel's read of pre: the next step, in
transfuse.kernels.gemm.)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from transfuse.kernels import bias_grad
from transfuse.kernels._config import INTERPRET, interpreter_large, next_power_of_2
from transfuse.kernels.gemm import ACTIVATIONS, _activate, is_gated
from transfuse.kernels.norm import _round_to


@dataclass(frozen=True)
class ActivationConfig:
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int


# Under the interpreter: tiles small enough that tiny test shapes cross row and column edges, and
# larger ones for a larger problem (_config.interpreter_large): 4 x 16 tiles made a model test's
# 24 x 128 activation 48 passes of Python, 0.2-0.3 s a call, and these two kernels a quarter of the
# interpreter's time in the model and training tests.
_INTERPRET_CONFIG = ActivationConfig(BLOCK_M=4, BLOCK_N=16, num_warps=1)
_INTERPRET_LARGE_CONFIG = ActivationConfig(BLOCK_M=16, BLOCK_N=64, num_warps=1)


def _for_interpreter(config: ActivationConfig, rows: int, cols: int) -> ActivationConfig:
    """config, or the interpreter's larger tiles for a (rows, cols) problem that takes them."""
    return _INTERPRET_LARGE_CONFIG if interpreter_large(rows, cols) else config


def activation_config(n_cols: int, widest: int = 256) -> ActivationConfig:
    """2048-element tiles on 4 warps, 16 values per thread and tensor: enough loads in flight for a
    memory-bound kernel without spilling the backward's four live tiles (silu_mul). Rows up to
    `widest` columns wide per tile, so that each row segment is one long contiguous read. Not
    autotuned (no shape keys to bucket, and nothing to gain from tuning a copy-speed kernel)."""
    if INTERPRET:
        return _INTERPRET_CONFIG
    block_n = min(widest, max(16, next_power_of_2(n_cols)))
    return ActivationConfig(BLOCK_M=2048 // block_n, BLOCK_N=block_n, num_warps=4)


def activation_fwd_config(n_cols: int) -> ActivationConfig:
    """The forward's tiles (act(pre) + residual; the backward's recomputation of it): activation_config's
    tiles at most 128 columns wide. At 8192 x 3072 bf16 on an H200, against 256-wide tiles: gelu_tanh
    46.7 -> 30.5 us (the copy floor is 29.6), exact GELU 41.6 -> 40.9, silu_mul at 4096 x 11264
    69.4 -> 49.2 (bench/kernels/sweep_activation_fwd.py, 2026-11-27)."""
    return activation_config(n_cols, widest=128)


# Programs per SM when the backward also sums grad_pre's columns (each program walks a chunk of rows).
_DBIAS_PROGRAMS_PER_SM = 4


def activation_dbias_config(n_cols: int) -> ActivationConfig:
    """The backward's tiles when it also sums the bias gradient: 4096 elements, 128 columns wide, on
    8 warps. At 8192 x 3072 bf16 on an H200 this took GELU's backward from 79.2 to 65.7 us and
    gelu_tanh's from 70.1 to 51.1 (the copy floor is 36.7), against 2048-element tiles 256 wide;
    four programs per SM were as good as 8 or 16 (bench/kernels/sweep_train_memory_bound.py,
    2026-11-26)."""
    if INTERPRET:
        return _INTERPRET_CONFIG
    block_n = min(128, max(16, next_power_of_2(n_cols)))
    return ActivationConfig(BLOCK_M=4096 // block_n, BLOCK_N=block_n, num_warps=8)


# -------------------------------------------------------------------------------------------------
# Kernels
# -------------------------------------------------------------------------------------------------


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _activation_grad(g, x, ACTIVATION: tl.constexpr):
    """g * act'(x) on fp32 tiles (see the module docstring for each derivative); for a gated
    "<act>_mul", act' of the gate."""
    if ACTIVATION == "gelu" or ACTIVATION == "gelu_mul":
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327  # 1 / sqrt(2 pi)
        g = g * (cdf + x * pdf)
    elif ACTIVATION == "gelu_tanh" or ACTIVATION == "gelu_tanh_mul":
        t = _sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))  # s(2u), 2 sqrt(2/pi) = 1.5957...
        du = 0.7978845608028654 * (1.0 + 0.134145 * x * x)  # u', 3 * 0.044715 = 0.134145
        g = g * (t + 2.0 * x * t * (1.0 - t) * du)
    elif ACTIVATION == "relu" or ACTIVATION == "relu_mul":
        # where, not g * 0: an inf or NaN gradient behind a dead unit stays 0, as in torch
        g = tl.where(x > 0.0, g, 0.0)
    elif ACTIVATION == "tanh":
        t = _sigmoid(2.0 * x)
        g = g * (4.0 * t * (1.0 - t))
    elif ACTIVATION == "silu" or ACTIVATION == "silu_mul":
        s = _sigmoid(x)
        g = g * (s * (1.0 + x * (1.0 - s)))
    return g


@triton.jit(do_not_specialize=["M"])  # the row count changes with every input shape
def _activation_fwd_kernel(
    pre_ptr, stride_pre_m,
    res_ptr, stride_res_m, stride_res_n,
    out_ptr, stride_out_m,
    M, N,
    ACTIVATION: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BF16_RNE_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    GATED: tl.constexpr = ((ACTIVATION == "silu_mul" or ACTIVATION == "gelu_mul")
                           or (ACTIVATION == "gelu_tanh_mul" or ACTIVATION == "relu_mul"))
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    rows = offs_m.to(tl.int64)
    pre_ptrs = pre_ptr + rows[:, None] * stride_pre_m + offs_n[None, :]
    # Widened right after the load: the interpreter computes bf16 arithmetic wrongly.
    h = _activate(tl.load(pre_ptrs, mask=mask, other=0.0).to(tl.float32), ACTIVATION)
    if GATED:
        h = h * tl.load(pre_ptrs + N, mask=mask, other=0.0).to(tl.float32)  # up: N columns on
    if HAS_RESIDUAL:
        res_ptrs = res_ptr + rows[:, None] * stride_res_m + offs_n[None, :] * stride_res_n
        h += tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + rows[:, None] * stride_out_m + offs_n[None, :]
    tl.store(out_ptrs, _round_to(h, out_ptr.dtype.element_ty, BF16_RNE_BY_HAND), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _activation_bwd_kernel(
    grad_out_ptr, stride_grad_out_m, stride_grad_out_n,
    pre_ptr, stride_pre_m,
    grad_pre_ptr, stride_grad_pre_m,
    partial_ptr, stride_partial_chunk,
    M, N, rows_per_chunk,
    ACTIVATION: tl.constexpr,
    HAS_DBIAS: tl.constexpr,
    BF16_RNE_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """grad_pre over rows [chunk * rows_per_chunk, +rows_per_chunk) (one BLOCK_M tile without
    HAS_DBIAS); with HAS_DBIAS also the chunk's column sums of grad_pre, as stored, into one fp32
    partial row (both halves when gated: 2N wide), which bias_grad.reduce_partials finishes."""
    GATED: tl.constexpr = ((ACTIVATION == "silu_mul" or ACTIVATION == "gelu_mul")
                           or (ACTIVATION == "gelu_tanh_mul" or ACTIVATION == "relu_mul"))
    pid_chunk = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    row_begin = pid_chunk * rows_per_chunk
    row_end = tl.minimum(row_begin + rows_per_chunk, M)
    dtype = grad_pre_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # a gated unit's second half
    for start in range(row_begin, row_end, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        mask = (offs_m < row_end)[:, None] & mask_n[None, :]
        rows = offs_m.to(tl.int64)
        grad_out_ptrs = grad_out_ptr + rows[:, None] * stride_grad_out_m + offs_n[None, :] * stride_grad_out_n
        g = tl.load(grad_out_ptrs, mask=mask, other=0.0).to(tl.float32)
        pre_ptrs = pre_ptr + rows[:, None] * stride_pre_m + offs_n[None, :]
        x = tl.load(pre_ptrs, mask=mask, other=0.0).to(tl.float32)
        grad_pre_ptrs = grad_pre_ptr + rows[:, None] * stride_grad_pre_m + offs_n[None, :]
        if GATED:
            up = tl.load(pre_ptrs + N, mask=mask, other=0.0).to(tl.float32)
            # d out / d up = act(gate); d out / d gate = up * act'(gate), in fp32 with one rounding
            # each (eager rounds act(gate), grad * up and grad * act(gate) on the way)
            grad_up = _round_to(g * _activate(x, ACTIVATION), dtype, BF16_RNE_BY_HAND)
            tl.store(grad_pre_ptrs + N, grad_up, mask=mask)
            if HAS_DBIAS:
                acc_up += tl.where(mask, grad_up.to(tl.float32), 0.0)
            grad = _activation_grad(g * up, x, ACTIVATION)
        else:
            grad = _activation_grad(g, x, ACTIVATION)
        grad = _round_to(grad, dtype, BF16_RNE_BY_HAND)
        tl.store(grad_pre_ptrs, grad, mask=mask)
        if HAS_DBIAS:
            # the rounded values, as stored: eager sums the grad_pre that dx and dW are made from
            acc += tl.where(mask, grad.to(tl.float32), 0.0)
    if HAS_DBIAS:
        partial_ptrs = partial_ptr + pid_chunk.to(tl.int64) * stride_partial_chunk + offs_n
        part_dtype = partial_ptr.dtype.element_ty
        tl.store(partial_ptrs, _round_to(tl.sum(acc, axis=0), part_dtype, BF16_RNE_BY_HAND), mask=mask_n)
        if GATED:
            tl.store(partial_ptrs + N, _round_to(tl.sum(acc_up, axis=0), part_dtype, BF16_RNE_BY_HAND),
                     mask=mask_n)


# -------------------------------------------------------------------------------------------------
# Launchers
# -------------------------------------------------------------------------------------------------


def check_activation_args(pre: torch.Tensor, activation: str, other: torch.Tensor | None, name: str) -> int:
    """Validates pre against the activation and `other` (grad_out or residual, (..., N), pre's
    dtype and device); returns N, the output's last dim."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if pre.dim() < 1 or (is_gated(activation) and pre.shape[-1] % 2):
        raise ValueError(f"pre must be (..., N), or (..., 2N) for {activation}, got {tuple(pre.shape)}")
    n = pre.shape[-1] // 2 if is_gated(activation) else pre.shape[-1]
    if pre.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"pre must be float16, bfloat16 or float32, got {pre.dtype}")
    if other is not None:
        if tuple(other.shape) != (*pre.shape[:-1], n):
            raise ValueError(f"{name} must be {(*pre.shape[:-1], n)}, got {tuple(other.shape)}")
        if other.dtype != pre.dtype or other.device != pre.device:
            raise ValueError(f"{name} must be {pre.dtype} on {pre.device}, got {other.dtype} on {other.device}")
    return n


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as (M, t.shape[-1]) with unit column stride: a view where the leading dims collapse."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(1) == 1 or t2.shape[1] <= 1 else t2.contiguous()


def _launch(kernel, pre: torch.Tensor, n: int, *args, chunking=None, config=None, **flags) -> None:
    """Launches kernel over pre's M rows and n columns in (BLOCK_M, BLOCK_N) tiles, one tile per
    program, or with chunking = (rows_per_chunk, n_chunks) one chunk of rows per program (the
    backward kernel takes rows_per_chunk after M and N)."""
    if not pre.is_cuda and not INTERPRET:
        raise RuntimeError(f"transfuse activation kernels run on CUDA tensors (or anywhere under "
                           f"TRITON_INTERPRET=1); pre is on {pre.device}")
    m = pre.numel() // pre.shape[-1]
    config = config or activation_config(n)
    if chunking is None:
        grid = (triton.cdiv(m, config.BLOCK_M), triton.cdiv(n, config.BLOCK_N))
        sizes = (m, n)
    else:
        grid = (chunking[1], triton.cdiv(n, config.BLOCK_N))
        sizes = (m, n, chunking[0])
    with torch.cuda.device(pre.device) if pre.is_cuda else contextlib.nullcontext():
        kernel[grid](*args, *sizes, **flags, BF16_RNE_BY_HAND=INTERPRET and pre.dtype == torch.bfloat16,
                     BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, num_warps=config.num_warps)


def activation_fwd(pre: torch.Tensor, activation: str, residual: torch.Tensor | None = None) -> torch.Tensor:
    """act(pre) + residual (act(gate) * up + residual when gated): (..., N), contiguous, in
    pre's dtype. pre: (..., N) or (..., 2N); residual: (..., N), any strides."""
    n = check_activation_args(pre, activation, residual, "residual")
    out = torch.empty((*pre.shape[:-1], n), dtype=pre.dtype, device=pre.device)
    if out.numel() == 0:
        return out
    pre2, out2 = _rows(pre), out.view(-1, n)
    res2 = residual.reshape(-1, n) if residual is not None else None
    config = _for_interpreter(activation_fwd_config(n), out2.shape[0], n)
    _launch(_activation_fwd_kernel, pre, n,
            pre2, pre2.stride(0),
            res2 if res2 is not None else out2, res2.stride(0) if res2 is not None else 0,
            res2.stride(1) if res2 is not None else 0,  # absent: out stands in, never read
            out2, out2.stride(0),
            config=config, ACTIVATION=activation, HAS_RESIDUAL=res2 is not None)
    return out


def _activation_bwd(grad_out, pre, activation, with_dbias, dbias_dtype=None):
    n = check_activation_args(pre, activation, grad_out, "grad_out")
    width = pre.shape[-1]
    grad_pre = torch.empty(pre.shape, dtype=pre.dtype, device=pre.device)
    if grad_pre.numel() == 0:
        # an empty sum is 0
        return grad_pre, torch.zeros((width,), dtype=dbias_dtype or pre.dtype, device=pre.device) if with_dbias else None
    pre2, grad_pre2 = _rows(pre), grad_pre.view(-1, width)
    grad2 = grad_out.reshape(-1, n)
    m = grad2.shape[0]
    config = _for_interpreter(activation_dbias_config(n) if with_dbias else activation_config(n), m, n)
    if with_dbias:
        # few enough programs that the partial rows stay small: a chunk of rows each
        rows_per_chunk, n_chunks = bias_grad.row_chunks(
            m, triton.cdiv(n, config.BLOCK_N), config.BLOCK_M, _DBIAS_PROGRAMS_PER_SM, pre.device)
        partials, dbias = bias_grad.new_partials(n_chunks, width, dbias_dtype or pre.dtype, pre)
    else:  # one tile per program; the partials pointer is never written
        rows_per_chunk, n_chunks = config.BLOCK_M, triton.cdiv(m, config.BLOCK_M)
        partials, dbias = grad_pre2, None
    _launch(_activation_bwd_kernel, pre, n,
            grad2, grad2.stride(0), grad2.stride(1),
            pre2, pre2.stride(0),
            grad_pre2, grad_pre2.stride(0),
            partials, partials.stride(0),
            chunking=(rows_per_chunk, n_chunks), config=config,
            ACTIVATION=activation, HAS_DBIAS=with_dbias)
    return grad_pre, bias_grad.reduce_partials(partials, dbias) if with_dbias else None


def activation_bwd(grad_out: torch.Tensor, pre: torch.Tensor, activation: str) -> torch.Tensor:
    """grad_out * act'(pre), the gradient reaching pre through activation_fwd (both halves when
    gated): pre's shape, contiguous, in pre's dtype. grad_out: (..., N), any strides."""
    return _activation_bwd(grad_out, pre, activation, False)[0]


def activation_bias_bwd(grad_out: torch.Tensor, pre: torch.Tensor, activation: str,
                        dbias_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_pre, dbias): activation_bwd's grad_pre and its sum over every row, (pre.shape[-1],),
    fp32 accumulation rounded to dbias_dtype (pre's when None; kernels.bias_grad's result for
    grad_pre), computed while grad_pre is written rather than read back by a second kernel."""
    return _activation_bwd(grad_out, pre, activation, True, dbias_dtype)
