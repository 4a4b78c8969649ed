"""Embedding lookups summed into a LayerNorm: the input layer of BERT-family encoders
(transformers/models/bert/modeling_bert.py, BertEmbeddings) in one kernel.

    indices[i]: int32/int64, shapes broadcastable to each other (e.g. ids (B, S), positions (1, S))
    tables[i]:  (num_embeddings_i, N), one float dtype for all, 1 <= len(tables) <= 4
    out[r, :] = layer_norm(table_0[idx_0[r]] + table_1[idx_1[r]] + ..., weight, bias, eps)

for every position r of the broadcast index shape; out: (*broadcast shape, N) in the tables' dtype.
The sum is taken in eager's order and rounded to the tables' dtype after every add, as
`(e0 + e1) + e2` does in half precision; the LayerNorm is transfuse.kernels.norm's row math
(statistics in fp32, two-pass variance in registers). In half precision the output is eager's bit
for bit but where the fp32 statistics differ in their last bit (another summation order).

Out-of-range indices (< 0 or >= num_embeddings): eager raises on the CPU and device-asserts on a
GPU (which ends the process's CUDA context). The kernel never reads outside a table and writes NaN
to every element of that output row instead: wrong, but never plausibly right.

Each program handles ROWS_PER_PROGRAM whole rows in registers, as the norm kernels do: one launch,
each looked-up row read once, the output written once. Eager runs a gather per table, a kernel per
add and the LayerNorm (six launches for BERT), writing and re-reading the hidden state in between.
"""

import math

import torch
import triton
import triton.language as tl

from transfuse.kernels._config import INTERPRET, pdl, wait_for_previous_kernel
from transfuse.kernels.norm import (
    MAX_N,
    NormConfig,
    _check_affine,
    _check_runnable,
    _device_guard,
    _layer_norm_rows,
    _round_to,
    norm_config,
    program_rows,
)

MAX_LOOKUPS = 4  # BERT has 3; the kernel has one pointer slot per lookup
_TABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _gather_rows(idx_ptr, stride_idx_d0, stride_idx_d1, table_ptr, stride_table_row, num_embeddings,
                 rows_d0, rows_d1, row_mask, cols, col_mask):
    """(table[idx[d0, d1], :] in fp32, whether idx was in range) for each row; out-of-range rows
    read nothing and come back as zeros."""
    idx = tl.load(idx_ptr + rows_d0 * stride_idx_d0 + rows_d1 * stride_idx_d1, mask=row_mask, other=0)
    idx = idx.to(tl.int64)  # int64 before multiplying: a 250k x 4096 table passes 2^31 elements
    in_range = (idx >= 0) & (idx < num_embeddings)
    ptrs = table_ptr + (idx * stride_table_row)[:, None] + cols[None, :]
    vals = tl.load(ptrs, mask=(row_mask & in_range)[:, None] & col_mask[None, :], other=0.0)
    return vals.to(tl.float32), in_range


@triton.jit(do_not_specialize=["n_rows", "size_d1", "stride_idx0_d0", "stride_idx1_d0", "stride_idx2_d0",
                               "stride_idx3_d0"])  # these change with every input shape
def _embedding_layer_norm_fwd_kernel(
    idx0_ptr, stride_idx0_d0, stride_idx0_d1, table0_ptr, stride_table0_row, num_embeddings0,
    idx1_ptr, stride_idx1_d0, stride_idx1_d1, table1_ptr, stride_table1_row, num_embeddings1,
    idx2_ptr, stride_idx2_d0, stride_idx2_d1, table2_ptr, stride_table2_row, num_embeddings2,
    idx3_ptr, stride_idx3_d0, stride_idx3_d1, table3_ptr, stride_table3_row, num_embeddings3,
    weight_ptr, bias_ptr,
    out_ptr, stride_out_row,
    n_rows, size_d1, n_cols, eps,
    NUM_LOOKUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BF16_RNE_BY_HAND: tl.constexpr,
    PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (_config.pdl)
):
    wait_for_previous_kernel(PDL)
    # Row r is position (r // size_d1, r % size_d1) of the broadcast index grid; an index broadcast
    # along a dim has stride 0 there (positions (1, S) against ids (B, S)).
    rows, rows_d0, rows_d1, row_mask, cols, col_mask, mask = program_rows(n_rows, size_d1, n_cols, BLOCK_N,
                                                                          ROWS_PER_PROGRAM)

    x, in_range = _gather_rows(idx0_ptr, stride_idx0_d0, stride_idx0_d1, table0_ptr, stride_table0_row,
                               num_embeddings0, rows_d0, rows_d1, row_mask, cols, col_mask)
    # Eager adds in the tables' dtype, left to right: round after every add, bit for bit.
    if NUM_LOOKUPS > 1:
        e, ok = _gather_rows(idx1_ptr, stride_idx1_d0, stride_idx1_d1, table1_ptr, stride_table1_row,
                             num_embeddings1, rows_d0, rows_d1, row_mask, cols, col_mask)
        x = _round_to(x + e, table0_ptr.dtype.element_ty, BF16_RNE_BY_HAND).to(tl.float32)
        in_range = in_range & ok
    if NUM_LOOKUPS > 2:
        e, ok = _gather_rows(idx2_ptr, stride_idx2_d0, stride_idx2_d1, table2_ptr, stride_table2_row,
                             num_embeddings2, rows_d0, rows_d1, row_mask, cols, col_mask)
        x = _round_to(x + e, table0_ptr.dtype.element_ty, BF16_RNE_BY_HAND).to(tl.float32)
        in_range = in_range & ok
    if NUM_LOOKUPS > 3:
        e, ok = _gather_rows(idx3_ptr, stride_idx3_d0, stride_idx3_d1, table3_ptr, stride_table3_row,
                             num_embeddings3, rows_d0, rows_d1, row_mask, cols, col_mask)
        x = _round_to(x + e, table0_ptr.dtype.element_ty, BF16_RNE_BY_HAND).to(tl.float32)
        in_range = in_range & ok

    y = _layer_norm_rows(x, mask, cols, col_mask, n_cols, eps, weight_ptr, bias_ptr, HAS_WEIGHT, HAS_BIAS)
    y = tl.where(in_range[:, None], y, float("nan"))  # no row to read: NaN, see the module docstring
    y = _round_to(y, out_ptr.dtype.element_ty, BF16_RNE_BY_HAND)
    tl.store(out_ptr + rows[:, None] * stride_out_row + cols[None, :], y, mask=mask)


# ---------------------------------------------------------------------------------------------
# Launcher: check, allocate, pick the grid, launch.


def check_embedding_layer_norm_args(indices, tables, weight, bias) -> tuple[torch.dtype, tuple]:
    """Raise on arguments the kernel does not take; return (output dtype, broadcast index shape).
    weight and bias may have the tables' dtype or fp32, as for transfuse.layer_norm."""
    if not 1 <= len(tables) <= MAX_LOOKUPS or len(indices) != len(tables):
        raise ValueError(
            f"transfuse embedding_layer_norm: 1 to {MAX_LOOKUPS} lookups with one index tensor per table, got "
            f"{len(indices)} index tensors and {len(tables)} tables")
    first = tables[0]
    for i, (idx, table) in enumerate(zip(indices, tables)):
        if table.dim() != 2 or table.dtype not in _TABLE_DTYPES:
            raise TypeError(f"transfuse embedding_layer_norm: table {i} must be a 2-D float16, bfloat16 or float32 "
                            f"tensor, got {tuple(table.shape)} {table.dtype}")
        if table.dtype != first.dtype or table.shape[1] != first.shape[1]:
            raise ValueError(f"transfuse embedding_layer_norm: table {i} is {tuple(table.shape)} {table.dtype}, table "
                             f"0 {tuple(first.shape)} {first.dtype}: all need one dtype and one embedding size")
        if idx.dtype not in _INDEX_DTYPES:
            raise TypeError(f"transfuse embedding_layer_norm: index {i} must be int32 or int64, got {idx.dtype}")
        if idx.device != first.device or table.device != first.device:
            raise ValueError(f"transfuse embedding_layer_norm: index {i} or table {i} is not on {first.device}")
    if first.shape[1] > MAX_N:
        raise ValueError(f"transfuse embedding_layer_norm: embedding size {first.shape[1]} is more than MAX_N={MAX_N}")
    _check_affine(weight, first, "weight", (first.dtype, torch.float32))
    _check_affine(bias, first, "bias", (first.dtype, torch.float32))
    return first.dtype, tuple(torch.broadcast_shapes(*(idx.shape for idx in indices)))


def embedding_layer_norm_fwd(
    indices: list[torch.Tensor],
    tables: list[torch.Tensor],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    config: NormConfig | None = None,
) -> torch.Tensor:
    """layer_norm(sum_i F.embedding(indices[i], tables[i])) over the last dim, summed left to right
    in the tables' dtype. Returns a contiguous (*broadcast index shape, N) tensor."""
    out_dtype, shape = check_embedding_layer_norm_args(indices, tables, weight, bias)
    n_cols = tables[0].shape[1]
    out = torch.empty((*shape, n_cols), dtype=out_dtype, device=tables[0].device)
    n_rows = math.prod(shape)
    if n_rows == 0 or n_cols == 0:
        return out
    _check_runnable(tables[0])
    if n_rows >= 2**31:
        raise ValueError(f"transfuse embedding_layer_norm: {n_rows} rows do not fit the int32 row index")
    # Every index seen on one (d0, d1) grid: broadcast_to gives stride 0 along broadcast dims, and
    # the reshape stays a view unless more than two leading dims do not collapse (then it copies).
    grid_shape = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
    slots = []
    for idx, table in zip(indices, tables):
        idx = idx.broadcast_to(shape).reshape(grid_shape)
        table = table if table.stride(1) == 1 else table.contiguous()
        slots.append((idx, idx.stride(0), idx.stride(1), table, table.stride(0), table.shape[0]))
    # Unused slots get the first lookup: a valid address the kernel never dereferences (constexpr-guarded).
    slots += [slots[0]] * (MAX_LOOKUPS - len(slots))
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    config = config or norm_config(n_rows, n_cols)
    grid = (triton.cdiv(n_rows, config.ROWS_PER_PROGRAM),)
    with _device_guard(out):
        _embedding_layer_norm_fwd_kernel[grid](
            *(a for slot in slots for a in slot),
            weight if weight is not None else out, bias if bias is not None else out,
            out, n_cols,
            n_rows, grid_shape[1], n_cols, eps,
            NUM_LOOKUPS=len(tables),
            BLOCK_N=config.BLOCK_N,
            ROWS_PER_PROGRAM=config.ROWS_PER_PROGRAM,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            BF16_RNE_BY_HAND=INTERPRET and out_dtype == torch.bfloat16,
            num_warps=config.num_warps,
            **pdl(out),
        )
    return out
