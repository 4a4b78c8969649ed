"""Literal tensors (`torch.tensor(0.0, device=x.device)`) -> a constant made once at compile time.

Dynamo keeps such a call in the graph when the model writes it (transformers' eager attention mask:
`torch.where(mask, torch.tensor(0.0, device=..., dtype=...), finfo.min)`). Each run then copies the
value from host memory to the GPU, and CUDA graph capture refuses that copy ("Cannot copy between
CPU and CUDA tensors during CUDA graph capture"). The value never changes, so it is made once here
and read like a parameter. Runs after the rewrite passes: they read `torch.tensor(c)` as the scalar c.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from transfuse.passes.graph import add_buffer


def hoist_literal_tensors(gm: fx.GraphModule) -> int:
    """Replace every `torch.tensor(...)` whose arguments are all constants by a buffer holding its
    value; returns how many. A tensor that asks for gradients stays a call (it is a leaf per run)."""
    graph = gm.graph
    hoisted = 0
    for node in list(graph.nodes):
        if (node.op != "call_function" or node.target is not torch.tensor or node.kwargs.get("requires_grad")
                or node.all_input_nodes):
            continue
        value = torch.tensor(*node.args, **node.kwargs)
        with graph.inserting_before(node):
            constant = graph.get_attr(add_buffer(gm, "_transfuse_literal_", value))
        constant.meta = dict(node.meta)
        constant.meta["example_value"] = value
        node.replace_all_uses_with(constant)
        graph.erase_node(node)
        hoisted += 1
    return hoisted
