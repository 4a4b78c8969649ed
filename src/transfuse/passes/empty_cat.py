"""A concatenation with empty 1-D tensors is its one real operand, cast (`EmptyCat`).

Hugging Face's DynamicCache starts each layer's keys and values as `torch.tensor([])` and appends
with `torch.cat([cache, key_states], dim=-2)`. torch.cat skips empty 1-D tensors but promotes with
them: the empty fp32 tensor turns a bf16 key into an fp32 copy (under autocast every layer of a
training step then copies its keys and values to fp32, and SDPA casts them back). Here the cat
becomes `x.to(dtype)`: nothing when the dtype is x's own (and nothing writes the result in place),
one cast otherwise, which passes.graph.cast_to folds away when the reader casts back exactly.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from transfuse.passes.graph import tensor_meta, writes_in_place
from transfuse.passes.manager import PassContext

PATTERN = "EmptyCat"


def run(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.cat or not node.args:
            continue
        tensors = node.args[0]
        out = tensor_meta(node)
        if not isinstance(tensors, (list, tuple)) or out is None:
            continue
        real = [t for t in tensors if not _empty_1d(t)]
        if len(real) != 1 or len(tensors) == 1 or not isinstance(real[0], fx.Node):
            continue
        x = real[0]
        if tensor_meta(x) is None or tuple(tensor_meta(x).shape) != tuple(out.shape):
            continue
        if tensor_meta(x).dtype == out.dtype:
            if any(writes_in_place(u) for u in node.users) or any(writes_in_place(u) for u in x.users):
                continue  # the cat's result is a new tensor: an alias would share the writes
            node.replace_all_uses_with(x)
        else:
            with graph.inserting_before(node):
                cast = graph.call_method("to", (x, out.dtype))
            cast.meta["example_value"] = out
            node.replace_all_uses_with(cast)
        graph.erase_node(node)
        ctx.matched(PATTERN)


def _empty_1d(t) -> bool:
    meta = tensor_meta(t)
    return meta is not None and meta.dim() == 1 and isinstance(meta.shape[0], int) and meta.shape[0] == 0
