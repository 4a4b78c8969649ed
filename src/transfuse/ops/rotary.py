"""torch.ops.transfuse.rotary: x * cos + rotate_half(x) * sin in one kernel (transfuse.kernels.rotary;
semantics: transfuse.reference.rotary); torch.ops.transfuse.rotary_pair: the same for an attention's Q
and K in one launch.

Backward: with y1 = x1*c1 - x2*s1 and y2 = x2*c2 + x1*s2 (halves of the last dim),
dx1 = dy1*c1 + dy2*s2 and dx2 = dy2*c2 - dy1*s1, which is the same kernel run on dy with cos and
sin' = -(sin with its halves swapped) (for Hugging Face's cos/sin, whose halves are equal, -sin).
cos and sin get gradients too when they require them (plain PyTorch: they are small)."""

from typing import Optional

import torch

from transfuse.kernels import rotary as kernels


@torch.library.custom_op("transfuse::rotary", mutates_args=())
def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """x: (B, H, S, D); cos, sin broadcastable to x, in x's dtype or fp32. A new contiguous tensor of
    x's shape in out_dtype (None: x's)."""
    return kernels.rotary_fwd(x, cos, sin, out_dtype)


@rotary.register_fake
def _(x, cos, sin, out_dtype=None):
    kernels.check_rotary_args(x, cos, sin)
    return torch.empty_like(x, dtype=out_dtype or x.dtype, memory_format=torch.contiguous_format)


@torch.library.custom_op("transfuse::rotary_pair", mutates_args=())
def rotary_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotary(q, cos, sin, out_dtype), rotary(k, cos, sin, out_dtype)); q and k may have different
    head counts (GQA)."""
    return kernels.rotary_pair_fwd(q, k, cos, sin, out_dtype)


@rotary_pair.register_fake
def _(q, k, cos, sin, out_dtype=None):
    kernels.check_rotary_pair_args(q, k, cos, sin)
    return (torch.empty_like(q, dtype=out_dtype or q.dtype, memory_format=torch.contiguous_format),
            torch.empty_like(k, dtype=out_dtype or k.dtype, memory_format=torch.contiguous_format))


def _backward_sin(sin: torch.Tensor) -> torch.Tensor:
    half = sin.shape[-1] // 2
    return -torch.cat((sin[..., half:], sin[..., :half]), dim=-1)


def _sum_to(t: torch.Tensor, shape) -> torch.Tensor:
    """t summed over the dimensions that were broadcast to reach its shape."""
    lead = t.dim() - len(shape)
    t = t.sum(dim=tuple(range(lead))) if lead else t
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and t.shape[i] != 1)
    return t.sum(dim=dims, keepdim=True) if dims else t


def _table_grads(ctx, dys, xs, cos, sin):
    """d cos and d sin (rarely needed: Hugging Face's tables come from buffers without gradients)."""
    from transfuse.reference.rotary import rotate_half

    dcos = dsin = None
    if ctx.needs_input_grad[-2]:
        dcos = sum(_sum_to((dy * x).float(), cos.shape) for dy, x in zip(dys, xs)).to(cos.dtype)
    if ctx.needs_input_grad[-1]:
        dsin = sum(_sum_to((dy * rotate_half(x)).float(), sin.shape) for dy, x in zip(dys, xs)).to(sin.dtype)
    return dcos, dsin


def _rotary_setup(ctx, inputs, output):
    x, cos, sin, _ = inputs
    ctx.save_for_backward(x if ctx.needs_input_grad[1] or ctx.needs_input_grad[2] else None, cos, sin)
    ctx.x_dtype = x.dtype


def _rotary_backward(ctx, dy):
    # dy has the output's dtype (fp32 under autocast's promotion); dx gets x's, rounded once
    x, cos, sin = ctx.saved_tensors
    dx = rotary(dy, cos, _backward_sin(sin), ctx.x_dtype) if ctx.needs_input_grad[0] else None
    return (dx, *_table_grads(ctx, [dy], [x], cos, sin), None)


rotary.register_autograd(_rotary_backward, setup_context=_rotary_setup)


def _pair_setup(ctx, inputs, output):
    q, k, cos, sin, _ = inputs
    tables = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
    ctx.save_for_backward(q if tables else None, k if tables else None, cos, sin)
    ctx.like = [(t.shape, t.dtype, t.device) for t in output]  # for a gradient that arrives as None
    ctx.x_dtype = q.dtype


def _pair_backward(ctx, dq, dk):
    q, k, cos, sin = ctx.saved_tensors
    dq, dk = (torch.zeros(shape, dtype=dtype, device=device) if g is None else g
              for g, (shape, dtype, device) in zip((dq, dk), ctx.like))
    gq, gk = rotary_pair(dq, dk, cos, _backward_sin(sin), ctx.x_dtype)
    return (gq, gk, *_table_grads(ctx, [dq, dk], [q, k], cos, sin), None)


rotary_pair.register_autograd(_pair_backward, setup_context=_pair_setup)
