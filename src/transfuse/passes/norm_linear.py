"""An RMSNorm and the one linear that reads it -> transfuse.rms_norm_linear (`RMSNormLinear`).

After the norm and linear passes, a Llama-style layer reads

    h, s = transfuse.add_rms_norm(x, residual, w, eps, ...)     # or h = transfuse.rms_norm(x, w, ...)
    y = transfuse.linear(h, W, b, act, None)                    # the merged QKV, or gate-up

and h has no other reader. Both become one op, which in a decode step (1-2 rows) is one GEMV launch
whose programs normalise their rows themselves, and otherwise the same two kernels as before
(ops/norm_linear.py). The sum s, when read, is the fused op's second output.

Left alone: a normalised row read by anything else as well (it would have to be stored anyway),
a linear that also adds a residual, a norm whose output dtype differs from x's or the weight's.
Inference graphs only (the fused op has no backward).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from transfuse.passes.graph import dtype, node_order, single_user
from transfuse.passes.manager import PassContext

PATTERN = "RMSNormLinear"


def _normed_and_sum(norm: fx.Node) -> tuple[fx.Node, fx.Node | None] | None:
    """(the node holding the normalised rows, the node holding the sum or None) of a norm op."""
    if norm.target is torch.ops.transfuse.rms_norm.default:
        return norm, None
    outputs = {user.args[1]: user for user in norm.users
               if user.op == "call_function" and user.target is operator.getitem}
    if len(outputs) != len(norm.users) or 0 not in outputs:
        return None
    return outputs[0], outputs.get(1)


def _norm_args(norm: fx.Node):
    """(x, residual or None, weight, eps, weight_offset, cast_before_weight)."""
    if norm.target is torch.ops.transfuse.rms_norm.default:
        x, weight, eps, offset, cast = norm.args
        return x, None, weight, eps, offset, cast
    x, residual, weight, eps, offset, cast, _store_sum = norm.args
    return x, residual, weight, eps, offset, cast


def run(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    norms = [n for n in graph.nodes if n.op == "call_function" and n.target in
             (torch.ops.transfuse.rms_norm.default, torch.ops.transfuse.add_rms_norm.default)]
    order = node_order(graph)
    for norm in norms:
        found = _normed_and_sum(norm)
        if found is None:
            continue
        normed, summed = found
        linear = single_user(normed)
        if (linear is None or linear.target is not torch.ops.transfuse.linear.default
                or linear.args[0] is not normed or normed in linear.args[1:]):
            continue
        x, residual, norm_weight, eps, offset, cast = _norm_args(norm)
        weight, bias, activation, lin_residual = linear.args[1:]
        if lin_residual is not None:
            ctx.reject(PATTERN, norm, "the linear also adds a residual")
            continue
        if not (dtype(normed) == dtype(x) == dtype(weight)):
            ctx.reject(PATTERN, norm, "the normalised rows are not in the dtype of x and of the linear's weight")
            continue
        # The fused op must come after the linear's weight and bias exist and before any reader of
        # the sum: at the norm when the weight is already there, else at the linear.
        later = [t for t in (weight, bias) if isinstance(t, fx.Node)]
        if all(order[t] < order[norm] for t in later):
            where = norm
        elif summed is None or all(order[u] > order[linear] for u in summed.users):
            where = linear
        else:
            ctx.reject(PATTERN, norm, "the sum is read before the linear's weight is computed")
            continue
        with graph.inserting_before(where):
            fused = graph.call_function(torch.ops.transfuse.rms_norm_linear.default,
                                        (x, residual, norm_weight, eps, offset, cast, weight, bias, activation))
            out = graph.call_function(operator.getitem, (fused, 0))
            out.meta.update(linear.meta)
            if summed is not None:
                new_sum = graph.call_function(operator.getitem, (fused, 1))
                new_sum.meta.update(summed.meta)
        linear.replace_all_uses_with(out)
        graph.erase_node(linear)
        if summed is not None:
            summed.replace_all_uses_with(new_sum)
            graph.erase_node(summed)
        if normed is not norm:
            graph.erase_node(normed)
        graph.erase_node(norm)
        order = node_order(graph)
        ctx.matched(PATTERN)
