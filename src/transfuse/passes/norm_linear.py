"""A norm and the first linear that reads it -> one op: `RMSNormLinear` (transfuse.rms_norm_linear)
and `LayerNormLinear` (transfuse.layer_norm_linear).

After the norm and linear passes, a Llama-style layer reads

    h, s = transfuse.add_rms_norm(x, residual, w, eps, ...)     # or h = transfuse.rms_norm(x, w, ...)
    y = transfuse.linear(h, W, b, act, None)                    # the merged QKV, or gate-up

and a GPT-2 layer the same with add_layer_norm, its linear reading h through a (rows, K) view
(Conv1D flattens its input). h has no other reader. Both become one op, which in a decode step
(1-2 rows) is one GEMV launch whose programs normalise their rows themselves, and otherwise the same
two kernels as before (ops/norm_linear.py). The sum s, when read, is the fused op's second output;
through the view, the fused op's (..., N) output is reshaped to the linear's (rows, N).

A post-norm layer (BERT, BART: h = LayerNorm(x + residual), then h feeds the next linear and is
the next residual) reads the normalised rows again: the fused op then also returns them
(store_normed, its third output), stored on the way by the GEMV's first program column, so the
norm still costs no launch of its own. Where several linears read the rows, the first one takes
the norm.

Left alone: a linear that also adds a residual, a norm whose output dtype differs from x's or the
weight's, normalised rows read before the linear's weight is computed. Inference graphs only (the
fused ops have no backward).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from transfuse.passes.graph import dtype, kind, node_order, single_user, tensor_meta
from transfuse.passes.manager import PassContext

PATTERN = "RMSNormLinear"
LAYER_PATTERN = "LayerNormLinear"
_OPS = torch.ops.transfuse
_SINGLE_OUTPUT = (_OPS.rms_norm.default, _OPS.layer_norm.default)
_LAYER = (_OPS.layer_norm.default, _OPS.add_layer_norm.default)


def _normed_and_sum(norm: fx.Node) -> tuple[fx.Node, fx.Node | None] | None:
    """(the node holding the normalised rows, the node holding the sum or None) of a norm op."""
    if norm.target in _SINGLE_OUTPUT:
        return norm, None
    outputs = {user.args[1]: user for user in norm.users
               if user.op == "call_function" and user.target is operator.getitem}
    if len(outputs) != len(norm.users) or 0 not in outputs:
        return None
    return outputs[0], outputs.get(1)


def _fused_call(norm: fx.Node, weight, bias, activation) -> tuple:
    """(the fused op, its arguments, x) for `norm` feeding linear(weight, bias, activation)."""
    if norm.target is _OPS.rms_norm.default:
        x, norm_weight, eps, offset, cast = norm.args
        return _OPS.rms_norm_linear.default, (x, None, norm_weight, eps, offset, cast, weight, bias, activation), x
    if norm.target is _OPS.add_rms_norm.default:
        x, residual, norm_weight, eps, offset, cast, _store_sum = norm.args
        return _OPS.rms_norm_linear.default, (x, residual, norm_weight, eps, offset, cast, weight, bias, activation), x
    if norm.target is _OPS.layer_norm.default:
        x, norm_weight, norm_bias, eps = norm.args
        return _OPS.layer_norm_linear.default, (x, None, norm_weight, norm_bias, eps, weight, bias, activation), x
    x, residual, norm_weight, norm_bias, eps, _store_sum = norm.args
    return _OPS.layer_norm_linear.default, (x, residual, norm_weight, norm_bias, eps, weight, bias, activation), x


def _reading_linear(normed: fx.Node, user: fx.Node) -> tuple[fx.Node | None, fx.Node | None]:
    """(the transfuse.linear that reads normed as its x through `user`, which is that linear or a
    (rows, K) view whose one reader it is; the view or None), or (None, None)."""
    view = None
    if kind(user) in ("view", "reshape") and user.args[0] is normed:
        rows, meta = tensor_meta(user), tensor_meta(normed)
        if rows is None or meta is None or rows.dim() != 2 or rows.shape[-1] != meta.shape[-1]:
            return None, None
        view, user = user, single_user(user)
    reads = view if view is not None else normed
    if (user is None or user.op != "call_function" or user.target is not _OPS.linear.default
            or user.args[0] is not reads or reads in user.args[1:]):
        return None, None
    if view is not None and not isinstance(tensor_meta(user).shape[-1], int):
        return None, None
    return user, view


def _linear_of(normed: fx.Node, order: dict) -> tuple[fx.Node | None, fx.Node | None, list[fx.Node]]:
    """(the first transfuse.linear that reads normed, the (rows, K) view it reads normed through or
    None, normed's other readers); (None, None, []) when no linear reads it."""
    found = [(linear, view) for linear, view in (_reading_linear(normed, u) for u in normed.users) if linear is not None]
    if not found:
        return None, None, []
    linear, view = min(found, key=lambda lv: order[lv[0]])
    others = [u for u in normed.users if u is not linear and u is not view]
    return linear, view, others


def run(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    norms = [n for n in graph.nodes if n.op == "call_function" and n.target in
             (_OPS.rms_norm.default, _OPS.add_rms_norm.default, *_LAYER)]
    order = node_order(graph)
    for norm in norms:
        pattern = LAYER_PATTERN if norm.target in _LAYER else PATTERN
        found = _normed_and_sum(norm)
        if found is None:
            continue
        normed, summed = found
        linear, view, others = _linear_of(normed, order)
        if linear is None:
            continue
        weight, bias, activation, lin_residual = linear.args[1:]
        if lin_residual is not None:
            ctx.reject(pattern, norm, "the linear also adds a residual")
            continue
        op, args, x = _fused_call(norm, weight, bias, activation)
        if not (dtype(normed) == dtype(x) == dtype(weight)):
            ctx.reject(pattern, norm, "the normalised rows are not in the dtype of x and of the linear's weight")
            continue
        # The fused op must come after the linear's weight and bias exist and before any reader of
        # the sum: at the norm when the weight is already there, else at the linear.
        later = [t for t in (weight, bias) if isinstance(t, fx.Node)]
        if all(order[t] < order[norm] for t in later):
            where = norm
        elif summed is not None and any(order[u] < order[linear] for u in summed.users):
            ctx.reject(pattern, norm, "the sum is read before the linear's weight is computed")
            continue
        elif any(order[u] < order[linear] for u in others):
            ctx.reject(pattern, norm, "the normalised rows are read before the linear's weight is computed")
            continue
        else:
            where = linear
        # store_normed: the fused op's third output; store_sum=False where a residual's sum is
        # never read (a post-norm layer), so that the unfused path (3+ rows) does not write it
        unread_sum = summed is None and args[1] is not None
        if others or unread_sum:
            args = (*args, bool(others), not unread_sum)
        with graph.inserting_before(where):
            fused = graph.call_function(op, args)
            out = graph.call_function(operator.getitem, (fused, 0))
            if view is not None:
                n_out = tensor_meta(linear).shape[-1]
                out.meta["example_value"] = tensor_meta(normed).new_empty((*tensor_meta(normed).shape[:-1], n_out))
                out = graph.call_method("reshape", (out, -1, n_out))
            out.meta.update(linear.meta)
            if summed is not None:
                new_sum = graph.call_function(operator.getitem, (fused, 1))
                new_sum.meta.update(summed.meta)
            if others:
                new_normed = graph.call_function(operator.getitem, (fused, 2))
                new_normed.meta.update(normed.meta)
        linear.replace_all_uses_with(out)
        graph.erase_node(linear)
        if view is not None:
            graph.erase_node(view)
        if summed is not None:
            summed.replace_all_uses_with(new_sum)
            graph.erase_node(summed)
        if others:
            normed.replace_all_uses_with(new_normed)
        if normed is not norm:
            graph.erase_node(normed)
        graph.erase_node(norm)
        order = node_order(graph)
        ctx.matched(pattern)
