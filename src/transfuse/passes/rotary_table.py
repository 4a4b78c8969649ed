"""Hugging Face's rotary cos/sin tables as one kernel (`RotaryTable`).

LlamaRotaryEmbedding.forward (transformers/models/llama/modeling_llama.py; Mistral, Qwen2, Gemma,
Phi-3 and others copy it) computes, once per forward:

    freqs = (inv_freq[None, :, None].float().expand(B, -1, 1) @ position_ids[:, None, :].float()).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    return cos.to(x.dtype), sin.to(x.dtype)

seven launches in a decode step (a K=1 GEMM, the concatenation, cos, sin, two multiplies, two
casts) that transfuse.rotary_table does in one. Matched by meaning, not by names or constants: a
cos and a sin of the same cat((f, f)) on the last dim, f the transpose of the last two dims of a
3-D matmul whose operands are a 1-D tensor laid out as (1 or B, D/2, 1) and a 2-D (B, S) tensor laid
out as (B, 1, S), both reached through dimension-inserting views (indexing with None, unsqueeze,
expand) and casts that keep their values or round them once, to fp32 (what the kernel does); then,
on each side, an optional multiply by a constant scalar and an optional cast to fp16/bf16/fp32
(the same for cos and sin). Intermediates read elsewhere stay as they are; only the two outputs are
replaced. Left alone, with the reason, when any of that does not hold.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from transfuse.passes.graph import (arg, is_last_two_transpose, kind, method_name, node_order, positive_dim, same_shape,
                                   same_size, scalar, tensor_meta)
from transfuse.passes.manager import PassContext

PATTERN = "RotaryTable"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the kernel writes
_CASTS = {"to", "type", "float", "half", "bfloat16", "double", "type_as"}
_SAME_VALUES = {"contiguous", "clone", "detach"}
_CATS = (torch.cat, torch.concat, torch.concatenate)


# ---- values: casts that keep them, or round them once to fp32

def _exact(src: torch.dtype, dst: torch.dtype) -> bool:
    """Every value of src is a value of dst."""
    if src == dst:
        return True
    if not dst.is_floating_point:
        return (not src.is_floating_point and src != torch.bool
                and torch.iinfo(dst).min <= torch.iinfo(src).min and torch.iinfo(dst).max >= torch.iinfo(src).max)
    d = torch.finfo(dst)
    if src.is_floating_point:
        s = torch.finfo(src)
        return d.eps <= s.eps and d.max >= s.max and d.tiny <= s.tiny
    if src == torch.bool:
        return True
    info = torch.iinfo(src)
    digits = 2 - math.frexp(d.eps)[1]  # significand bits of dst: eps = 2^(1 - digits)
    return max(abs(info.min), info.max).bit_length() <= digits


def _casts_to_fp32(dtypes: list[torch.dtype]) -> bool:
    """Whether casting a value through `dtypes` (the root's first, fp32 last) gives what one cast of
    the root to fp32 gives: every step exact, or a single rounding that lands straight on fp32."""
    rounded = False
    for src, dst in zip(dtypes, dtypes[1:]):
        if _exact(src, dst):
            continue
        if rounded or dst != torch.float32:
            return False
        rounded = True
    return dtypes[-1] == torch.float32


# ---- layouts: dimension-inserting views, tracked per dimension of the root

def _getitem_dims(index, ndim: int, dims: list[int]) -> list[int] | None:
    """Where dims (of an ndim tensor) land after `t[index]`, when index holds only None, `:` and `...`."""
    items = index if isinstance(index, tuple) else (index,)
    if any(not (i is None or i is Ellipsis or (isinstance(i, slice) and i == slice(None))) for i in items):
        return None
    if sum(i is Ellipsis for i in items) > 1:
        return None
    taken = sum(isinstance(i, slice) for i in items)
    if taken > ndim:
        return None
    expanded: list = []
    for i in items:
        expanded += [slice(None)] * (ndim - taken) if i is Ellipsis else [i]
    if Ellipsis not in items:
        expanded += [slice(None)] * (ndim - taken)
    where, src = {}, 0
    for out, i in enumerate(expanded):
        if i is not None:
            where[src] = out
            src += 1
    return [where[d] for d in dims]


def _step(node: fx.Node, source: fx.Node, dims: list[int]) -> list[int] | None:
    """Where the root's dims (at `dims` of source) are in node, a view or cast of source; None when
    node is neither or moves data some other way."""
    src, out = tensor_meta(source), tensor_meta(node)
    if src is None or out is None or not node.args or node.args[0] is not source:
        return None
    if node.op == "call_method" and method_name(node) in _CASTS | _SAME_VALUES:
        return dims if same_shape(tuple(out.shape), tuple(src.shape)) else None
    if node.op == "call_function" and node.target is operator.getitem:
        return _getitem_dims(node.args[1], src.dim(), dims)
    is_method = node.op == "call_method"
    name = method_name(node) if is_method else getattr(node.target, "__name__", "")
    if name == "unsqueeze" and (is_method or node.target is torch.unsqueeze):
        d = arg(node, 1, "dim")
        if not isinstance(d, int):
            return None
        d = positive_dim(d, src.dim() + 1)
        return [p + 1 if p >= d else p for p in dims]
    if name == "expand" and is_method:
        # New dimensions go in front; the tracked ones keep their sizes (checked on the final shape).
        return [p + out.dim() - src.dim() for p in dims]
    return None


def _source(node: fx.Node) -> fx.Node | None:
    first = node.args[0] if node.args else None
    return first if isinstance(first, fx.Node) else None


def _root(operand: fx.Node, ndim: int, want: list[int]) -> fx.Node | None:
    """The farthest tensor of `ndim` dims that `operand` is, through views and casts: its dims at
    positions `want` of operand with their sizes, its values cast once to fp32."""
    chain = [operand]
    while True:
        src = _source(chain[-1])
        if src is None or tensor_meta(src) is None or _step(chain[-1], src, list(range(tensor_meta(src).dim()))) is None:
            break
        chain.append(src)
    shape = tensor_meta(operand).shape
    for start in range(len(chain) - 1, -1, -1):  # the farthest candidate first: more of the chain dies
        root = chain[start]
        meta = tensor_meta(root)
        if meta is None or meta.dim() != ndim or meta.dtype == torch.bool or meta.is_complex():
            continue
        dims, dtypes = list(range(ndim)), [meta.dtype]
        for i in range(start, 0, -1):
            dims = _step(chain[i - 1], chain[i], dims)
            if dims is None:
                break
            dtypes.append(tensor_meta(chain[i - 1]).dtype)
        if dims == want and _casts_to_fp32(dtypes) and same_shape([shape[d] for d in want], list(meta.shape)):
            return root
    return None


# ---- outputs: cos/sin, then an optional scale and an optional cast

def _unary(node: fx.Node, name: str) -> bool:
    if node.op == "call_method":
        return node.target == name and len(node.args) == 1 and not node.kwargs
    return node.op == "call_function" and node.target is getattr(torch, name) and len(node.args) == 1 and not node.kwargs


def _scale_of(node: fx.Node, x: fx.Node) -> float | None:
    """c when node is x * c (either order) with c a constant scalar."""
    if kind(node) != "mul" or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    other = b if a is x else a if b is x else None
    if other is None or other is x:
        return None
    return scalar(other)


def _output(node: fx.Node) -> tuple[fx.Node, float, torch.dtype]:
    """(the last node of `node` [* c] [.to(dtype)], c, dtype), each step taken only when it is
    node's one reader and keeps the shape; fp32 and 1.0 when absent."""
    end, scaling = node, 1.0
    users = list(end.users)
    if len(users) == 1:
        c = _scale_of(users[0], end)
        meta = tensor_meta(users[0])
        if c is not None and meta is not None and meta.dtype == torch.float32 \
                and same_shape(meta.shape, tensor_meta(end).shape):
            end, scaling = users[0], c
    users = list(end.users)
    if len(users) == 1 and users[0].op == "call_method" and method_name(users[0]) in _CASTS and _source(users[0]) is end:
        src, meta = tensor_meta(end), tensor_meta(users[0])
        if meta is not None and meta.dtype in _DTYPES and same_shape(meta.shape, src.shape) and meta.device == src.device:
            end = users[0]
    return end, scaling, tensor_meta(end).dtype


# ---- the table

def _table(cat: fx.Node) -> tuple | str:
    """(inv_freq, positions) for HF's emb = cat((freqs, freqs), -1), else the reason it is not one."""
    parts = arg(cat, 0, "tensors")
    freqs = parts[0]
    meta = tensor_meta(cat)
    dim = arg(cat, 1, "dim", 0)
    if meta is None or meta.dim() != 3 or not isinstance(dim, int) or positive_dim(dim, 3) != 2:
        return "the frequencies are not concatenated with themselves along the last of 3 dims"
    if not (kind(freqs) in ("transpose", "permute") and is_last_two_transpose(freqs)):
        return "the concatenated frequencies are not a transpose of the last two dims"
    matmul = _source(freqs)
    if matmul is None or kind(matmul) != "matmul" or len(matmul.args) != 2 or matmul.kwargs:
        return "the transposed frequencies are not a matmul"
    a, b = matmul.args
    metas = [tensor_meta(t) for t in (matmul, a, b)]
    if any(m is None or m.dim() != 3 or m.dtype != torch.float32 for m in metas):
        return "the matmul is not of 3-D fp32 tensors (autocast on?)"
    out, ma, mb = metas
    if not (same_size(ma.shape[2], 1) and same_size(mb.shape[1], 1)):
        return "the matmul is not an outer product (K != 1)"
    inv_freq = _root(a, 1, [1])
    positions = _root(b, 2, [0, 2])
    if inv_freq is None:
        return "the matmul's left operand is not a 1-D tensor viewed as (B, D/2, 1) in fp32"
    if positions is None:
        return "the matmul's right operand is not a 2-D (B, S) tensor viewed as (B, 1, S) in fp32"
    batch = tensor_meta(positions).shape[0]
    if not same_size(out.shape[0], batch) or not (same_size(ma.shape[0], 1) or same_size(ma.shape[0], batch)):
        return "the frequencies are broadcast over a batch the positions do not have"
    if not tensor_meta(inv_freq).device == tensor_meta(positions).device == out.device:
        return "inv_freq, the positions and the frequencies are not all on one device"
    return inv_freq, positions


def _candidates(graph: fx.Graph):
    """cat((f, f), ...) nodes that a cos or a sin reads."""
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in _CATS:
            continue
        parts = arg(node, 0, "tensors")
        if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and parts[0] is parts[1]
                and isinstance(parts[0], fx.Node)):
            continue
        cos = [u for u in node.users if _unary(u, "cos")]
        sin = [u for u in node.users if _unary(u, "sin")]
        if cos or sin:
            yield node, cos, sin


def run(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    order = node_order(graph)  # of the nodes already there; the new ones are never looked up
    for cat, cos_nodes, sin_nodes in list(_candidates(graph)):
        if len(cos_nodes) != 1 or len(sin_nodes) != 1:
            ctx.reject(PATTERN, cat, f"read by {len(cos_nodes)} cos and {len(sin_nodes)} sin (the kernel makes one of each)")
            continue
        found = _table(cat)
        if isinstance(found, str):
            ctx.reject(PATTERN, cat, found)
            continue
        inv_freq, positions = found
        (cos_end, cos_scale, cos_dtype), (sin_end, sin_scale, sin_dtype) = _output(cos_nodes[0]), _output(sin_nodes[0])
        if (cos_scale, cos_dtype) != (sin_scale, sin_dtype):
            ctx.reject(PATTERN, cat, f"cos and sin are scaled or cast differently (cos * {cos_scale} to {cos_dtype}, "
                                     f"sin * {sin_scale} to {sin_dtype})")
            continue
        first = min(cos_nodes[0], sin_nodes[0], key=order.__getitem__)
        with graph.inserting_before(first):
            table = graph.call_function(torch.ops.transfuse.rotary_table.default,
                                        (inv_freq, positions, cos_scale, cos_dtype))
            outs = [graph.call_function(operator.getitem, (table, i)) for i in (0, 1)]
        table.meta["example_value"] = (tensor_meta(cos_end), tensor_meta(sin_end))
        for old, new in zip((cos_end, sin_end), outs):
            new.meta["example_value"] = tensor_meta(old)
            old.replace_all_uses_with(new)
        ctx.matched(PATTERN)
