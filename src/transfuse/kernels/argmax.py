"""Row-wise argmax over a vocabulary, torch.argmax's index in one or two short launches.

    x:   (rows, vocab) fp16 / bf16 / fp32, any strides (a view such as logits[:, -1])
    out: (rows,) int64, the first index of the row's maximum

NaN counts as larger than every number, as in torch.argmax: a row with a NaN gives its first NaN's
index. -0.0 and 0.0 are equal (the first of them wins), +-inf are ordinary values, and a row of -inf
gives 0. Values are compared in fp32, which holds fp16 and bf16 exactly: argmax(x.float()) ==
argmax(x), so greedy decoding needs no cast of the logits to fp32.

Why not torch.argmax: in a decode step at batch 1 its reduce kernel gives the one row to one block,
which loops over the whole vocabulary: 9.4 us for 1 x 32000 in fp16 on an H100, against ~1 us for a
launch that reads 64 KB spread over a few SMs. Here each row is cut into chunks of BLOCK_V:

1. `_argmax_partial_kernel`, grid (rows, chunks): each program loads its chunk in one go (16
   elements a thread at BLOCK_V=2048 and 4 warps: a single round trip to memory, nothing to loop
   over) and keeps the chunk's first maximum (value in fp32, index);
2. `_argmax_combine_kernel`, grid (rows,): the first maximum over the row's chunk results.

A vocabulary of 32000 is 16 programs in step 1, each on its own SM: the launch is bound by one
memory latency, not by one SM's bandwidth. A row that fits in one chunk is one launch (step 1 writes
the index). The decode loop fuses step 2 into its bookkeeping kernel (kernels/decode_step.py), so
greedy decoding spends one launch here. (Reasoned from the shapes, not measured: no GPU was at hand
when this was written; bench/ has no figure for it yet.)

Why "max, then the smallest index holding it" rather than tl.argmax: tl.argmax's comparisons are
false for NaN, and chunk results must combine with the same rule as elements; two plain reductions
state the rule directly: first NaN if any, else min{i : x[i] == max}. Reference: torch.argmax itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transfuse.kernels._config import INTERPRET, next_power_of_2, pdl, wait_for_previous_kernel

BLOCK_V = 2048
NONE_INDEX = 2**31 - 1  # an index larger than any position: what a reduction by min ignores
NONE = tl.constexpr(NONE_INDEX)  # the same, readable inside @triton.jit functions (a plain global is not, on a GPU)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _first_max(values, positions, AXIS: tl.constexpr):
    """(value, position) of the first maximum along AXIS, NaN larger than everything (torch.argmax's
    order). values in fp32; positions int32, NONE where there is no element (padding of the block)."""
    is_nan = values != values
    first_nan = tl.min(tl.where(is_nan, positions, NONE), axis=AXIS)
    numbers = tl.where(is_nan, float("-inf"), values)
    best = tl.max(numbers, axis=AXIS)
    first_best = tl.min(tl.where(numbers == tl.expand_dims(best, AXIS), positions, NONE), axis=AXIS)
    has_nan = first_nan != NONE
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, first_nan, first_best)


@triton.jit
def _argmax_partial_kernel(x_ptr, stride_x_row, stride_x_col, vocab, part_value_ptr, part_index_ptr, out_ptr,
                           chunks, blocked_ptr, threshold_ptr, length_ptr,
                           BLOCK_V: tl.constexpr, ONE_CHUNK: tl.constexpr, BLOCKED: tl.constexpr = 0,
                           PDL: tl.constexpr = 0):
    wait_for_previous_kernel(PDL)
    pid_row = tl.program_id(0)
    pid_chunk = tl.program_id(1)
    offs_v = pid_chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = offs_v < vocab
    x = tl.load(x_ptr + pid_row.to(tl.int64) * stride_x_row + offs_v * stride_x_col, mask=inside,
                other=float("-inf")).to(tl.float32)
    if BLOCKED > 0:
        # min-length blocking: while length < threshold[p], the ids of blocked[p] score -inf
        length = tl.load(length_ptr)
        for p in tl.static_range(BLOCKED):
            if length < tl.load(threshold_ptr + p):
                hit = tl.load(blocked_ptr + p * vocab + offs_v, mask=inside, other=0) != 0
                x = tl.where(hit, float("-inf"), x)
    value, index = _first_max(x, tl.where(inside, offs_v, NONE), 0)
    if ONE_CHUNK:
        tl.store(out_ptr + pid_row, index.to(tl.int64))
    else:
        tl.store(part_value_ptr + pid_row * chunks + pid_chunk, value)
        tl.store(part_index_ptr + pid_row * chunks + pid_chunk, index)


@triton.jit
def _argmax_combine_kernel(part_value_ptr, part_index_ptr, out_ptr, chunks, BLOCK_C: tl.constexpr,
                           PDL: tl.constexpr = 0):
    wait_for_previous_kernel(PDL)
    pid_row = tl.program_id(0)
    offs_c = tl.arange(0, BLOCK_C)
    inside = offs_c < chunks
    values = tl.load(part_value_ptr + pid_row * chunks + offs_c, mask=inside, other=float("-inf"))
    indices = tl.load(part_index_ptr + pid_row * chunks + offs_c, mask=inside, other=NONE)
    _, index = _first_max(values, indices, 0)
    tl.store(out_ptr + pid_row, index.to(tl.int64))


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax: x must be (rows, vocab) with vocab > 0, got {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"argmax: x must be fp16, bf16 or fp32, got {x.dtype}")
    if x.shape[1] >= NONE_INDEX:
        raise ValueError(f"argmax: a vocabulary of {x.shape[1]} does not fit int32 positions")
    if not x.is_cuda and not INTERPRET:
        raise RuntimeError(f"argmax runs on CUDA tensors (or anywhere under TRITON_INTERPRET=1); x is on {x.device}")


def argmax_partials(x: torch.Tensor, blocked: torch.Tensor | None = None, thresholds: torch.Tensor | None = None,
                    length: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 alone: (values (rows, chunks) fp32, indices (rows, chunks) int32), each chunk's first
    maximum, for a kernel that combines them itself (kernels/decode_step.py).

    With `blocked` (P, vocab) bool, `thresholds` (P,) and `length` () integers on x's device: the
    argmax of x.masked_fill(blocked[p] & (length < thresholds[p]), -inf) over every p, what Hugging
    Face's min-length processors do to the scores before a greedy choice, read in the same launch
    (no fp32 copy of the scores, no mask built per step)."""
    _check(x)
    rows, vocab = x.shape
    chunks = triton.cdiv(vocab, BLOCK_V)
    values = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    indices = torch.empty(rows, chunks, dtype=torch.int32, device=x.device)
    if blocked is not None:
        if (blocked.dim() != 2 or blocked.shape[1] != vocab or blocked.dtype != torch.bool or not blocked.is_contiguous()
                or thresholds is None or thresholds.shape != (blocked.shape[0],) or length is None or length.numel() != 1):
            raise ValueError("argmax_partials: blocked must be a contiguous (P, vocab) bool tensor, with thresholds "
                             "(P,) and a one-element length")
        masking = (blocked, thresholds, length, blocked.shape[0])
    else:
        masking = (x, x, x, 0)  # stand-ins, never read
    if rows:
        _argmax_partial_kernel[(rows, chunks)](x, x.stride(0), x.stride(1), vocab, values, indices, indices, chunks,
                                               *masking[:3], BLOCK_V=BLOCK_V, ONE_CHUNK=False, BLOCKED=masking[3],
                                               num_warps=4, **pdl(x))
    return values, indices


def argmax_fwd(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for x (rows, vocab): (rows,) int64."""
    _check(x)
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if not rows:
        return out
    chunks = triton.cdiv(vocab, BLOCK_V)
    if chunks == 1:
        block = max(16, next_power_of_2(vocab))
        _argmax_partial_kernel[(rows, 1)](x, x.stride(0), x.stride(1), vocab, out, out, out, 1, x, x, x,
                                          BLOCK_V=block, ONE_CHUNK=True, num_warps=4, **pdl(x))
        return out
    values, indices = argmax_partials(x)
    _argmax_combine_kernel[(rows,)](values, indices, out, chunks, BLOCK_C=max(16, next_power_of_2(chunks)),
                                    num_warps=1, **pdl(x))
    return out
