"""Fixed-address copies of a call's inputs, for a CUDA graph to read: same sizes, same strides.

Same strides, because the captured kernels were traced for them. An expanded input (stride 0 on a
dimension of size > 1: `mask.expand(...)`, T5's position bias broadcast over the batch) cannot be
allocated with its strides and written by `copy_`, which refuses a destination whose elements share
memory. Its buffer is a small dense tensor expanded the same way; `load` writes that small tensor
from one slice of the source (the other slices are the same values).
"""

from __future__ import annotations

import torch


def static_buffer(like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor with `like`'s sizes, strides, dtype and device."""
    shared = [d for d, (n, st) in enumerate(zip(like.shape, like.stride())) if st == 0 and n > 1]
    base_shape = [1 if d in shared else n for d, n in enumerate(like.shape)]
    if _may_overlap(base_shape, like.stride()):
        # Overlap of another kind (as_strided views): dense, in the default layout. The values are
        # what the graph reads; only the layout differs from the trace's.
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    base = torch.empty_strided(base_shape, like.stride(), dtype=like.dtype, device=like.device)
    return base.expand(like.shape) if shared else base


def _may_overlap(shape, stride) -> bool:
    """Whether two indices may address one element: taken by increasing stride, each dimension's
    stride must step past everything the smaller ones span (slices with gaps pass)."""
    span = 1
    for n, st in sorted(((n, st) for n, st in zip(shape, stride) if n > 1), key=lambda p: p[1]):
        if st < span:
            return True
        span += st * (n - 1)
    return False


def load(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """buffer[...] = value, for a buffer from static_buffer (one write per distinct element)."""
    if 0 in buffer.stride():
        for d, (n, st) in enumerate(zip(buffer.shape, buffer.stride())):
            if st == 0 and n > 1:
                buffer, value = buffer.narrow(d, 0, 1), value.narrow(d, 0, 1)
    buffer.copy_(value)
