"""The decode loop's bookkeeping after each token choice, in one launch (runtime/decode_loop.py).

Per step, for rows b < batch, on the loop's fixed buffers (names as in decode_loop._Buffers):

    token[b]      = first argmax over the chunk results (FROM_PARTIALS, kernels/argmax.py)
                    or chosen[b] (a sampled token)
    if HAS_EOS:     token[b] = token[b] if unfinished[b] else pad
                    unfinished[b] &= token[b] not in eos
    out[b, step]  = token[b];   tokens[b] = token[b]
    all_done      = not any(unfinished);   done[step] = all_done
    step += 1;    cur_len += 1
    if ADVANCE:     mask[b, column] = 1;  column += 1;  positions[b] += 1

This is Hugging Face's `_sample` bookkeeping (where, isin, logical_and, index_copy, any, the
increments, the new mask column): written with torch ops it is about fifteen launches of a
microsecond or so each inside the step's CUDA graph, for a few bytes of work; here it is one, and
for greedy decoding it also finishes the argmax (the chunk results of kernels/argmax.py). One
program walks the rows in blocks (any batch size): "all rows finished" needs every row anyway.
Reference: the torch version in tests/runtime/test_decode_step.py.

The counters (step, column, cur_len) are read at the start and written at the end by the same
program; a barrier before the writes keeps every warp's reads ahead of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transfuse.kernels._config import INTERPRET, next_power_of_2, pdl, wait_for_previous_kernel
from transfuse.kernels.argmax import NONE, _first_max

ELEMENTS_PER_BLOCK = 2048  # rows x chunk results held at once by the one program


@triton.jit
def _decode_step_fwd_kernel(
    part_value_ptr, part_index_ptr, chunks,
    chosen_ptr,
    batch,
    unfinished_ptr, pad_ptr, eos_ptr, n_eos,
    out_ptr, stride_out_row, done_ptr, all_done_ptr, step_ptr, cur_len_ptr, tokens_ptr, stride_tokens_row,
    mask_ptr, stride_mask_row, mask_len, column_ptr, positions_ptr, stride_positions_row,
    FROM_PARTIALS: tl.constexpr,
    HAS_EOS: tl.constexpr,
    ADVANCE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    wait_for_previous_kernel(PDL)
    step = tl.load(step_ptr)
    cur_len = tl.load(cur_len_ptr)
    if ADVANCE:
        column = tl.load(column_ptr)
    if HAS_EOS:
        pad = tl.load(pad_ptr)
        offs_e = tl.arange(0, BLOCK_E)
        eos = tl.load(eos_ptr + offs_e, mask=offs_e < n_eos, other=-1)
    any_unfinished = tl.zeros([BLOCK_B], dtype=tl.int32)
    for start in range(0, batch, BLOCK_B):
        rows = start + tl.arange(0, BLOCK_B)
        inside = rows < batch
        if FROM_PARTIALS:
            offs_c = tl.arange(0, BLOCK_C)
            at = rows[:, None] * chunks + offs_c[None, :]
            both = inside[:, None] & (offs_c[None, :] < chunks)
            values = tl.load(part_value_ptr + at, mask=both, other=float("-inf"))
            indices = tl.load(part_index_ptr + at, mask=both, other=NONE)
            _, token = _first_max(values, indices, 1)
            token = token.to(tl.int64)
        else:
            token = tl.load(chosen_ptr + rows, mask=inside, other=0)
        if HAS_EOS:
            unfinished = tl.load(unfinished_ptr + rows, mask=inside, other=0) != 0
            token = tl.where(unfinished, token, pad)
            is_eos = tl.max(((token[:, None] == eos[None, :]) & (offs_e[None, :] < n_eos)).to(tl.int32), axis=1)
            unfinished = unfinished & (is_eos == 0)
            tl.store(unfinished_ptr + rows, unfinished.to(tl.uint8), mask=inside)
        else:
            unfinished = tl.load(unfinished_ptr + rows, mask=inside, other=0) != 0
        any_unfinished = tl.maximum(any_unfinished, (unfinished & inside).to(tl.int32))
        tl.store(out_ptr + rows.to(tl.int64) * stride_out_row + step, token, mask=inside)
        tl.store(tokens_ptr + rows * stride_tokens_row, token, mask=inside)
        if ADVANCE:
            mask_ptrs = mask_ptr + rows.to(tl.int64) * stride_mask_row + column
            one = tl.full([BLOCK_B], 1, mask_ptr.dtype.element_ty)
            tl.store(mask_ptrs, one, mask=inside & (column < mask_len))
            position_ptrs = positions_ptr + rows * stride_positions_row
            tl.store(position_ptrs, tl.load(position_ptrs, mask=inside) + 1, mask=inside)
    all_done = (tl.max(any_unfinished, axis=0) == 0).to(tl.uint8)
    tl.debug_barrier()  # every warp has read the counters before they move on
    tl.store(all_done_ptr, all_done)
    tl.store(done_ptr + step, all_done)
    tl.store(step_ptr, step + 1)
    tl.store(cur_len_ptr, cur_len + 1)
    if ADVANCE:
        tl.store(column_ptr, column + 1)


def _flags(t: torch.Tensor) -> torch.Tensor:
    """A bool buffer as bytes: what Triton loads and stores without an i1 pointer."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def decode_step_fwd(*, tokens: torch.Tensor, step: torch.Tensor, cur_len: torch.Tensor, out: torch.Tensor,
                    done: torch.Tensor, all_done: torch.Tensor, unfinished: torch.Tensor,
                    partials: tuple[torch.Tensor, torch.Tensor] | None = None, chosen: torch.Tensor | None = None,
                    pad: torch.Tensor | None = None, eos: torch.Tensor | None = None,
                    mask: torch.Tensor | None = None, column: torch.Tensor | None = None,
                    positions: torch.Tensor | None = None) -> None:
    """Writes one step's bookkeeping into the buffers (see the module docstring), in place.

    tokens (B, 1) int64; step (1,) int64; cur_len () int64; out (B, max_new) int64, contiguous;
    done (max_new,) bool; all_done () bool; unfinished (B,) bool; partials: argmax_partials' two
    (B, chunks) results, or chosen (B,) int64; pad () int64 and eos (E,) int64 together or neither;
    mask (B, L) of any dtype (a new column of ones), column (1,) int64 and positions (B, 1) int64
    together or none."""
    batch = tokens.shape[0]
    if (partials is None) == (chosen is None):
        raise ValueError("decode_step: give either the argmax partials or the chosen tokens")
    if (pad is None) != (eos is None) or len({mask is None, column is None, positions is None}) != 1:
        raise ValueError("decode_step: pad and eos, and mask, column and positions, go together")
    if out.stride(1) != 1:
        raise ValueError("decode_step: out must have unit stride along its columns")
    if not tokens.is_cuda and not INTERPRET:
        raise RuntimeError("decode_step runs on CUDA tensors (or anywhere under TRITON_INTERPRET=1); "
                           f"not on {tokens.device}")
    chunks = partials[0].shape[1] if partials is not None else 1
    block_c = next_power_of_2(chunks)
    block_b = min(next_power_of_2(batch), max(1, ELEMENTS_PER_BLOCK // block_c))
    values, indices = partials if partials is not None else (out, out)
    advance = mask is not None
    has_eos = eos is not None and eos.numel() > 0
    flags = _flags(unfinished)
    _decode_step_fwd_kernel[(1,)](
        values, indices, chunks,
        chosen if chosen is not None else out,
        batch,
        flags, pad if has_eos else out, eos if has_eos else out, eos.numel() if has_eos else 0,
        out, out.stride(0), _flags(done), _flags(all_done), step, cur_len, tokens, tokens.stride(0),
        _flags(mask) if advance else out, mask.stride(0) if advance else 0, mask.shape[1] if advance else 0,
        column if advance else out, positions if advance else out, positions.stride(0) if advance else 0,
        FROM_PARTIALS=partials is not None, HAS_EOS=has_eos, ADVANCE=advance,
        BLOCK_B=block_b, BLOCK_C=block_c, BLOCK_E=max(2, next_power_of_2(eos.numel() if has_eos else 1)),
        num_warps=1, **pdl(tokens),
    )
