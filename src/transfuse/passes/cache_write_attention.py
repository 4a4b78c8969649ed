"""A decode step's KV-cache write and the attention reading that cache -> one op (`KVCacheAttention`,
`RotaryCacheAttention`).

After the kv_cache and qkv_rotary_cache passes a decode step reads

    transfuse.kv_cache_write(keys, values, k, v, start)                       # GPT-2, OPT, BART, T5, ...
    out = transfuse.attention(q, keys, values, mask, summary, scale, ...)
or
    q_rot = transfuse.rotary_kv_cache_write(keys, values, q, k, v, cos, sin, start)      # Llama-style
        (or q_rot, s = transfuse.qkv_rotary_cache_write(x, ..., keys, values, cos, sin, start, q_heads))
    out = transfuse.attention(q_rot, keys, values, mask, summary, scale, ...)

and both become transfuse.kv_cache_attention (rotary_cache_attention, qkv_rotary_cache_attention),
which the decode attention kernel runs as one launch: it writes the cache itself, rotating q and the
new keys for the rotary forms (ops/cache_write_attention.py).

Placed where the write was when every other input of the attention is ready there and nothing in
between writes one of them; else where the attention was when nothing in between writes an input
of the write, reads the cache, or reads the write's other output. Left alone, with the reason: an
attention that reads another cache than the one written, rotated queries read by anything else.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from transfuse.passes.graph import arg, node_order, writes_in_place
from transfuse.passes.manager import PassContext

PATTERN = "RotaryCacheAttention"
PLAIN_PATTERN = "KVCacheAttention"
_OPS = torch.ops.transfuse
_ATTENTION_ARGS = ("q", "k", "v", "mask", "mask_summary", "scale", "is_causal", "masked_rows_zero", "key_len", "sinks")
_CACHE_ARGS = {_OPS.rotary_kv_cache_write.default: (0, 1), _OPS.qkv_rotary_cache_write.default: (10, 11),
               _OPS.kv_cache_write.default: (0, 1)}


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
    """transfuse.attention's arguments by position, keywords included (key_len and sinks default to None)."""
    return [arg(attention, i, name) for i, name in enumerate(_ATTENTION_ARGS)]


def _plain_write_of(attention: fx.Node, keys, order: dict) -> fx.Node | None:
    """The kv_cache_write into `keys` that comes last before the attention, if any."""
    writes = [u for u in getattr(keys, "users", ()) if u.op == "call_function" and u.target is _OPS.kv_cache_write.default
              and u.args[0] is keys and order[u] < order[attention]]
    return max(writes, key=order.__getitem__) if writes else None


def _placement(write: fx.Node, attention: fx.Node, q: fx.Node | None, order: dict) -> fx.Node | None:
    """The node to insert the fused op before (the write or the attention), or None; q: the write's
    rotated queries (None for a plain write)."""
    between = []
    node = write.next
    while node is not attention:
        between.append(node)
        node = node.next
    others = set(attention.all_input_nodes) - {q}
    if all(order[n] < order[write] for n in others - set(write.all_input_nodes)) and not any(
            writes_in_place(n) and others & set(n.all_input_nodes) for n in between):
        return write
    keys, values = (write.args[i] for i in _CACHE_ARGS[write.target])
    inputs = set(write.all_input_nodes)
    later = all(order[u] > order[attention] for u in write.users if u is not q and u is not attention)
    if later and not any((writes_in_place(n) and inputs & set(n.all_input_nodes))
                         or (not _reads_size_only(n) and {keys, values} & set(n.all_input_nodes)) for n in between):
        return attention
    return None


_SIZE_METHODS = ("size", "dim", "stride")
_SIZE_FUNCTIONS = (torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int)


def _reads_size_only(node: fx.Node) -> bool:
    """A size or stride query (BART's mask summary asks the cache for its length): the write moving
    past it changes nothing it reads."""
    return ((node.op == "call_method" and node.target in _SIZE_METHODS)
            or (node.op == "call_function" and node.target in _SIZE_FUNCTIONS))


_IN_BETWEEN = "a node between the cache write and the attention writes or reads their inputs"


def _fuse_plain(ctx: PassContext, attention: fx.Node, args: list, order: dict) -> bool:
    write = _plain_write_of(attention, args[1], order)
    if write is None:
        return False
    if write.args[1] is not args[2]:
        ctx.reject(PLAIN_PATTERN, attention, "the attention reads other values than the cache the write fills")
        return False
    where = _placement(write, attention, None, order)
    if where is None:
        ctx.reject(PLAIN_PATTERN, attention, _IN_BETWEEN)
        return False
    graph = ctx.gm.graph
    keys, values, k, v, start = write.args
    with graph.inserting_before(where):
        fused = graph.call_function(_OPS.kv_cache_attention.default, (keys, values, args[0], k, v, start, *args[3:]))
        fused.meta.update(attention.meta)
    attention.replace_all_uses_with(fused)
    graph.erase_node(attention)
    graph.erase_node(write)
    ctx.matched(PLAIN_PATTERN)
    return True


def _fuse_rotary(ctx: PassContext, attention: fx.Node, args: list, write: fx.Node, order: dict) -> bool:
    q = args[0]
    keys, values = (write.args[i] for i in _CACHE_ARGS[write.target])
    if args[1] is not keys or args[2] is not values:
        ctx.reject(PATTERN, attention, "the attention reads other keys or values than the cache the write fills")
        return False
    if len(q.users) != 1:
        ctx.reject(PATTERN, attention, "the rotated queries are read by more than the attention")
        return False
    where = _placement(write, attention, q, order)
    if where is None:
        ctx.reject(PATTERN, attention, _IN_BETWEEN)
        return False
    graph = ctx.gm.graph
    with_linear = write.target is _OPS.qkv_rotary_cache_write.default
    with graph.inserting_before(where):
        if not with_linear:
            out = graph.call_function(_OPS.rotary_cache_attention.default, (*write.args, *args[3:]))
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
    if with_linear:
        graph.erase_node(q)
    graph.erase_node(write)
    ctx.matched(PATTERN)
    return True


def run(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    order = node_order(graph)
    attentions = [n for n in graph.nodes if n.op == "call_function" and n.target is _OPS.attention.default]
    for attention in attentions:
        args = _attention_args(attention)
        write = _write_of(args[0]) if isinstance(args[0], fx.Node) else None
        if write is not None:
            fused = _fuse_rotary(ctx, attention, args, write, order)
        else:
            fused = isinstance(args[1], fx.Node) and _fuse_plain(ctx, attention, args, order)
        if fused:
            order = node_order(graph)
