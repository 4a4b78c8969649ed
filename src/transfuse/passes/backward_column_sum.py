"""Backward graphs: a bias gradient that no kernel sums as it writes (`ColumnSum`).

A linear's bias gradient is its output gradient summed over every row. Where that gradient comes
from one of our kernels that keeps the sum itself (a norm backward, the activation backward), the
sum is already gone; what is left in AOTAutograd's backward graph is

    aten.sum.dim_IntList(dy, [0 .. dim-2], keepdim[, dtype])

for instance over the concatenated dQ/dK/dV of GPT-2's c_attn: 21.5 us for 8192 x 2304 bf16 on an
H200, where transfuse.kernels.bias_grad takes 10.3 (90% of the copy bandwidth;
bench/kernels/sweep_train_memory_bound.py, 2026-11-26). The node becomes transfuse::bias_grad,
with the same result: fp32 accumulation rounded once to the sum's dtype (only the order of the fp32
additions differs from torch's).

Runs on the aten graphs AOTAutograd hands runtime/training_graphs.py, after
passes/backward_bias_grad.py (which takes the sums that a norm backward can keep).
"""

from __future__ import annotations

import torch
import torch.fx as fx

PATTERN = "ColumnSum"

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def run(gm: fx.GraphModule) -> int:
    """Rewrites every sum over all dims but the last of a floating tensor; returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        if not is_column_sum(node) or node.args[0].meta["val"].dtype not in _FLOATS \
                or node.meta["val"].dtype not in _FLOATS:  # the kernel's dtypes
            continue
        result = node.meta["val"]
        with gm.graph.inserting_before(node):
            summed = gm.graph.call_function(torch.ops.transfuse.bias_grad.default, (node.args[0], result.dtype))
        summed.meta["val"] = result.new_empty((result.shape[-1],))
        replace_column_sum(gm.graph, node, summed)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def is_column_sum(node: fx.Node) -> bool:
    """Whether node is `aten.sum.dim_IntList(x, every dim of x but the last, keepdim[, dtype])` of a
    floating x of 2 dims or more, with a static result shape (the rows may be symbolic: a dynamic
    batch). Also passes/backward_bias_grad.py's match."""
    if node.op != "call_function" or node.target is not torch.ops.aten.sum.dim_IntList:
        return False
    if set(node.kwargs) - {"dtype"} or len(node.args) < 2 or not isinstance(node.args[0], fx.Node):
        return False
    result, summed = node.meta.get("val"), node.args[0].meta.get("val")
    if not isinstance(result, torch.Tensor) or not isinstance(summed, torch.Tensor) or summed.dim() < 2:
        return False
    dims = node.args[1]
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
        return False
    if sorted(d % summed.dim() for d in dims) != list(range(summed.dim() - 1)):
        return False  # not every dim but the last
    if not summed.dtype.is_floating_point or not result.dtype.is_floating_point:
        return False
    return all(isinstance(s, int) for s in result.shape)


def replace_column_sum(graph: fx.Graph, node: fx.Node, flat: fx.Node) -> None:
    """Replaces the column sum `node` by `flat`, its (N,) result computed elsewhere (viewed back to
    keepdim's shape where node kept its dims), and erases node."""
    result = node.meta["val"]
    with graph.inserting_after(flat):
        new = flat if result.dim() == 1 else graph.call_function(
            torch.ops.aten.view.default, (flat, [int(s) for s in result.shape]))
    new.meta["val"] = result
    node.replace_all_uses_with(new)
    graph.erase_node(node)
