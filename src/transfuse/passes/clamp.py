"""`OverflowClamp`: Hugging Face T5's fp16 guard after each sub-layer
(transformers/models/t5/modeling_t5.py, T5Block.forward; also LongT5, UMT5, Pop2Piano copies)

    bound = torch.where(torch.isinf(h).any(), finfo.max - 1000, finfo.max)
    h = torch.clamp(h, min=-bound, max=bound)

-> torch.ops.transfuse.clamp_if_inf(h, finfo.max - 1000, finfo.max). Matched by structure (a clamp
whose bounds are plus and minus one `where` over "x has an inf"), whatever the two constants are.

`OverflowSelect`: the BART family's guard once transfuse.branchless has made it a select,

    h = torch.where(torch.logical_not(torch.isfinite(h).all()), torch.clamp(h, min=-b, max=b), h)

(or with `isinf(h).any() or isnan(h).any()` as the test) -> torch.ops.transfuse.clamp_if_nonfinite(h, b):
one or two launches instead of five; with `isinf(h).any()` alone (LongT5, Pix2Struct) ->
clamp_if_inf(h, b, inf).
"""

from __future__ import annotations


import torch
import torch.fx as fx

from transfuse.passes.graph import arg, kind, tensor_meta
from transfuse.passes.manager import PassContext

PATTERN = "OverflowClamp"
SELECT_PATTERN = "OverflowSelect"


def _is(node, function, method: str) -> bool:
    return isinstance(node, fx.Node) and (
        (node.op == "call_function" and node.target is function) or (node.op == "call_method" and node.target == method))


def _reduced(node, reduction, method: str, test) -> fx.Node | None:
    """x when node is test(x).<reduction>() (or torch.<reduction>(test(x)))."""
    if not _is(node, reduction, method) or len(node.args) != 1 or node.kwargs:
        return None
    inner = node.args[0]
    if not _is(inner, test, test.__name__) or len(inner.args) != 1:
        return None
    return inner.args[0]


def _has_inf_of(node) -> fx.Node | None:
    """x when node is isinf(x).any() (or torch.any(torch.isinf(x)))."""
    return _reduced(node, torch.any, "any", torch.isinf)


def _has_nonfinite_of(node) -> fx.Node | None:
    """x when node is "x holds an inf or a NaN": not(isfinite(x).all()), or isinf(x).any() or
    isnan(x).any() in either order."""
    if _is(node, torch.logical_not, "logical_not") and len(node.args) == 1:
        return _reduced(node.args[0], torch.all, "all", torch.isfinite)
    if _is(node, torch.logical_or, "logical_or") and len(node.args) == 2:
        a, b = node.args
        for inf, nan in ((a, b), (b, a)):
            x = _has_inf_of(inf)
            if x is not None and _reduced(nan, torch.any, "any", torch.isnan) is x:
                return x
    return None


def _match_select(where: fx.Node) -> tuple | None:
    """(op, args) for where(x has a non-finite, clamp(x, -b, b), x), or for the same with "x has an
    inf" (LongT5's and Pix2Struct's `if torch.isinf(h).any()`): clamp_if_inf with no bound otherwise."""
    if not _is(where, torch.where, "where") or len(where.args) != 3 or where.kwargs:
        return None
    cond, clamped, x = where.args
    if not isinstance(x, fx.Node) or not _is(clamped, torch.clamp, "clamp"):
        return None
    if _has_nonfinite_of(cond) is x:
        op, otherwise = torch.ops.transfuse.clamp_if_nonfinite.default, ()
    elif _has_inf_of(cond) is x:
        op, otherwise = torch.ops.transfuse.clamp_if_inf.default, (float("inf"),)
    else:
        return None
    if arg(clamped, 0, "input") is not x:
        return None
    lo, hi = arg(clamped, 1, "min"), arg(clamped, 2, "max")
    if not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in (lo, hi)) or lo != -hi or hi < 0:
        return None
    meta = tensor_meta(x)
    if meta is None or not meta.dtype.is_floating_point:
        return None
    return op, (x, float(hi), *otherwise)


def _match(clamp: fx.Node) -> tuple | None:
    """(clamp_if_inf, args) for T5's clamp whose bounds are a where over "x has an inf"."""
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
    return torch.ops.transfuse.clamp_if_inf.default, (x, float(if_inf), float(otherwise))


def run(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    for node in list(graph.nodes):
        match, pattern = (_match, PATTERN) if _is(node, torch.clamp, "clamp") else (_match_select, SELECT_PATTERN)
        found = match(node)
        if found is None:
            continue
        op, args = found
        with graph.inserting_before(node):
            new = graph.call_function(op, args)
        new.meta["example_value"] = node.meta.get("example_value")
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        ctx.matched(pattern)
