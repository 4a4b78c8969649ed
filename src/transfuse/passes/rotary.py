"""Rotary position embedding, rotate-half form, as one kernel (`RotaryEmbedding`).

Matched by meaning, as Llama, Mistral, Qwen2, Gemma and Phi-3 write it (partial rotary included: the
rotated slice is what is matched):

    x * cos + cat((-x[..., h:], x[..., :h]), dim=-1) * sin        with 2h = x.shape[-1]

either operand order of the add and of each multiply. Six to eight kernels per tensor (two slices,
a negation, a concatenation, two multiplies, an add) become one read of x, cos and sin and one write
(transfuse.ops.rotary). Under autocast x is bf16 (or fp16) and Hugging Face's tables fp32: eager's
result is fp32, which the op writes too, or writes in x's dtype when only casts back to it read the
result (_casts_back). Left alone, with the reason, for other mixes of dtypes or cos/sin that do not
broadcast to x. The interleaved (GPT-J) form is not
matched.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from transfuse.passes.graph import kind, node_order, same_shape, shape, tensor_meta
from transfuse.passes.manager import PassContext

PATTERN = "RotaryEmbedding"


def _operands(node: fx.Node, k: str) -> tuple | None:
    """The two tensor operands of an add/mul node (function or method form), else None."""
    if kind(node) != k or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    return (a, b) if isinstance(a, fx.Node) and isinstance(b, fx.Node) else None


def _last_dim_slice(node) -> tuple | None:
    """(x, start, stop) for `x[..., start:stop]` with int bounds (None for an open end)."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not operator.getitem:
        return None
    x, index = node.args
    if not isinstance(index, tuple) or len(index) != 2 or index[0] is not Ellipsis or not isinstance(index[1], slice):
        return None
    s = index[1]
    if s.step not in (None, 1) or not all(v is None or isinstance(v, int) for v in (s.start, s.stop)):
        return None
    return x, s.start, s.stop


def _rotated(node) -> fx.Node | None:
    """x when node is cat((-x[..., h:], x[..., :h]), dim=-1) with 2h = x's last dim."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not torch.cat:
        return None
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    x_shape = shape(node)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or x_shape is None or dim not in (-1, len(x_shape) - 1):
        return None
    neg, first = parts
    if not isinstance(neg, fx.Node) or kind(neg) != "neg" or len(neg.args) != 1:
        return None
    upper, lower = _last_dim_slice(neg.args[0]), _last_dim_slice(first)
    if upper is None or lower is None or upper[0] is not lower[0]:
        return None
    x = upper[0]
    d = shape(x)[-1] if shape(x) is not None else None
    if not isinstance(d, int) or d % 2:
        return None
    h = d // 2
    if upper[1:] not in ((h, None), (h, d)) or lower[1:] not in ((None, h), (0, h)):
        return None
    return x


def _match(add: fx.Node):
    """(x, cos, sin) when add is x * cos + rotate_half(x) * sin, else None."""
    terms = _operands(add, "add")
    if terms is None:
        return None
    for plain, turned in (terms, terms[::-1]):
        pm, tm = _operands(plain, "mul"), _operands(turned, "mul")
        if pm is None or tm is None:
            continue
        for rot, sin in (tm, tm[::-1]):
            x = _rotated(rot)
            if x is None:
                continue
            if pm[0] is x:
                return x, pm[1], sin
            if pm[1] is x:
                return x, pm[0], sin
    return None


def run(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method"):
            continue
        found = _match(node)
        if found is None:
            continue
        x, cos, sin = found
        tx, tc, ts, out = (tensor_meta(n) for n in (x, cos, sin, node))
        if any(t is None for t in (tx, tc, ts, out)):
            continue
        if tx.dim() != 4:
            ctx.reject(PATTERN, node, f"x has {tx.dim()} dimensions (the kernel takes batch, heads, seq, head_dim)")
            continue
        promoted = tc.dtype == ts.dtype == out.dtype == torch.float32 and tx.dtype in (torch.float16, torch.bfloat16)
        if not (tx.dtype == tc.dtype == ts.dtype == out.dtype or promoted):
            ctx.reject(PATTERN, node, f"dtypes differ (x {tx.dtype}, cos {tc.dtype}, sin {ts.dtype}, out {out.dtype})")
            continue
        if tc.dim() > 4 or ts.dim() > 4 or not same_shape(tuple(out.shape), tuple(tx.shape)):
            ctx.reject(PATTERN, node, "cos/sin do not broadcast to x's shape")
            continue
        casts = _casts_back(node, tx.dtype) if promoted else []
        args = (x, cos, sin) if not promoted else (x, cos, sin, tx.dtype if casts else torch.float32)
        with graph.inserting_before(node):
            fused = graph.call_function(torch.ops.transfuse.rotary.default, args)
        fused.meta.update(node.meta)
        if casts:  # written in x's dtype: the casts that read it are the op itself now
            fused.meta["example_value"] = out.to(tx.dtype)
            for cast in casts:
                cast.replace_all_uses_with(fused)
                graph.erase_node(cast)
        else:
            node.replace_all_uses_with(fused)
        graph.erase_node(node)
        ctx.matched(PATTERN)
    _pair_up(ctx)


def _casts_back(node: fx.Node, dtype: torch.dtype) -> list[fx.Node]:
    """The readers of node when every one is `.to(dtype)`, else []. Under autocast Hugging Face's
    rotation of a bf16 x by fp32 tables is fp32, and SDPA reads it cast back to bf16 (the attention
    pass writes autocast's casts as `.to`): the kernel then writes bf16 itself, the same fp32
    arithmetic rounded once, with no fp32 tensor between."""
    users = list(node.users)
    ok = users and all(kind(u) == "to" and u.args[0] is node and tensor_meta(u) is not None
                       and tensor_meta(u).dtype == dtype and tensor_meta(u).device == tensor_meta(node).device
                       for u in users)
    return users if ok else []


def _pair_up(ctx: PassContext) -> None:
    """Two rotations with the same cos and sin (an attention's Q and K) become one launch
    (transfuse.rotary_pair), placed where both inputs exist and neither output is used yet."""
    graph = ctx.gm.graph
    order = node_order(graph)
    waiting: dict = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.transfuse.rotary.default:
            continue
        key = (node.args[1], node.args[2], node.args[3] if len(node.args) > 3 else None)
        first = waiting.pop(key, None)
        if first is None:
            waiting[key] = node
            continue
        # At the second rotation when nothing reads the first before it (Llama), else at the first
        # when the second's input already exists there (Phi-3 concatenates q before slicing k).
        if all(order[u] > order[node] for u in first.users):
            at = node
        elif order[node.args[0]] < order[first]:
            at = first
        else:
            waiting[key] = node
            continue
        q_meta, k_meta = tensor_meta(first.args[0]), tensor_meta(node.args[0])
        if q_meta.dtype != k_meta.dtype or str(q_meta.shape[0]) != str(k_meta.shape[0]) \
                or str(q_meta.shape[2:]) != str(k_meta.shape[2:]):
            waiting[key] = node
            continue
        with graph.inserting_before(at):
            pair = graph.call_function(torch.ops.transfuse.rotary_pair.default,
                                       (first.args[0], node.args[0], *(key if key[2] is not None else key[:2])))
            outs = [graph.call_function(operator.getitem, (pair, i)) for i in (0, 1)]
        for old, new in zip((first, node), outs):
            new.meta.update(old.meta)
            old.replace_all_uses_with(new)
            graph.erase_node(old)
        ctx.matched("RotaryPair")
