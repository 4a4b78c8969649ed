"""A static KV cache's update as one kernel (`KVCacheWrite`).

Hugging Face's StaticLayer.update, as Dynamo records it for every layer:

    position = torch.arange(n) + cumulative_length      # n = k.shape[-2]
    cumulative_length.add_(n)
    keys.index_copy_(2, position, k)
    values.index_copy_(2, position, v)

The two copies (and, once dead, the arange and the add) become transfuse.kv_cache_write(keys,
values, k, v, cumulative_length), placed where `position` was computed, so it reads the length
before the increment, as the copies did. Matched by meaning (the index is an arange of the new
entries' length plus a tensor), not by names. Left alone when k or v is computed after that point.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from transfuse.passes.graph import node_order, tensor_meta
from transfuse.passes.manager import PassContext

PATTERN = "KVCacheWrite"


def _start_of(position: fx.Node, n) -> fx.Node | None:
    """`start` when position is `arange(n) + start` (either order) with start a 0-d/1-element tensor."""
    if not (isinstance(position, fx.Node) and position.op == "call_function"
            and position.target in (operator.add, torch.add) and len(position.args) == 2 and not position.kwargs):
        return None
    for a, b in (position.args, position.args[::-1]):
        if (isinstance(a, fx.Node) and a.op == "call_function" and a.target is torch.arange
                and len(a.args) == 1 and str(a.args[0]) == str(n) and isinstance(b, fx.Node)):
            meta = tensor_meta(b)
            if meta is not None and meta.numel() == 1 and not meta.dtype.is_floating_point:
                return b
    return None


def _index_copy(node: fx.Node):
    """(cache, position, new) for `cache.index_copy_(2, position, new)` on 4-D tensors, else None."""
    if node.op != "call_method" or node.target != "index_copy_" or len(node.args) != 4 or node.kwargs:
        return None
    cache, dim, position, new = node.args
    metas = tensor_meta(cache), tensor_meta(new)
    if None in metas or any(m.dim() != 4 for m in metas) or dim not in (2, -2):
        return None
    return cache, position, new


def run(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    copies: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        found = _index_copy(node)
        if found is not None:
            copies.setdefault(found[1], []).append(node)
    order = node_order(graph)
    for position, nodes in copies.items():
        if len(nodes) != 2:
            continue
        (keys, _, k), (values, _, v) = (_index_copy(n) for n in nodes)
        start = _start_of(position, tensor_meta(k).shape[-2])
        if start is None:
            continue
        km, vm, cm, wm = (tensor_meta(t) for t in (k, v, keys, values))
        if km.shape != vm.shape or cm.shape != wm.shape or km.dtype != cm.dtype or vm.dtype != wm.dtype:
            ctx.reject(PATTERN, nodes[0], "keys and values differ in shape or dtype from the cache")
            continue
        if max(order[k], order[v], order[keys], order[values]) > order[position]:
            ctx.reject(PATTERN, nodes[0], "the new keys or values are computed after their cache position")
            continue
        with graph.inserting_after(position):
            graph.call_function(torch.ops.transfuse.kv_cache_write.default, (keys, values, k, v, start))
        for node, cache in zip(nodes, (keys, values)):
            node.replace_all_uses_with(cache)
            graph.erase_node(node)
        ctx.matched(PATTERN)
