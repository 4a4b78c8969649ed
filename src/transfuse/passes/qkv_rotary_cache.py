"""A decode step's norm + merged Q/K/V linear and its rotary + cache write -> one op (`QKVRotaryCache`).

After the norm_linear and kv_cache passes, a Llama-style attention reads

    qkv, s = transfuse.rms_norm_linear(x, residual, ...)      # or layer_norm_linear; activation "none"
    q, k, v = views of qkv: its [HQ | HK | HK] heads of D columns, as (B, H, n, D)
    q_rot = transfuse.rotary_kv_cache_write(keys, values, q, k, v, cos, sin, start)

and both become transfuse.qkv_rotary_cache_write, placed where the write was: in a decode step one
launch (the GEMV's epilogue rotates and writes the cache), otherwise the same two kernels as before
(ops/qkv_rotary_cache.py).

Matched by meaning: q, k and v are views of the one linear output (the recorded view ops, whatever
they are: narrow, split, view, transpose, replayed on a meta tensor of the output's shape: same
storage, offsets 0, HQ * D and (HQ + HK) * D, head stride D, token stride the output's row). Left alone, with the reason: an
output read by anything else as well, a layout that is not [q | k | v] head-major, the norm's sum
read before the write, or an input of the norm written in place in between.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from transfuse.passes.graph import _is_view, hint, node_order, tensor_meta, value, writes_in_place
from transfuse.passes.manager import PassContext

PATTERN = "QKVRotaryCache"
_OPS = torch.ops.transfuse
_NORM_LINEAR = (_OPS.rms_norm_linear.default, _OPS.layer_norm_linear.default)
# their arguments up to the activation; store_normed and store_sum may follow
_NORM_LINEAR_ARGS = {_OPS.rms_norm_linear.default: 9, _OPS.layer_norm_linear.default: 8}


def _view_chain(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """(the tensor `node` is a view of through view ops on tensors, the view nodes on the way)."""
    chain = []
    while (isinstance(node, fx.Node) and _is_view(node) and node.args and isinstance(node.args[0], fx.Node)
           and tensor_meta(node.args[0]) is not None):
        chain.append(node)
        node = node.args[0]
    return node, chain


_SPLITS = ("split", "chunk", "tensor_split", "split_with_sizes", "unbind")


def _split_base(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """_view_chain, also through a split: a piece is a getitem of the split's tuple of views."""
    base, chain = _view_chain(node)
    split = base.args[0] if base.op == "call_function" and base.target is operator.getitem else None
    if (isinstance(split, fx.Node) and split.op in ("call_method", "call_function")
            and getattr(split.target, "__name__", split.target) in _SPLITS and isinstance(split.args[0], fx.Node)):
        inner, more = _view_chain(split.args[0])
        return inner, chain + [base, split] + more
    return base, chain


def _replay_views(out: fx.Node, views: set[fx.Node], targets: tuple) -> list[torch.Tensor] | None:
    """out and the targets as views of it, replayed on a meta tensor of out's example shape. The traced
    tensors of the view nodes cannot be used: merge_linears turned separate linear outputs into
    column slices of one, and the views kept the traced layouts of the separate outputs."""
    base = tensor_meta(out)
    if base is None:
        return None
    env = {out: torch.empty_strided([hint(s) for s in base.shape], [hint(s) for s in base.stride()],
                                    dtype=base.dtype, device="meta")}

    def load(a):
        if isinstance(a, fx.Node):
            if a in env:
                return env[a]
            v = value(a)
            return hint(v) if isinstance(v, torch.SymInt) else v
        return a

    order = node_order(out.graph)
    try:
        for node in sorted(views, key=order.__getitem__):
            args, kwargs = fx.node.map_aggregate(node.args, load), fx.node.map_aggregate(node.kwargs, load)
            env[node] = getattr(args[0], node.target)(*args[1:], **kwargs) if node.op == "call_method" \
                else node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001  (a view that does not replay: not this pattern)
        return None
    result = [env[out]] + [env.get(t) for t in targets]
    return result if all(isinstance(t, torch.Tensor) for t in result) else None


def _layout(out: fx.Node, views: set[fx.Node], q: fx.Node, k: fx.Node, v: fx.Node, keys: fx.Node) -> str | None:
    """None when q, k, v are the [HQ | HK | HK] heads of `out` (B, n, (HQ + 2 HK) * D) as (B, H, n, D)
    views, else why not. Checked on the example sizes (the layout a chain of views gives does not
    depend on them); strides of size-1 dimensions address nothing and are not compared."""
    cache = tensor_meta(keys)
    replayed = _replay_views(out, views, (q, k, v))
    if cache is None or replayed is None:
        return "q, k and v are not views of the linear's output"
    base, metas = replayed[0], replayed[1:]
    if base.dim() != 3 or any(m.dim() != 4 for m in metas):
        return "the linear's output or q, k, v are not (batch, tokens, columns) and (batch, heads, tokens, head_dim)"
    HQ, HK, D, N = metas[0].shape[1], cache.shape[1], cache.shape[3], base.shape[2]
    if not all(isinstance(s, int) for s in (HK, D, N)) or N != (HQ + 2 * HK) * D:
        return "the linear's columns are not q, k and v heads of the cache's head_dim"
    B, n = hint(base.shape[0]), hint(base.shape[1])
    for meta, heads, offset in zip(metas, (HQ, HK, HK), (0, HQ * D, (HQ + HK) * D)):
        strides = [(s, w) for s, w, size in zip(meta.stride(), (n * N, D, N, 1), meta.shape) if size != 1]
        if not (torch._C._is_alias_of(meta, base) and tuple(meta.shape) == (B, heads, n, D)
                and all(s == w for s, w in strides) and meta.storage_offset() == offset):
            return "q, k and v are not the [q | k | v] head-major column blocks of the linear's output"
    return None


def _fused_args(norm_linear: fx.Node, write: fx.Node, q_heads: int) -> tuple:
    keys, values, _q, _k, _v, cos, sin, start = write.args
    if norm_linear.target is _OPS.rms_norm_linear.default:
        x, residual, norm_weight, eps, offset, cast, weight, bias, _act = norm_linear.args[:9]
        norm = (x, residual, norm_weight, None, eps, offset, cast, False)
    else:
        x, residual, norm_weight, norm_bias, eps, weight, bias, _act = norm_linear.args[:8]
        norm = (x, residual, norm_weight, norm_bias, eps, 0.0, False, True)
    return (*norm, weight, bias, keys, values, cos, sin, start, q_heads)


def _obstacle(norm_linear: fx.Node, write: fx.Node, summed: fx.Node | None, order) -> str | None:
    """Why norm_linear cannot move down to the write, or None."""
    if summed is not None and any(order[u] < order[write] for u in summed.users):
        return "the norm's sum is read before the cache write"
    inputs = set(norm_linear.all_input_nodes)
    node = norm_linear.next
    while node is not write:
        if writes_in_place(node) and inputs & set(node.all_input_nodes):
            return f"{node.name} writes an input of the norm in place before the cache write"
        node = node.next
    return None


def run(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    writes = [n for n in graph.nodes if n.op == "call_function" and n.target is _OPS.rotary_kv_cache_write.default]
    order = node_order(graph)
    for write in writes:
        keys, values, q, k, v, cos, sin, start = write.args
        found = [_split_base(t) for t in (q, k, v)]
        out = found[0][0]
        if any(base is not out for base, _ in found) or not (
                out.op == "call_function" and out.target is operator.getitem and out.args[1] == 0):
            continue
        norm_linear = out.args[0]
        if not (isinstance(norm_linear, fx.Node) and norm_linear.target in _NORM_LINEAR):
            continue
        flags = norm_linear.args[_NORM_LINEAR_ARGS[norm_linear.target]:]  # (store_normed, store_sum) or ()
        if flags and flags[0]:
            ctx.reject(PATTERN, write, "the normalised rows are read again (a post-norm layer's residual)")
            continue
        if norm_linear.args[_NORM_LINEAR_ARGS[norm_linear.target] - 1] != "none":
            ctx.reject(PATTERN, write, "the Q/K/V linear has an activation")
            continue
        views = {n for _, chain in found for n in chain}
        if any(u not in views and u is not write for n in views | {out} for u in n.users):
            ctx.reject(PATTERN, write, "the Q/K/V output is read by more than the rotary cache write")
            continue
        reason = _layout(out, views, q, k, v, keys)
        if reason is not None:
            ctx.reject(PATTERN, write, reason)
            continue
        sums = [u for u in norm_linear.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == 1]
        summed = sums[0] if sums else None
        reason = _obstacle(norm_linear, write, summed, order)
        if reason is not None:
            ctx.reject(PATTERN, write, reason)
            continue
        with graph.inserting_before(write):
            fused = graph.call_function(_OPS.qkv_rotary_cache_write.default,
                                        _fused_args(norm_linear, write, tensor_meta(q).shape[1]))
            q_rot = graph.call_function(operator.getitem, (fused, 0))
            q_rot.meta.update(write.meta)
            if summed is not None:
                new_sum = graph.call_function(operator.getitem, (fused, 1))
                new_sum.meta.update(summed.meta)
        write.replace_all_uses_with(q_rot)
        graph.erase_node(write)
        if summed is not None:
            summed.replace_all_uses_with(new_sum)
            graph.erase_node(summed)
        order = node_order(graph)
        ctx.matched(PATTERN)
