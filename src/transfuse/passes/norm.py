"""Layer norm, fused with the residual add that feeds it.

* `ResidualLayerNorm` — `F.layer_norm(a + b, ...)`: BERT's post-norm `LayerNorm(hidden + input)`
  (transformers/models/bert/modeling_bert.py, BertSelfOutput/BertOutput) and GPT-style pre-norm
  where the sum is also the next residual (then the kernel stores the sum too).
* `LayerNorm` — any other `F.layer_norm` over the last dimension.

eps is read from the graph, never compared against a literal.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from transfuse.passes.graph import POINTWISE, arg, autocast_readers, kind, node_order, record_dtype, same_shape, same_size, scalar, shape, tensor_meta
from transfuse.passes.manager import PassContext

FUSED = "ResidualLayerNorm"
PLAIN = "LayerNorm"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def run(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    order = node_order(graph)
    for node in list(graph.nodes):
        if kind(node) != "layer_norm":
            continue
        reason = _check(node)
        if reason:
            ctx.reject(PLAIN, node, reason)
            continue
        x = arg(node, 0, "input")
        weight, bias = arg(node, 2, "weight"), arg(node, 3, "bias")
        eps = scalar(arg(node, 4, "eps", 1e-5))
        # Autocast's forms (training graphs only: the inference passes after this one read these
        # ops' arguments as they were): an fp32 residual stream plus a bf16 branch, and an fp32
        # norm whose every reader casts it to bf16 for its GEMM.
        residual = _residual_add(x, node, order, mixed=ctx.training)
        output = _output_dtype(ctx, PLAIN, node, residual[0] if residual is not None else x)
        if output is None:
            continue
        extra, value = output
        with graph.inserting_before(node):
            if residual is None:
                new = graph.call_function(torch.ops.transfuse.layer_norm.default, (x, weight, bias, eps, *extra))
                new.meta["example_value"] = value
                ctx.matched(PLAIN)
            else:
                a, b = residual
                store_sum = len(x.users) > 1
                fused = graph.call_function(
                    torch.ops.transfuse.add_layer_norm.default, (a, b, weight, bias, eps, store_sum, *extra)
                )
                new = graph.call_function(operator.getitem, (fused, 0))
                new.meta["example_value"] = value
                if store_sum:
                    total = graph.call_function(operator.getitem, (fused, 1))
                    total.meta["example_value"] = x.meta.get("example_value")
                    x.replace_all_uses_with(total, delete_user_cb=lambda u: u is not node)
                ctx.matched(FUSED)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        if residual is not None and not x.users:
            graph.erase_node(x)
        order = node_order(graph)


def _check(node: fx.Node) -> str | None:
    x = tensor_meta(arg(node, 0, "input"))
    normalized = arg(node, 1, "normalized_shape")
    if x is None:
        return "input has no recorded tensor value"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype}"
    if not isinstance(normalized, (list, tuple)) or len(normalized) != 1 or not same_size(normalized[0], x.shape[-1]):
        return f"normalized_shape {normalized} is not the last dimension alone"
    for name, i in (("weight", 2), ("bias", 3)):
        p = tensor_meta(arg(node, i, name))
        if arg(node, i, name) is not None and (p is None or p.dtype != x.dtype or p.dim() != 1):
            return f"{name} is not a 1-D tensor of the input's dtype"
    if scalar(arg(node, 4, "eps", 1e-5)) is None:
        return "eps is not a compile-time constant"
    return None


def _residual_add(x, norm: fx.Node, order: dict, mixed: bool = False) -> tuple | None:
    """(a, b) when the norm's input is `a + b` of two same-shape, same-dtype tensors whose other
    readers all come after the norm (the fused kernel produces the sum there). With `mixed`, b may
    be narrower than a (bf16 onto fp32: the sum is a's dtype, as the kernel adds); a is the wider."""
    if not isinstance(x, fx.Node) or kind(x) != "add" or arg(x, 2, "alpha", 1) != 1:
        return None
    if len(x.args) < 2 or not all(isinstance(t, fx.Node) for t in x.args[:2]):
        return None
    a, b = x.args[0], x.args[1]
    ta, tb, tx = tensor_meta(a), tensor_meta(b), tensor_meta(x)
    if ta is None or tb is None or not same_shape(shape(a), shape(b)) or not same_shape(shape(a), shape(x)):
        return None
    if mixed and tb.dtype == tx.dtype != ta.dtype:
        a, b, ta, tb = b, a, tb, ta
    same = ta.dtype == tb.dtype == tx.dtype
    promoted = (mixed and ta.dtype == tx.dtype and tb.dtype in SUPPORTED_DTYPES
                and torch.promote_types(ta.dtype, tb.dtype) == ta.dtype)
    if not (same or promoted):
        return None
    if any(order[u] < order[norm] for u in x.users if u is not norm):
        return None
    return a, b


def _output_dtype(ctx: PassContext, pattern: str, out: fx.Node, first_input: fx.Node) -> tuple[tuple, object] | None:
    """(the norm op's trailing out_dtype argument, its recorded value) for the op replacing the
    normalisation that ends at `out`; None, with the reason recorded, when out's recorded dtype is not
    the one the op returns (its first input's). In a training graph whose readers all cast the output
    to a half dtype (graph.autocast_readers), that dtype: the views on the way get it recorded too."""
    value = out.meta.get("example_value", out.meta.get("val"))
    readers = autocast_readers(out) if ctx.training else None
    if readers is not None:
        dtype, views = readers
        record_dtype(views, dtype)
        return (dtype,), (value.to(dtype) if value is not None else None)
    ours, recorded = tensor_meta(first_input), tensor_meta(out)
    if ours is not None and recorded is not None and recorded.dtype != ours.dtype:
        # autocast runs F.layer_norm in fp32 on half inputs, a written norm may promote: the ops
        # return their input's dtype
        ctx.reject(pattern, out, f"its output is {recorded.dtype} from a {ours.dtype} input (autocast or a promotion)")
        return None
    return (), value


def residual_before(x: fx.Node, out: fx.Node, order: dict, mixed: bool = False) -> tuple | None:
    """(a, b) when x = a + b fits the fused kernel (_residual_add's rules, `mixed` as there) and every
    reader of x outside this normalisation comes after its output, where the kernel produces the sum."""
    outside = [u for u in x.users if not inside(u, out)]
    if any(order[u] < order[out] for u in outside):
        return None
    return _residual_add(x, out, {**order, **{u: order[out] + 1 for u in x.users if u not in outside}}, mixed)


def inside(user: fx.Node, out: fx.Node) -> bool:
    """Whether `user` is part of the normalisation that ends at `out` (so reads x only through it)."""
    seen, stack = set(), [user]
    while stack:
        node = stack.pop()
        if node is out:
            return True
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.users)
    return False


def replace_with_norm(ctx: PassContext, out: fx.Node, x: fx.Node, plain, fused, args: tuple, names: tuple) -> None:
    """Replace a normalisation of x ending at `out` by `plain(x, *args)`, or, when x = a + b fits,
    by `fused(a, b, *args, store_sum)` (the sum stored when something else still reads x).
    names = (plain pattern, fused pattern) for the record. The old nodes are left to dead-code removal."""
    graph = ctx.gm.graph
    # autocast's forms in training graphs, as in run() above
    residual = residual_before(x, out, node_order(graph), mixed=ctx.training)
    output = _output_dtype(ctx, names[0], out, residual[0] if residual is not None else x)
    if output is None:
        return
    extra, value = output
    with graph.inserting_before(out):
        if residual is None:
            new = graph.call_function(plain, (x, *args, *extra))
            ctx.matched(names[0])
        else:
            store_sum = any(u for u in x.users if not inside(u, out))
            node = graph.call_function(fused, (*residual, *args, store_sum, *extra))
            new = graph.call_function(operator.getitem, (node, 0))
            if store_sum:
                total = graph.call_function(operator.getitem, (node, 1))
                total.meta["example_value"] = tensor_meta(x)
                x.replace_all_uses_with(total, delete_user_cb=lambda u: not inside(u, out))
            ctx.matched(names[1])
        new.meta["example_value"] = value
    out.replace_all_uses_with(new)


def affine_param(others: list, statics: dict, xm) -> tuple | None | bool:
    """For a step of a normalisation's tail: None when it reads no tensor besides the chain;
    (param, the nodes deriving from it) when it reads one 1-D parameter of the hidden size, through
    element-wise steps (`1.0 + weight.float()`); False for anything else."""
    if not others:
        return None
    if len(others) != 1:
        return False
    node, derived = others[0], []
    while node not in statics:
        if kind(node) not in POINTWISE or len([a for a in node.all_input_nodes]) != 1:
            return False
        derived.append(node)
        node = node.all_input_nodes[0]
    wm = tensor_meta(node)
    if wm is None or wm.dim() != 1 or not same_size(wm.shape[0], xm.shape[-1]):
        return False
    return node, list(reversed(derived))


def statistic_plus_eps(root: fx.Node) -> tuple[fx.Node, fx.Node, float] | None:
    """(the add, the statistic, eps) when `root` (the rsqrt or sqrt of a hand-written norm) reads
    `statistic + eps` with eps a compile-time scalar, in either order; else None."""
    added = arg(root, 0, "input")
    if kind(added) != "add" or len(added.args) < 2:
        return None
    stat, eps = (added.args[0], added.args[1]) if isinstance(added.args[0], fx.Node) else (added.args[1], added.args[0])
    eps = scalar(eps)
    return None if eps is None else (added, stat, eps)


def is_last_dim_mean(node, src: fx.Node | None = None) -> bool:
    """`t.mean(-1, keepdim=True)` (of `src` when given): the statistics of a row norm."""
    if not isinstance(node, fx.Node):
        return False
    if not ((node.op == "call_method" and node.target == "mean") or (node.op == "call_function" and node.target is torch.mean)):
        return False
    if src is not None and node.args[0] is not src:
        return False
    dim, keepdim = arg(node, 1, "dim"), arg(node, 2, "keepdim", False)
    t = tensor_meta(node.args[0]) if node.args else None
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return t is not None and keepdim is True and len(dims) == 1 and isinstance(dims[0], int) and dims[0] % t.dim() == t.dim() - 1


def norm_input(h: fx.Node) -> fx.Node:
    """x for the statistics' operand h: `x.float()` / `x.to(torch.float32)` reads x itself."""
    return h.args[0] if kind(h) == "to" and h.args and isinstance(h.args[0], fx.Node) else h


def walk_tail(normed: fx.Node, x: fx.Node, statics: dict, max_params: int) -> tuple[list, list]:
    """The tail after a normalisation: single-user element-wise steps reading constants, x for its
    dtype only (`.type_as(x)`) and at most `max_params` 1-D parameters of the hidden size (weight,
    bias; see affine_param). Returns (chain of nodes in graph order, the parameters read)."""
    xm = tensor_meta(x)
    chain, params, end = [normed], [], normed
    while len(end.users) == 1:
        nxt = next(iter(end.users))
        if kind(nxt) not in POINTWISE or nxt.op not in ("call_function", "call_method"):
            break
        others = [a for a in list(nxt.args) + list(nxt.kwargs.values()) if isinstance(a, fx.Node) and a is not end]
        if kind(nxt) == "to" and others == [x]:
            others = []  # `.type_as(x)`: x gives its dtype only
        found = affine_param(others, statics, xm)
        if found is False:
            break
        if found is not None:
            if found[0] not in params and len(params) == max_params:
                break
            if found[0] not in params:
                params.append(found[0])
            chain.extend(found[1])
        chain.append(nxt)
        end = nxt
    return chain, params
