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

Then (`RotaryCacheWrite`), when the keys written are the K half of a transfuse.rotary_pair (Llama's
apply_rotary_pos_emb just before the update) and nothing else reads them, the pair and the write
become one transfuse.rotary_kv_cache_write, placed where the pair was: the rotated keys go straight
into the cache and a decode step saves a launch per layer. Left alone, with the reason, when the
cache, v or the position only exist after the pair, or something between the pair and the write
touches the cache (it would see the write early) or writes the position.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from transfuse.passes.graph import node_order, tensor_meta, writes_in_place
from transfuse.passes.manager import PassContext

PATTERN = "KVCacheWrite"
FUSED = "RotaryCacheWrite"


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
        # values may have a head dim of their own (DeepSeek's latent attention): the kernel writes each with its own
        if (km.shape[:3] != vm.shape[:3] or cm.shape[:3] != wm.shape[:3] or km.shape[3] != cm.shape[3]
                or vm.shape[3] != wm.shape[3] or km.dtype != cm.dtype or vm.dtype != wm.dtype):
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
    _fuse_rotary(ctx)


def _computed_from(graph: fx.Graph, roots, stop: fx.Node) -> set[fx.Node]:
    """roots and every node before `stop` computed from them by any op (views included: conservative)."""
    out = set(roots)
    for node in graph.nodes:
        if node is stop:
            break
        if any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _clash(graph: fx.Graph, pair: fx.Node, write: fx.Node, cache, start) -> fx.Node | None:
    """The first node between pair and write that reads the cache (it would see the new entries once
    the write moves up to the pair) or writes the position (the write would read it before, not
    after), else None."""
    cache = _computed_from(graph, cache, write)
    position = _computed_from(graph, (start,), write)
    node = pair.next
    while node is not write:
        inputs = node.all_input_nodes
        if any(a in cache for a in inputs):
            return node
        if writes_in_place(node) and any(a in position for a in inputs):
            return node
        node = node.next
    return None


def _fuse_rotary(ctx: PassContext) -> None:
    """kv_cache_write(keys, values, rotary_pair(q, k, cos, sin)[1], v, start) -> RotaryCacheWrite."""
    graph = ctx.gm.graph
    order = node_order(graph)  # of the nodes already there; the fused nodes are never looked up
    writes = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.ops.transfuse.kv_cache_write.default]
    for write in writes:
        keys, values, k_rot, v, start = write.args
        if not (k_rot.op == "call_function" and k_rot.target is operator.getitem and k_rot.args[1] == 1):
            continue
        pair = k_rot.args[0]
        if pair.op != "call_function" or pair.target is not torch.ops.transfuse.rotary_pair.default \
                or len(pair.args) != 4:  # an out_dtype: the cache write rotates in the cache's dtype
            continue
        q_rots = [u for u in pair.users if u is not k_rot]
        if len(k_rot.users) != 1 or any(u.target is not operator.getitem or u.args[1] != 0 for u in q_rots):
            ctx.reject(FUSED, write, "the rotated keys are read by more than the cache write")
            continue
        if max(order[keys], order[values], order[v], order[start]) > order[pair]:
            ctx.reject(FUSED, write, "the cache, the new values or the position are computed after the rotation")
            continue
        if tensor_meta(v).shape[-1] != tensor_meta(k_rot).shape[-1]:
            ctx.reject(FUSED, write, "values have a head dim other than the keys' (the fused write has one)")
            continue
        clash = _clash(graph, pair, write, (keys, values), start)
        if clash is not None:
            ctx.reject(FUSED, write, f"{clash.name}, between the rotation and the cache write, reads the cache "
                                     "or writes the position")
            continue
        q, k, cos, sin = pair.args
        with graph.inserting_before(pair):
            fused = graph.call_function(torch.ops.transfuse.rotary_kv_cache_write.default,
                                        (keys, values, q, k, v, cos, sin, start))
        for q_rot in q_rots:
            fused.meta.update(q_rot.meta)
            q_rot.replace_all_uses_with(fused)
            graph.erase_node(q_rot)
        for node in (write, k_rot, pair):
            graph.erase_node(node)
        ctx.matched(FUSED)
