"""A decode step's rotary + cache write and the attention reading that cache -> one op (`RotaryCacheAttention`).

After the qkv_rotary_cache pass a Llama-style decode step reads

    q_rot = transfuse.rotary_kv_cache_write(keys, values, q, k, v, cos, sin, start)
        (or q_rot, s = transfuse.qkv_rotary_cache_write(x, ..., keys, values, cos, sin, start, q_heads))
    out = transfuse.attention(q_rot, keys, values, mask, summary, scale, ...)

and both become transfuse.rotary_cache_attention (qkv_rotary_cache_attention), which the decode
attention kernel runs as one launch: it rotates q and the new keys itself and writes the cache
(ops/rotary_cache_attention.py).

Placed where the write was when every other input of the attention is ready there and nothing in
between writes one of them; else where the attention was when nothing in between writes an input
of the write, reads the cache, or reads the write's other output. Left alone, with the reason: an
attention that reads another cache than the one written, rotated queries read by anything else.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from transfuse.passes.graph import node_order, writes_in_place
from transfuse.passes.manager import PassContext

PATTERN = "RotaryCacheAttention"
_OPS = torch.ops.transfuse
_ATTENTION_ARGS = ("q", "k", "v", "mask", "mask_summary", "scale", "is_causal", "masked_rows_zero", "key_len", "sinks")
_ATTENTION_DEFAULTS = {"key_len": None, "sinks": None}
_CACHE_ARGS = {_OPS.rotary_kv_cache_write.default: (0, 1), _OPS.qkv_rotary_cache_write.default: (10, 11)}


def _write_of(q: fx.Node) -> fx.Node | None:
    """The cache write whose rotated queries q is."""
    if q.op != "call_function":
        return None
    if q.target is _OPS.rotary_kv_cache_write.default:
        return q
    if q.target is operator.getitem and q.args[1] == 0 and isinstance(q.args[0], fx.Node) \
            and q.args[0].target is _OPS.qkv_rotary_cache_write.default:
        return q.args[0]
    return None


def _attention_args(attention: fx.Node) -> list:
    args = list(attention.args) + [None] * (len(_ATTENTION_ARGS) - len(attention.args))
    for i, name in enumerate(_ATTENTION_ARGS):
        if name in attention.kwargs:
            args[i] = attention.kwargs[name]
        elif i >= len(attention.args):
            args[i] = _ATTENTION_DEFAULTS[name]
    return args


def _placement(write: fx.Node, attention: fx.Node, q: fx.Node, order: dict) -> fx.Node | None:
    """The node to insert the fused op before (the write or the attention), or None."""
    between = [n for n in write.graph.nodes if order[write] < order[n] < order[attention]]
    others = set(attention.all_input_nodes) - {q}
    if all(order[n] < order[write] for n in others - set(write.all_input_nodes)) and not any(
            writes_in_place(n) and others & set(n.all_input_nodes) for n in between):
        return write
    keys, values = (write.args[i] for i in _CACHE_ARGS[write.target])
    inputs = set(write.all_input_nodes)
    later = all(order[u] > order[attention] for u in write.users if u is not q and u is not attention)
    if later and not any((writes_in_place(n) and inputs & set(n.all_input_nodes))
                         or keys in n.all_input_nodes or values in n.all_input_nodes for n in between):
        return attention
    return None


def run(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    order = node_order(graph)
    attentions = [n for n in graph.nodes if n.op == "call_function" and n.target is _OPS.attention.default]
    for attention in attentions:
        args = _attention_args(attention)
        q = args[0]
        write = _write_of(q) if isinstance(q, fx.Node) else None
        if write is None:
            continue
        keys, values = (write.args[i] for i in _CACHE_ARGS[write.target])
        if args[1] is not keys or args[2] is not values:
            ctx.reject(PATTERN, attention, "the attention reads other keys or values than the cache the write fills")
            continue
        if len(q.users) != 1:
            ctx.reject(PATTERN, attention, "the rotated queries are read by more than the attention")
            continue
        where = _placement(write, attention, q, order)
        if where is None:
            ctx.reject(PATTERN, attention, "a node between the cache write and the attention writes or reads "
                                           "their inputs")
            continue
        plain = write.target is _OPS.rotary_kv_cache_write.default
        with graph.inserting_before(where):
            if plain:
                fused = graph.call_function(_OPS.rotary_cache_attention.default, (*write.args, *args[3:]))
                out = fused
            else:
                fused = graph.call_function(_OPS.qkv_rotary_cache_attention.default, (*write.args, *args[3:]))
                out = graph.call_function(operator.getitem, (fused, 0))
                summed = [u for u in write.users if u is not q]
                if summed:
                    new_sum = graph.call_function(operator.getitem, (fused, 1))
                    new_sum.meta.update(summed[0].meta)
                    for u in summed:  # getitem(write, 1): the norm's residual sum
                        u.replace_all_uses_with(new_sum)
                        graph.erase_node(u)
            out.meta.update(attention.meta)
        attention.replace_all_uses_with(out)
        graph.erase_node(attention)
        if not plain:
            graph.erase_node(q)
        graph.erase_node(write)
        order = node_order(graph)
        ctx.matched(PATTERN)
