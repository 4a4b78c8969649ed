"""Backward graphs: every `aten.view` becomes `aten.reshape` (`ViewAsReshape`).

AOTAutograd traces the backward with fake tensors and writes `aten.view` wherever the traced strides
allow one. Torch's own kernels do not always return the strides their fake impls promise: in Doge's
backward (torch 2.11 and 2.13) an element-wise `softplus_backward` of a permuted gradient comes back
permuted, where the trace had it contiguous, and

    view_46 = aten.view.default(softplus_backward, [mul_90, 2])

raises "view size is not compatible with input tensor's size and stride" inside `loss.backward()`
(torch.compile(backend="aot_eager") raises the same; found by bench/train_sweep.py). `aten.reshape`
is that same view wherever one is possible and a copy elsewhere; AOTAutograd's backward graph is
functional (nothing writes through a view in it), so every value is the same either way, and a
view-compatible tensor costs nothing more than before.
"""

from __future__ import annotations

import torch
import torch.fx as fx

PATTERN = "ViewAsReshape"


def run(gm: fx.GraphModule) -> int:
    """Turns every aten.view into aten.reshape; returns how many."""
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
            count += 1
    if count:
        gm.recompile()
    return count
