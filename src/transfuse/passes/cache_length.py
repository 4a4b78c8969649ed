"""Every layer's cache-length increment in one launch at the end of the graph (`CacheLengths`).

Hugging Face's StaticLayer.update bumps its layer's length after writing the new entries:

    cumulative_length.add_(n)        # one launch per layer per decode step (22 for Llama-1.1B)

Each of those tensors is a graph input that nothing later in the graph reads (the next reader is the
next step's graph). Increments by the same amount of such tensors are moved to the end of the graph
as one `_foreach_add_`, a single launch: every read in the graph happens before, as it did, and the
tensors hold the same values when the graph returns.

Left alone: an increment whose tensor is read (or written) again later in the graph, one whose
result is used, an increment that is not of a one-element integer input.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from transfuse.passes.graph import node_order, tensor_meta
from transfuse.passes.manager import PassContext

PATTERN = "CacheLengths"


def _increment(node: fx.Node, order: dict) -> tuple[fx.Node, object] | None:
    """(length tensor, amount) for `length.add_(amount)` on a one-element integer graph input that
    no node after it reads; else None."""
    if node.op != "call_method" or node.target != "add_" or len(node.args) != 2 or node.kwargs or node.users:
        return None
    length, amount = node.args
    meta = tensor_meta(length)
    if not (isinstance(length, fx.Node) and length.op == "placeholder" and meta is not None
            and meta.numel() == 1 and not meta.dtype.is_floating_point and not meta.dtype == torch.bool):
        return None
    if not isinstance(amount, (int, fx.Node)) or isinstance(amount, bool) or tensor_meta(amount) is not None:
        return None
    if any(order[user] > order[node] for user in length.users):
        return None
    return length, amount


def run(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    order = node_order(graph)
    groups: dict[object, list[fx.Node]] = {}
    for node in list(graph.nodes):
        found = _increment(node, order)
        if found is not None:
            groups.setdefault(found[1], []).append(node)
    output = next(n for n in graph.nodes if n.op == "output")
    for amount, adds in groups.items():
        lengths = [add.args[0] for add in adds]
        if len(adds) < 2 or len(set(lengths)) != len(lengths):
            continue
        with graph.inserting_before(output):
            graph.call_function(torch.ops.aten._foreach_add_.Scalar, (lengths, amount))
        for add in adds:
            graph.erase_node(add)
        ctx.matched(PATTERN, len(adds))
