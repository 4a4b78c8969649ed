"""T5's fp16 overflow guard in one or two launches instead of six:

    bound = bound_if_inf if isinf(x).any() else bound_otherwise
    out   = clamp(x, -bound, bound)          (NaN stays NaN, as torch.clamp keeps it)

Hugging Face's T5 layers run this after every sub-layer in fp16 (`torch.where(torch.isinf(h).any(),
finfo.max - 1000, finfo.max)` then `torch.clamp`): eager spends abs, eq, a reduction, where, neg and
clamp on it, 36 times per t5-base decoder step. The bound is rounded to x's dtype before comparing,
as torch does when it clamps an fp16 tensor by fp32 0-d bounds (65504 - 1000 becomes 64512).

The "any" is global over the tensor. A tensor of at most SINGLE_PROGRAM_ELEMENTS (a decode step's
hidden state) is handled by one program that reads it twice; a larger one by a flag kernel (one int8
per block, no zero-fill needed) and a clamp kernel whose programs each reduce all the flags.
Reference: transfuse.reference.clamp.clamp_if_inf_ref.

The BART family's guard (`if not torch.isfinite(h).all(): h = clamp(h, -b, b)`, made a select by
transfuse.branchless) is the same computation with NaN counted as well and an infinite bound when
nothing is found: clamp_if_nonfinite_fwd. Reference: transfuse.reference.clamp.clamp_if_nonfinite_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transfuse.kernels._config import pdl, wait_for_previous_kernel

SINGLE_PROGRAM_ELEMENTS = 1 << 15
BLOCK = 2048


@triton.jit
def _clamp_block(x_ptr, out_ptr, offs, n, bound):
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok).to(tl.float32)
    y = tl.minimum(tl.maximum(x, -bound), bound)
    y = tl.where(x != x, x, y)  # NaN propagates, as in torch.clamp
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _has_inf(x_ptr, offs, n, NAN_TOO: tl.constexpr):
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    found = tl.abs(x) == float("inf")
    if NAN_TOO:
        found = found | (x != x)
    return tl.max(found.to(tl.int32), axis=0)


@triton.jit(do_not_specialize=["n"])
def _clamp_if_inf_single_kernel(x_ptr, out_ptr, n, bound_if_inf, bound_otherwise, BLOCK: tl.constexpr,
                                NAN_TOO: tl.constexpr = 0, PDL: tl.constexpr = 0):
    wait_for_previous_kernel(PDL)
    offs = tl.arange(0, BLOCK)
    found = 0
    for start in range(0, n, BLOCK):
        found = tl.maximum(found, _has_inf(x_ptr, start + offs, n, NAN_TOO))
    bound = tl.where(found > 0, bound_if_inf, bound_otherwise)
    for start in range(0, n, BLOCK):
        _clamp_block(x_ptr, out_ptr, start + offs, n, bound)


@triton.jit(do_not_specialize=["n"])
def _inf_flags_kernel(x_ptr, flags_ptr, n, BLOCK: tl.constexpr, NAN_TOO: tl.constexpr = 0, PDL: tl.constexpr = 0):
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(flags_ptr + pid, _has_inf(x_ptr, offs, n, NAN_TOO).to(tl.int8))


@triton.jit(do_not_specialize=["n", "n_flags"])
def _clamp_by_flags_kernel(x_ptr, out_ptr, flags_ptr, n, n_flags, bound_if_inf, bound_otherwise,
                           BLOCK: tl.constexpr, FLAG_BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    wait_for_previous_kernel(PDL)
    pid = tl.program_id(0)
    found = 0
    for start in range(0, n_flags, FLAG_BLOCK):
        i = start + tl.arange(0, FLAG_BLOCK)
        found = tl.maximum(found, tl.max(tl.load(flags_ptr + i, mask=i < n_flags, other=0).to(tl.int32), axis=0))
    bound = tl.where(found > 0, bound_if_inf, bound_otherwise)
    _clamp_block(x_ptr, out_ptr, pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK), n, bound)


def rounded_bound(value: float, dtype: torch.dtype) -> float:
    """The bound as torch compares it: rounded to the tensor's dtype."""
    return float(torch.tensor(value, dtype=torch.float32).to(dtype).float())


def clamp_if_inf_fwd(x: torch.Tensor, bound_if_inf: float, bound_otherwise: float, nan_too: bool = False) -> torch.Tensor:
    """nan_too: a NaN also counts as found (what `not isfinite(x).all()` tests)."""
    if not x.dtype.is_floating_point:
        raise ValueError(f"clamp_if_inf: x must be floating point, got {x.dtype}")
    src = x if x.is_contiguous() else x.contiguous()
    out = torch.empty_like(src)
    n = src.numel()
    if n == 0:
        return out
    hi, lo = rounded_bound(bound_if_inf, x.dtype), rounded_bound(bound_otherwise, x.dtype)
    if n <= SINGLE_PROGRAM_ELEMENTS:
        _clamp_if_inf_single_kernel[(1,)](src, out, n, hi, lo, BLOCK=BLOCK, NAN_TOO=int(nan_too), num_warps=8,
                                          **pdl(src))
        return out
    n_blocks = triton.cdiv(n, BLOCK)
    flags = torch.empty(n_blocks, dtype=torch.int8, device=x.device)
    _inf_flags_kernel[(n_blocks,)](src, flags, n, BLOCK=BLOCK, NAN_TOO=int(nan_too), num_warps=4, **pdl(src))
    _clamp_by_flags_kernel[(n_blocks,)](src, out, flags, n, n_blocks, hi, lo, BLOCK=BLOCK, FLAG_BLOCK=1024,
                                        num_warps=4, **pdl(src))
    return out


def clamp_if_nonfinite_fwd(x: torch.Tensor, bound: float) -> torch.Tensor:
    """clamp(x, -bound, bound) if x holds an inf or a NaN, else a copy of x."""
    return clamp_if_inf_fwd(x, bound, float("inf"), nan_too=True)
