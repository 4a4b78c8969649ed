"""Bias gradient of a linear: the column sums of the gradient reaching its output.

    dy:    (M, N)  any strides (a 2-D view of a (batch, seq, N) gradient, a transposed or an
                   expanded one)
    dbias: (N,)    dbias[n] = sum_m dy[m, n], accumulated in fp32, rounded once to out_dtype

Eager's linear backward does `grad.sum(0)` with fp32 accumulation and returns the bias's dtype
(under autocast that is the bf16 copy of the fp32 parameter; the cast's own backward then widens
the rounded sum to fp32), so that is what this computes; only the order of the fp32 additions
differs.

Why a kernel of our own: torch's column reduction of a bf16 (8192, 768..3072) tensor takes ~24 us
on an H100 where reading the 12-50 MB needs 4-15 us. A column sum has only N outputs, too few
programs to fill the GPU with one program per column block, so the rows are split as well:

    pass 1, _bias_grad_kernel:        grid (row chunks, column blocks); each program walks its
                                      chunk in (BLOCK_M, BLOCK_N) tiles, adds them into an fp32
                                      register tile and writes one fp32 partial row:
                                      partials: (n_chunks, N)
    pass 2, _bias_grad_reduce_kernel: grid (column blocks,); sums the n_chunks partial rows in a
                                      fixed order and rounds once to out_dtype.

No atomics, so the result is bitwise reproducible run to run. With a single chunk (small M) pass 1
writes the output directly and pass 2 is skipped. The chunk count aims at a few programs per SM
(row_chunks); the partials are small (at most ~4 x SMs x BLOCK_N fp32 values per column block).

transfuse.kernels.activation_backward's kernel produces the same partial rows while it writes the
activation gradient (one fewer read of it) and finishes with reduce_partials from here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from transfuse.kernels._config import INTERPRET, interpreter_large, next_power_of_2, num_sms, pdl, wait_for_previous_kernel
from transfuse.kernels.norm import _round_to


@dataclass(frozen=True)
class BiasGradConfig:
    BLOCK_M: int  # rows added per iteration
    BLOCK_N: int  # columns per program
    num_warps: int
    programs_per_sm: int  # what row_chunks aims at


# Under the interpreter: tiles small enough that tiny test shapes cross row, chunk and column edges.
_INTERPRET_CONFIG = BiasGradConfig(BLOCK_M=4, BLOCK_N=16, num_warps=1, programs_per_sm=2)
_INTERPRET_SMS = 4
# and for a larger problem (a model test's gradient: _config.interpreter_large), larger tiles
_INTERPRET_LARGE_CONFIG = BiasGradConfig(BLOCK_M=16, BLOCK_N=64, num_warps=1, programs_per_sm=2)


def bias_grad_config(n_cols: int) -> BiasGradConfig:
    """4096-element tiles (64 x 64) on 4 warps: 32 values per thread, in 16-byte vectors for 16-bit
    dtypes, and a 32-register fp32 accumulator; eight programs per SM. Measured best-balanced over
    N = 768, 2304 and 3072 at 8192 bf16 rows on an H200 (6.7-7.7 / 10.2-10.6 / 14.8-14.9 us against
    torch's 15.5 / 21.5 / 26.3; the 2304 case runs at 90% of the copy bandwidth;
    bench/kernels/sweep_train_memory_bound.py, 2026-11-26)."""
    if INTERPRET:
        return _INTERPRET_CONFIG
    block_n = min(64, max(16, next_power_of_2(n_cols)))
    return BiasGradConfig(BLOCK_M=4096 // block_n, BLOCK_N=block_n, num_warps=4, programs_per_sm=8)


def row_chunks(m: int, n_col_blocks: int, block_m: int, programs_per_sm: int,
               device: torch.device) -> tuple[int, int]:
    """(rows per chunk, number of chunks) splitting m rows so that chunks x n_col_blocks programs
    come near programs_per_sm per SM; a chunk is a whole number of BLOCK_M tiles."""
    target = programs_per_sm * num_sms(device, off_gpu=_INTERPRET_SMS)
    chunks = max(1, min(triton.cdiv(target, max(n_col_blocks, 1)), triton.cdiv(m, block_m)))
    rows_per_chunk = triton.cdiv(triton.cdiv(m, chunks), block_m) * block_m
    return rows_per_chunk, triton.cdiv(m, rows_per_chunk)


# -------------------------------------------------------------------------------------------------
# Kernels
# -------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])  # the row count changes with every input shape
def _bias_grad_kernel(
    dy_ptr, stride_dy_m, stride_dy_n,
    partial_ptr, stride_partial_chunk,
    M, N, rows_per_chunk,
    BF16_RNE_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """partial[chunk, n] = sum of dy[m, n] over the chunk's rows, fp32 (or the output's dtype when
    there is one chunk: partial_ptr is then the output)."""
    pid_chunk = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    # loop-invariant column offsets; int64 as a transposed dy has stride_dy_n = M
    col_offsets = offs_n.to(tl.int64)[None, :] * stride_dy_n
    row_begin = pid_chunk * rows_per_chunk
    row_end = tl.minimum(row_begin + rows_per_chunk, M)
    # A 2-D accumulator, reduced once at the end: the loop's adds are independent of each other.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(row_begin, row_end, BLOCK_M):
        offs_m = start + tl.arange(0, BLOCK_M)
        mask = (offs_m < row_end)[:, None] & mask_n[None, :]
        dy_ptrs = dy_ptr + offs_m.to(tl.int64)[:, None] * stride_dy_m + col_offsets
        # fp32 right after the load: the accumulation's precision (and the interpreter's bf16)
        acc += tl.load(dy_ptrs, mask=mask, other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=0)
    partial_ptrs = partial_ptr + pid_chunk.to(tl.int64) * stride_partial_chunk + offs_n
    tl.store(partial_ptrs, _round_to(total, partial_ptr.dtype.element_ty, BF16_RNE_BY_HAND), mask=mask_n)


@triton.jit
def _bias_grad_reduce_kernel(
    partial_ptr, stride_partial_chunk,
    out_ptr,
    n_chunks, N,
    BF16_RNE_BY_HAND: tl.constexpr,
    BLOCK_CHUNKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[n] = sum over chunks of partial[chunk, n], in chunk order, fp32, rounded once."""
    wait_for_previous_kernel(PDL)  # the partials come from the kernel just before
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_CHUNKS, BLOCK_N), dtype=tl.float32)
    for start in range(0, n_chunks, BLOCK_CHUNKS):
        offs_c = start + tl.arange(0, BLOCK_CHUNKS)
        mask = (offs_c < n_chunks)[:, None] & mask_n[None, :]
        partial_ptrs = partial_ptr + offs_c.to(tl.int64)[:, None] * stride_partial_chunk + offs_n[None, :]
        acc += tl.load(partial_ptrs, mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + offs_n, _round_to(total, out_ptr.dtype.element_ty, BF16_RNE_BY_HAND), mask=mask_n)


# -------------------------------------------------------------------------------------------------
# Launchers
# -------------------------------------------------------------------------------------------------

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _device_guard(t: torch.Tensor):
    # Triton launches on the current device; make it t's.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _check_runnable(t: torch.Tensor, name: str) -> None:
    if not t.is_cuda and not INTERPRET:
        raise RuntimeError(f"transfuse bias-gradient kernels run on CUDA tensors (or anywhere under "
                           f"TRITON_INTERPRET=1); {name} is on {t.device}")


def new_partials(n_chunks: int, n_cols: int, out_dtype: torch.dtype, like: torch.Tensor):
    """(partials, out): the buffer pass 1 writes, and the (n_cols,) output. With one chunk they are
    the same tensor, viewed (1, n_cols), and reduce_partials has nothing left to do."""
    out = torch.empty((n_cols,), dtype=out_dtype, device=like.device)
    if n_chunks == 1:
        return out.view(1, n_cols), out
    return torch.empty((n_chunks, n_cols), dtype=torch.float32, device=like.device), out


def reduce_partials(partials: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Sums the fp32 (n_chunks, N) partial rows into out, (N,), rounding once; nothing to do when
    partials is out itself (one chunk). Returns out."""
    if partials.data_ptr() == out.data_ptr() or out.numel() == 0:
        return out
    n_chunks, n_cols = partials.shape
    block_chunks, block_n = (4, 16) if INTERPRET else (32, 64)
    with _device_guard(out):
        _bias_grad_reduce_kernel[(triton.cdiv(n_cols, block_n),)](
            partials, partials.stride(0),
            out,
            n_chunks, n_cols,
            BF16_RNE_BY_HAND=INTERPRET and out.dtype == torch.bfloat16,
            BLOCK_CHUNKS=block_chunks, BLOCK_N=block_n, num_warps=4 if not INTERPRET else 1,
            **pdl(out),
        )
    return out


def bias_grad(dy: torch.Tensor, out_dtype: torch.dtype | None = None,
              config: BiasGradConfig | None = None) -> torch.Tensor:
    """dy summed over every dim but the last, fp32 accumulation, in out_dtype (dy's by default):
    the bias gradient of a linear whose output gradient is dy. dy: (..., N), any strides; a (M, N)
    view is read in place, other shapes are reshaped to (M, N) (a copy only when the leading dims
    cannot be collapsed). Returns (N,), a new tensor."""
    if dy.dim() < 1:
        raise ValueError("dy must be (..., N), got a 0-dim tensor")
    out_dtype = dy.dtype if out_dtype is None else out_dtype
    if dy.dtype not in _DTYPES or out_dtype not in _DTYPES:
        raise ValueError(f"dy and out_dtype must be float16, bfloat16 or float32, got {dy.dtype} -> {out_dtype}")
    n_cols = dy.shape[-1]
    dy2 = dy if dy.dim() == 2 else dy.reshape(-1, n_cols)
    m = dy2.shape[0]
    if m == 0 or n_cols == 0:
        return torch.zeros((n_cols,), dtype=out_dtype, device=dy.device)  # an empty sum is 0
    _check_runnable(dy, "dy")
    if config is None:
        config = _INTERPRET_LARGE_CONFIG if interpreter_large(m, n_cols) else bias_grad_config(n_cols)
    n_col_blocks = triton.cdiv(n_cols, config.BLOCK_N)
    rows_per_chunk, n_chunks = row_chunks(m, n_col_blocks, config.BLOCK_M, config.programs_per_sm, dy.device)
    partials, out = new_partials(n_chunks, n_cols, out_dtype, dy)
    with _device_guard(dy):
        _bias_grad_kernel[(n_chunks, n_col_blocks)](
            dy2, dy2.stride(0), dy2.stride(1),
            partials, partials.stride(0),
            m, n_cols, rows_per_chunk,
            BF16_RNE_BY_HAND=INTERPRET and partials.dtype == torch.bfloat16,
            BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, num_warps=config.num_warps,
        )
    return reduce_partials(partials, out)
