"""Two more pieces of hand-written attention, read by passes/attention.py's matcher: views that only
split or merge the batch and head dims of the scores, and a floor clamp of the scores.

Older Hugging Face attention (XGLM, FSMT, MVP, TrOCR, ...) computes 3-D scores with `bmm` over
(batch * heads, seq, dim), views them to 4-D to add the (batch, 1, q, k) mask, clamps the sum at
`finfo(dtype).min` and views them back:

    scores = torch.bmm(q, k.transpose(1, 2))                            # (B*H, T, S)
    scores = scores.view(B, H, T, S) + mask                              # (B, 1, T, S) mask
    scores = torch.max(scores, torch.full((), torch.finfo(dtype).min))   # the floor
    probs = softmax(scores.view(B * H, T, S)).view(B, H, T, S).view(B * H, T, S)
    out = torch.bmm(probs, v)

The views change no value, so they are passed through; the 4-D view tells the head count with which
q, k and v are read as (B, H, T, D) for the kernel. The floor makes a key masked with -inf weigh
what one masked with finfo.min does: the mask is clamped at it instead, which gives the same scores
wherever q @ k^T is finite.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from transfuse.passes.graph import arg, kind, same_size, scalar, tensor_meta

_FLOORS = {torch.finfo(d).min for d in (torch.float16, torch.bfloat16, torch.float32)}


def heads_view(node: fx.Node) -> tuple[fx.Node, torch.Size | None] | None:
    """(input, 4-D shape or None) when `node` is a view/reshape between (B*H, T, S) and (B, H, T, S)
    or one that keeps the shape; else None. The 4-D shape is the side that has the heads."""
    if kind(node) not in ("view", "reshape"):
        return None
    src = node.args[0]
    a, b = tensor_meta(src), tensor_meta(node)
    if a is None or b is None:
        return None
    if a.dim() == b.dim() and all(same_size(x, y) for x, y in zip(a.shape, b.shape)):
        return src, None
    three, four = (a, b) if (a.dim(), b.dim()) == (3, 4) else (b, a) if (a.dim(), b.dim()) == (4, 3) else (None, None)
    if three is None or not isinstance(four.shape[1], int):
        return None
    if not (same_size(three.shape[0], four.shape[0] * four.shape[1]) and same_size(three.shape[1], four.shape[2])
            and same_size(three.shape[2], four.shape[3])):
        return None
    return src, four.shape


def floor_clamp(node: fx.Node) -> tuple[fx.Node, float] | None:
    """(scores, floor) for `torch.max(x, full((), finfo.min))`, torch.maximum, `x.clamp(min=finfo.min)`
    or clamp_min, where the floor is the lowest finite value of fp16, bf16 or fp32; else None."""
    if node.op == "call_function" and node.target in (torch.max, torch.maximum) and len(node.args) == 2:
        x, floor = node.args[0], scalar(node.args[1])
    elif (node.op == "call_method" and node.target in ("clamp", "clamp_min")) or (
            node.op == "call_function" and node.target in (torch.clamp, torch.clamp_min)):
        x, floor = node.args[0], scalar(arg(node, 1, "min"))
        if node.target in ("clamp", torch.clamp) and arg(node, 2, "max") is not None:
            return None
    else:
        return None
    if not isinstance(x, fx.Node) or floor not in _FLOORS:
        return None
    return x, floor
