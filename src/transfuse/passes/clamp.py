"""`OverflowClamp`: Hugging Face T5's fp16 guard after each sub-layer
(transformers/models/t5/modeling_t5.py, T5Block.forward; also LongT5, UMT5, Pop2Piano copies)

    bound = torch.where(torch.isinf(h).any(), finfo.max - 1000, finfo.max)
    h = torch.clamp(h, min=-bound, max=bound)

-> torch.ops.transfuse.clamp_if_inf(h, finfo.max - 1000, finfo.max). Matched by structure (a clamp
whose bounds are plus and minus one `where` over "x has an inf"), whatever the two constants are.
"""

from __future__ import annotations


import torch
import torch.fx as fx

from transfuse.passes.graph import arg, kind, tensor_meta
from transfuse.passes.manager import PassContext

PATTERN = "OverflowClamp"


def _is(node, function, method: str) -> bool:
    return isinstance(node, fx.Node) and (
        (node.op == "call_function" and node.target is function) or (node.op == "call_method" and node.target == method))


def _has_inf_of(node) -> fx.Node | None:
    """x when node is isinf(x).any() (or torch.any(torch.isinf(x)))."""
    if not _is(node, torch.any, "any") or len(node.args) != 1 or node.kwargs:
        return None
    isinf = node.args[0]
    if not _is(isinf, torch.isinf, "isinf") or len(isinf.args) != 1:
        return None
    return isinf.args[0]


def _match(clamp: fx.Node) -> tuple[fx.Node, float, float] | None:
    x, lo, hi = arg(clamp, 0, "input"), arg(clamp, 1, "min"), arg(clamp, 2, "max")
    if not (isinstance(hi, fx.Node) and isinstance(lo, fx.Node) and kind(lo) == "neg" and lo.args[0] is hi):
        return None
    if not _is(hi, torch.where, "where") or len(hi.args) != 3:
        return None
    cond, if_inf, otherwise = hi.args
    if _has_inf_of(cond) is not x or not all(isinstance(c, (int, float)) for c in (if_inf, otherwise)):
        return None
    meta = tensor_meta(x)
    if meta is None or not meta.dtype.is_floating_point:
        return None
    return x, float(if_inf), float(otherwise)


def run(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    for node in list(graph.nodes):
        if not _is(node, torch.clamp, "clamp"):
            continue
        found = _match(node)
        if found is None:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.transfuse.clamp_if_inf.default, found)
        new.meta["example_value"] = node.meta.get("example_value")
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        ctx.matched(PATTERN)
