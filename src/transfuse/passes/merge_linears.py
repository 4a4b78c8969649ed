"""Sibling linears that read the same input become one GEMM (`SiblingLinears`): Q, K and V
projections of one hidden state (every Hugging Face attention block), gate and up projections of a
gated MLP.

The weights are concatenated once, at compile time, into one buffer, and the user's parameters
become views of that buffer: they keep their values and identity, `load_state_dict` still writes
through to what the GEMM reads, and GPU memory does not grow. `runtime/weights.py` re-checks the
views before every call, so a parameter the user replaced is copied in, never read stale.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from transfuse.passes.graph import (add_buffer, arg, hint, kind, node_order, static_inputs, strides_read_downstream,
                                   tensor_meta, value)
from transfuse.passes.manager import PassContext

PATTERN = "SiblingLinears"


def run(ctx: PassContext) -> None:
    statics = static_inputs(ctx.gm)
    for x in list(ctx.gm.graph.nodes):
        groups: dict[tuple, list[fx.Node]] = {}
        for user in x.users:
            if kind(user) != "linear" or user.args[0] is not x:
                continue
            w, b = arg(user, 1, "weight"), arg(user, 2, "bias")
            if w not in statics or (b is not None and b not in statics):
                continue
            wt = ctx.placeholder_value(w)
            if wt is None or wt.dim() != 2:
                continue
            key = (wt.dtype, wt.device, wt.shape[1], b is None)
            groups.setdefault(key, []).append(user)
        for members in groups.values():
            if len(members) < 2:
                continue
            reason = _merge(ctx, x, members)
            if reason:
                ctx.reject(PATTERN, members[0], reason)
            else:
                ctx.matched(PATTERN)


def _merge(ctx: PassContext, x: fx.Node, members: list[fx.Node]) -> str | None:
    weights = [ctx.placeholder_value(arg(m, 1, "weight")) for m in members]
    biases = [ctx.placeholder_value(arg(m, 2, "bias")) if arg(m, 2, "bias") is not None else None for m in members]
    if len({id(w) for w in weights}) != len(weights):
        return "the same weight appears twice"
    sizes = [w.shape[0] for w in weights]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    for m, off, n in zip(members, offsets, sizes):
        if not _views_stay_valid(m, off, n, sum(sizes)):
            return f"a user of '{m.name}' reshapes it in a way a column slice cannot be viewed"
        reader = strides_read_downstream(m)
        if reader is not None:
            return (f"'{reader.name}' reads the strides of '{m.name}' (as traced, unmerged): a column slice "
                    "of the merged output has others")

    fused_w = _fused(weights)
    fused_b = _fused(biases) if biases[0] is not None else None
    statics = static_inputs(ctx.gm)
    ctx.merged_weights.append(([statics[arg(m, 1, "weight")] for m in members], weights, fused_w))
    if fused_b is not None:
        ctx.merged_weights.append(([statics[arg(m, 2, "bias")] for m in members], biases, fused_b))

    graph = ctx.gm.graph
    order = node_order(graph)
    first = min(members, key=order.__getitem__)
    name_w = add_buffer(ctx.gm, "_transfuse_merged_", fused_w)
    name_b = add_buffer(ctx.gm, "_transfuse_merged_", fused_b) if fused_b is not None else None
    with graph.inserting_before(first):
        w_node = graph.get_attr(name_w)
        b_node = graph.get_attr(name_b) if name_b else None
        w_node.meta["example_value"] = fused_w
        if b_node is not None:
            b_node.meta["example_value"] = fused_b
        fused = graph.call_function(torch.nn.functional.linear, (x, w_node, b_node))
        out_meta = tensor_meta(members[0])
        if out_meta is not None:
            fused.meta["example_value"] = out_meta.new_empty(out_meta.shape[:-1] + (sum(sizes),))
        for m, off, n in zip(members, offsets, sizes):
            part = graph.call_method("narrow", (fused, -1, off, n))
            part.meta["example_value"] = m.meta.get("example_value")
            m.replace_all_uses_with(part)
    for m in members:
        graph.erase_node(m)
    return None


def _fused(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One buffer holding `tensors` back to back, the tensors re-pointed at their slices. Reuses the
    buffer when they already are consecutive slices of one (a second compile of the same model)."""
    first = tensors[0]
    storage = first.untyped_storage()
    total = sum(t.shape[0] for t in tensors)
    shape = (total,) + tuple(first.shape[1:])
    offset = first.storage_offset()
    expected = offset
    consecutive = True
    for t in tensors:
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.storage_offset() != expected or not t.is_contiguous():
            consecutive = False
            break
        expected += t.numel()
    if consecutive:
        fused = first.new_empty(0).set_(storage, offset, shape, first.new_empty(shape).stride())
        return fused.detach()
    with torch.no_grad():
        fused = torch.cat([t.detach() for t in tensors], dim=0).contiguous()
    start = 0
    for t in tensors:
        n = t.shape[0]
        t.data = fused[start : start + n]
        start += n
    return fused


def _views_stay_valid(member: fx.Node, offset: int, size: int, total: int) -> bool:
    """A column slice of the fused output has the row stride of the fused output; check on a meta
    tensor that every `.view` of the member still works on such a slice."""
    meta = tensor_meta(member)
    if meta is None:
        return False
    # Sizes at their traced values: whether the view exists depends on the layout, not the values.
    fused = torch.empty([hint(s) for s in meta.shape[:-1]] + [total], device="meta", dtype=meta.dtype)
    part = fused.narrow(-1, offset, size)
    for user in member.users:
        if kind(user) == "view":
            dims = user.args[1:] if len(user.args) > 2 or not isinstance(user.args[1], (list, tuple)) else user.args[1]
            dims = [value(d) if isinstance(d, fx.Node) else d for d in dims]
            if any(not isinstance(d, (int, torch.SymInt)) for d in dims):
                return False
            try:
                part.view(*[hint(d) for d in dims])
            except RuntimeError:
                return False
        elif kind(user) is None and user.op != "call_function":
            return False
    return True
