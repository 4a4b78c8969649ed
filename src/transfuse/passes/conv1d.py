"""Hugging Face's `Conv1D` (GPT-2 and its descendants) as the linear it is (`Conv1D`).

Conv1D stores its weight as (in, out) and computes `torch.addmm(bias, x.view(-1, in), weight)`.
That is `F.linear(x, weight.t(), bias)`: rewritten so, the GEMM passes after this one (epilogue
fusion, residual adds) see it like any other linear. The weight is read through a transposed view,
never copied; the user's parameter is untouched.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from transfuse.passes.graph import static_inputs, tensor_meta
from transfuse.passes.manager import PassContext

PATTERN = "Conv1D"


def run(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    params = static_inputs(ctx.gm)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.addmm or len(node.args) != 3:
            continue
        if any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")) or set(node.kwargs) - {"beta", "alpha"}:
            continue
        bias, x, weight = node.args
        if weight not in params or (bias is not None and bias not in params):
            continue
        w, b = tensor_meta(weight), tensor_meta(bias)
        if w is None or w.dim() != 2 or b is None or b.dim() != 1 or b.shape[0] != w.shape[1]:
            continue  # a bias that broadcasts over rows as well is not a linear's bias
        with graph.inserting_before(node):
            weight_t = graph.call_method("t", (weight,))
            weight_t.meta["example_value"] = w.t()
            linear = graph.call_function(F.linear, (x, weight_t, bias))
        linear.meta.update(node.meta)
        node.replace_all_uses_with(linear)
        graph.erase_node(node)
        ctx.matched(PATTERN)
