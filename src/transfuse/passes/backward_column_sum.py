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
        if not _is_column_sum(node):
            continue
        result = node.meta["val"]
        with gm.graph.inserting_before(node):
            summed = gm.graph.call_function(torch.ops.transfuse.bias_grad.default, (node.args[0], result.dtype))
            summed.meta["val"] = result.new_empty((result.shape[-1],))
            new = summed if result.dim() == 1 else gm.graph.call_function(
                torch.ops.aten.view.default, (summed, [int(s) for s in result.shape]))
        new.meta["val"] = result
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _is_column_sum(node: fx.Node) -> bool:
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
    if summed.dtype not in _FLOATS or result.dtype not in _FLOATS:
        return False
    # The rows may be symbolic (a dynamic batch); the result's shape is the view back to keepdim's.
    return all(isinstance(s, int) for s in result.shape)
