"""Literal tensors (`torch.tensor(0.0, device=x.device)`) -> a constant made once at compile time.

Dynamo keeps such a call in the graph when the model writes it (transformers' eager attention mask:
`torch.where(mask, torch.tensor(0.0, device=..., dtype=...), finfo.min)`). Each run then copies the
value from host memory to the GPU, and CUDA graph capture refuses that copy ("Cannot copy between
CPU and CUDA tensors during CUDA graph capture"). The value never changes, so it is made once here
and read like a parameter. Runs after the rewrite passes: they read `torch.tensor(c)` as the scalar c.

Index lists (`qkv[..., [-2]]`, Falcon's key and value heads) are the same host copy in disguise:
torch turns the list into a CPU index tensor on every call. They become constant index tensors on
the indexed tensor's device, which index exactly as the list does.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from transfuse.passes.graph import add_buffer, replace_by_buffer, tensor_meta


def hoist_literal_tensors(gm: fx.GraphModule) -> int:
    """Replace every `torch.tensor(...)` whose arguments are all constants by a buffer holding its
    value; returns how many. A tensor that asks for gradients stays a call (it is a leaf per run)."""
    graph = gm.graph
    hoisted = 0
    for node in list(graph.nodes):
        if (node.op != "call_function" or node.target is not torch.tensor or node.kwargs.get("requires_grad")
                or node.all_input_nodes):
            continue
        replace_by_buffer(gm, node, "_transfuse_literal_", torch.tensor(*node.args, **node.kwargs))
        hoisted += 1
    return hoisted


def _int_list(item) -> bool:
    """A (nested) list of Python ints: what torch turns into a host index tensor."""
    return isinstance(item, list) and bool(item) and all(
        _int_list(i) if isinstance(i, list) else (isinstance(i, int) and not isinstance(i, bool)) for i in item)


def hoist_index_lists(gm: fx.GraphModule) -> int:
    """Replace every list of ints in the index of `x[...]` or `x[...] = v` by a buffer holding it
    as an int64 tensor on x's device; returns how many."""
    graph = gm.graph
    hoisted = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (operator.getitem, operator.setitem) or len(node.args) < 2:
            continue
        base, index = node.args[0], node.args[1]
        meta = tensor_meta(base)
        items = index if isinstance(index, tuple) else (index,)
        if meta is None or not any(_int_list(i) for i in items):
            continue
        new_items = []
        for item in items:
            if _int_list(item):
                value = torch.tensor(item, dtype=torch.long, device=meta.device)
                with graph.inserting_before(node):
                    item = graph.get_attr(add_buffer(gm, "_transfuse_index_", value))
                item.meta["example_value"] = value
                hoisted += 1
            new_items.append(item)
        node.args = (base, tuple(new_items) if isinstance(index, tuple) else new_items[0], *node.args[2:])
    return hoisted
