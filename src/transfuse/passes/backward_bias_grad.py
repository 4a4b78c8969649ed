"""Backward graphs: a linear's bias gradient summed inside the LayerNorm backward that produced it
(`BiasGradInNormBackward`).

GPT-2, BERT and BART add each block's output projection (attention out, MLP down) to the residual
stream right before a LayerNorm, which transfuse fuses into one add_layer_norm. In AOTAutograd's
backward graph that projection's bias gradient is the column sum of the norm backward's dx (or,
under autocast, of dx cast to the projection's bf16, the kernel's fifth output):
`aten.sum(view(getitem(layer_norm_backward, 0 or 4), (rows, N)), [0], keepdim)`, a second read.
The norm backward kernel already keeps per-program column sums for dweight and dbias; asked with
compute_dx_sum it keeps one of that tensor too and returns it as its fourth output (fp32
accumulation rounded once to the sum's dtype: the tensor's own, or fp32 where CUDA autocast's
graph sums the bf16 gradient with dtype=float32 for an fp32 bias). GPT-2 124M, batch 8 x 1024:
24 such sums of 8192 x 768 bf16, 17.6 us each on an H200 (bench/profile_train_ops.py, 2026-11-26).

Runs on the aten graphs AOTAutograd hands runtime/training_graphs.py, after the forward passes.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from transfuse.passes.backward_column_sum import is_column_sum, replace_column_sum

PATTERN = "BiasGradInNormBackward"

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)
_COMPUTE_DX, _COMPUTE_DX_SUM, _DX_CAST, _DX_SUM_DTYPE = 7, 10, 11, 12  # transfuse::layer_norm_backward's


def run(gm: fx.GraphModule) -> int:
    """Rewrites every column sum of a layer norm backward's dx; returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        norm_bwd = _summed_norm_backward(node)
        if norm_bwd is None:
            continue
        result = node.meta["val"]
        if _arg(norm_bwd, _COMPUTE_DX_SUM, False) and _arg(norm_bwd, _DX_SUM_DTYPE, None) != result.dtype:
            continue  # a second sum of the same dx, in another dtype: left as it is
        dx_sum = _dx_sum_output(gm.graph, norm_bwd, result.new_empty((result.shape[-1],)))
        replace_column_sum(gm.graph, node, dx_sum)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _summed_norm_backward(node: fx.Node) -> fx.Node | None:
    """The layer_norm_backward node whose dx `node` sums over every row (keeping the last dim), or None."""
    if not is_column_sum(node):
        return None
    base = node.args[0]
    summed = base.meta["val"]
    while isinstance(base, fx.Node) and base.op == "call_function" and base.target in _VIEWS:
        base = base.args[0]
    if not (isinstance(base, fx.Node) and base.op == "call_function" and base.target is operator.getitem
            and base.args[1] in (0, 4)):
        return None
    norm_bwd = base.args[0]
    if norm_bwd.op != "call_function" or norm_bwd.target is not torch.ops.transfuse.layer_norm_backward.default:
        return None
    if norm_bwd.kwargs:
        return None  # AOTAutograd passes every argument positionally; anything else is not ours
    cast = _arg(norm_bwd, _DX_CAST, None)
    if (base.args[1] == 4) != (cast is not None):
        return None  # the kernel sums the cast dx when there is one, dx otherwise
    # The row length of dx, from x's meta: torch 2.11's AOTAutograd leaves getitem nodes without one.
    x = getattr(norm_bwd.args[1], "meta", {}).get("val")
    if not isinstance(x, torch.Tensor) or x.shape[-1] != summed.shape[-1] or not norm_bwd.args[_COMPUTE_DX]:
        return None
    return norm_bwd


def _arg(node: fx.Node, index: int, default):
    return node.args[index] if len(node.args) > index else default


def _dx_sum_output(graph: fx.Graph, norm_bwd: fx.Node, val: torch.Tensor) -> fx.Node:
    """getitem(norm_bwd, 3), asking the node for it first (a second sum of the same dx reuses it);
    `val` is its fake value."""
    for user in norm_bwd.users:
        if user.target is operator.getitem and user.args[1] == 3:
            return user
    cast = _arg(norm_bwd, _DX_CAST, None)
    args = list(norm_bwd.args[:_COMPUTE_DX_SUM]) + [True, cast, val.dtype]
    norm_bwd.args = tuple(args)
    with graph.inserting_after(norm_bwd):
        out = graph.call_function(operator.getitem, (norm_bwd, 3))
    out.meta["val"] = val
    old = norm_bwd.meta.get("val")
    if isinstance(old, (tuple, list)) and len(old) == 5:
        norm_bwd.meta["val"] = (*old[:3], val, *old[4:])
    return out
