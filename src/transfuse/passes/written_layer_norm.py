"""Layer norm written out by hand, fused with the residual add that feeds it.

* `WrittenLayerNorm` — `(h - mean(h)) / sqrt(mean((h - mean(h))**2) + eps)` (or `* rsqrt(...)`, or
  `h.var(-1, unbiased=False)`) over the last dim, then its scale and shift, as DeBERTa writes it
  (transformers/models/deberta/modeling_deberta.py, DebertaLayerNorm) and older TF-ported BERTs;
* `ResidualWrittenLayerNorm` — the same whose input is `a + b`.

The skeleton is found structurally; the tail (casts, weight, bias) is accepted only if evaluating
that piece of graph on probe values gives transfuse.reference.norm.layer_norm_ref's numbers.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from transfuse.passes.graph import arg, evaluate, kind, node_order, scalar, static_inputs, tensor_meta
from transfuse.passes.manager import PassContext
from transfuse.passes.norm import is_last_dim_mean, norm_input, replace_with_norm, statistic_plus_eps, walk_tail
from transfuse.reference.norm import layer_norm_ref

FUSED = "ResidualWrittenLayerNorm"
PLAIN = "WrittenLayerNorm"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def run(ctx: PassContext) -> None:
    statics = static_inputs(ctx.gm)
    for node in list(ctx.gm.graph.nodes):
        if node.graph is ctx.gm.graph and kind(node) in ("sqrt", "rsqrt"):
            match = _match(node, statics)
            if match is not None:
                _replace(ctx, *match)


def _centered(node) -> tuple | None:
    """(h, mean node) for `h - h.mean(-1, keepdim=True)`."""
    if kind(node) != "sub" or len(node.args) < 2 or not isinstance(node.args[0], fx.Node):
        return None
    h, u = node.args[0], node.args[1]
    return (h, u) if is_last_dim_mean(u, h) else None


def _variance(node) -> tuple | None:
    """(h, mean node or None) for the biased variance of h over the last dim, however spelled."""
    is_var = (node.op == "call_method" and node.target == "var") or (node.op == "call_function" and node.target is torch.var)
    if is_var:
        t = tensor_meta(node.args[0])
        dim, keepdim = arg(node, 1, "dim"), node.kwargs.get("keepdim", False)
        biased = node.kwargs.get("unbiased", True) is False or node.kwargs.get("correction", 1) == 0
        dims = dim if isinstance(dim, (list, tuple)) else [dim]
        if (t is not None and keepdim is True and biased and len(dims) == 1 and isinstance(dims[0], int)
                and dims[0] % t.dim() == t.dim() - 1 and len(node.args) <= 2):
            return node.args[0], None
        return None
    if is_last_dim_mean(node):
        sq = node.args[0]
        if kind(sq) == "pow" and len(sq.args) > 1 and scalar(sq.args[1]) == 2.0:
            return _centered(sq.args[0])
        if kind(sq) == "mul" and len(sq.args) > 1:  # c * c, c possibly computed twice
            a, b = _centered(sq.args[0]), _centered(sq.args[1])
            if a is not None and b is not None and a[0] is b[0] and a[1] is b[1]:
                return a
    return None


def _match(root: fx.Node, statics: dict):
    denominator = statistic_plus_eps(root)
    found = _variance(denominator[1]) if denominator is not None else None
    if found is None:
        return None
    eps = denominator[2]
    h, u = found
    normed = None
    for n in root.users:  # `centered / sqrt(...)` or `centered * rsqrt(...)`
        if kind(root) == "sqrt" and kind(n) == "div" and n.args[1] is root:
            other = n.args[0]
        elif kind(root) == "rsqrt" and kind(n) == "mul" and root in n.args[:2]:
            other = n.args[1] if n.args[0] is root else n.args[0]
        else:
            continue
        centered = _centered(other)
        if centered is not None and centered[0] is h and (u is None or centered[1] is u):
            normed, u = n, centered[1]
            break
    if normed is None:
        return None
    x = norm_input(h)
    xm = tensor_meta(x)
    if xm is None or xm.dtype not in SUPPORTED_DTYPES:
        return None
    region = ([h] if h is not x else []) + [u]
    region += [n for n in node_order_between(h, normed) if n not in region]
    chain, params = walk_tail(normed, x, statics, max_params=2)
    for stop in range(len(chain), 0, -1):
        nodes = region + chain[:stop]
        used = [p for p in params if any(p in n.all_input_nodes for n in nodes)]
        affine = _affine(nodes, chain[stop - 1], x, used, eps)
        if affine is not None:
            return (chain[stop - 1], x, *affine, eps)
    return None


def node_order_between(start: fx.Node, end: fx.Node) -> list:
    """The nodes from start (exclusive) to end (inclusive) in graph order that feed end."""
    needed, stack = set(), [end]
    while stack:
        n = stack.pop()
        if n in needed or n is start:
            continue
        needed.add(n)
        stack.extend(n.all_input_nodes)
    order = node_order(end.graph)
    return sorted((n for n in needed if order[n] > order[start] and n.op in ("call_function", "call_method")), key=order.__getitem__)


def _affine(nodes: list, out: fx.Node, x: fx.Node, params: list, eps: float):
    """(weight, bias) nodes if this region computes layer_norm_ref with them (in some order)."""
    xm, om = tensor_meta(x), tensor_meta(out)
    if om is None or om.dtype != xm.dtype or len(params) > 2:
        return None
    gen = torch.Generator().manual_seed(0)
    probe_x = (torch.randn(3, 64, generator=gen) * 3 + 1).to(xm.dtype)
    probes = {p: (torch.randn(64, generator=gen) * 0.5 + 1).to(tensor_meta(p).dtype) for p in params}
    try:
        got = evaluate(nodes, out, {x: probe_x, **probes})
    except Exception:  # noqa: BLE001 - not replayable: not a match
        return None
    if not isinstance(got, torch.Tensor) or got.shape != probe_x.shape or got.dtype != xm.dtype:
        return None
    tol = 1e-5 if xm.dtype == torch.float32 else 1e-2
    options = [(None, None)]
    if len(params) == 1:  # scale only, shift only, or one parameter serving as both
        options = [(params[0], None), (None, params[0]), (params[0], params[0])]
    elif len(params) == 2:
        options = [(params[0], params[1]), (params[1], params[0])]
    for w, b in options:
        for p in (w, b):
            if p is not None and tensor_meta(p).dtype not in (xm.dtype, torch.float32):
                break
        else:
            want = layer_norm_ref(probe_x, probes.get(w), probes.get(b), eps)
            if torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
                return w, b
    return None


def _replace(ctx: PassContext, out: fx.Node, x: fx.Node, weight, bias, eps: float) -> None:
    replace_with_norm(ctx, out, x, torch.ops.transfuse.layer_norm.default, torch.ops.transfuse.add_layer_norm.default,
                      (weight, bias, float(eps)), (PLAIN, FUSED))
