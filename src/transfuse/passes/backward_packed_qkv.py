"""Backward graphs: a fused QKV projection's gradient written in place by the attention backward
(`PackedQKVGrad`).

GPT-2 (c_attn), nanoGPT and other models with one QKV linear split its output into q, k and v and
view each as (batch, heads, seq, head_dim). In AOTAutograd's backward graph the attention backward's
dq, dk and dv come back through those views and are concatenated for the linear's backward:

    cat([view(transpose(getitem(attention_train_bwd, i), 1, 2), (batch, seq, width_i)) for i ...], -1)

a copy of the whole gradient (GPT-2 124M at batch 8 x 1024: 12 x 37.7 MB a step, 0.22 ms on an H200,
bench/profile_train_ops.py, 2026-11-26). transfuse::attention_train_bwd_packed writes the three
gradients into their places in one (batch, seq, width) tensor instead, and the cat is gone.

Hugging Face's GPT-2 with use_cache (its default, in training too) also returns each layer's k and v
in its cache, so dk and dv first get those outputs' gradients added (zeros unless something reads
the cache), and the transposed sums are made contiguous before the cat:

    _unsafe_view(clone(transpose(add(tangent, getitem(attention_train_bwd, 1)), 1, 2)), ...)

The addition moves into the kernel (grad_k_extra / grad_v_extra: one fp32 add before the one
rounding, where eager rounds dk and then the sum), and the clone goes with the cat.

Taken only when each of dq, dk and dv reaches the cat through exactly those nodes and nothing else
reads them (the cat's order is passed on: any permutation). Runs on the aten graphs AOTAutograd
hands runtime/training_graphs.py, before passes/backward_column_sum.py (which then sums the packed
tensor for the linear's bias gradient).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from transfuse.passes.graph import node_order

PATTERN = "PackedQKVGrad"

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)


def run(gm: fx.GraphModule) -> int:
    """Rewrites every concatenation of one attention backward's dq, dk and dv; returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        matched = _packed_cat(node)
        if matched is None:
            continue
        bwd, order, chains, extras = matched
        # The packed op goes right after its last input (the backward, or an addend computed
        # later), so that whatever reads dbias between the backward and the cat still comes after
        # it; where a reader comes earlier than that, the graph stays as it is.
        position = node_order(gm.graph)
        last = max([bwd] + [e for e in extras.values() if e is not None], key=position.__getitem__)
        dbias = [u for u in bwd.users if u.args[1] == 3]
        if any(position[reader] <= position[last] for u in dbias for reader in u.users):
            continue
        with gm.graph.inserting_after(last):
            packed = gm.graph.call_function(torch.ops.transfuse.attention_train_bwd_packed.default,
                                            (*bwd.args, order, extras[1], extras[2]))
        with gm.graph.inserting_after(packed):
            dqkv = gm.graph.call_function(operator.getitem, (packed, 0))
            new_dbias = gm.graph.call_function(operator.getitem, (packed, 1)) if dbias else None
        dqkv.meta["val"] = node.meta["val"]
        old = bwd.meta.get("val")
        if isinstance(old, (tuple, list)) and len(old) == 4:
            packed.meta["val"] = (node.meta["val"], old[3])
        node.replace_all_uses_with(dqkv)
        gm.graph.erase_node(node)
        for chain in chains:  # view <- [clone] <- transpose <- [add] <- getitem, now unused
            for link in chain:
                gm.graph.erase_node(link)
        for old_dbias in dbias:  # read by nodes after the packed op (checked above)
            new_dbias.meta.update(old_dbias.meta)
            old_dbias.replace_all_uses_with(new_dbias)
            gm.graph.erase_node(old_dbias)
        gm.graph.erase_node(bwd)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _packed_cat(node: fx.Node):
    """(attention_train_bwd node, order, [chain x 3], {1: dk's addend or None, 2: dv's}) when `node`
    concatenates its dq, dk and dv as a fused QKV linear's gradient, else None."""
    if node.op != "call_function" or node.target is not torch.ops.aten.cat.default or node.kwargs:
        return None
    if len(node.args) != 2 or not isinstance(node.args[0], (list, tuple)) or len(node.args[0]) != 3:
        return None
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 3 or node.args[1] not in (2, -1):
        return None
    bwd, order, chains, extras = None, [], [], {0: None, 1: None, 2: None}
    for part in node.args[0]:
        found = _grad_chain(part)
        if found is None:
            return None
        chain, extra = found
        getitem = chain[-1]
        extras[getitem.args[1]] = extra
        if bwd is None:
            bwd = getitem.args[0]
        elif getitem.args[0] is not bwd:
            return None
        order.append(getitem.args[1])
        chains.append(chain)
    if sorted(order) != [0, 1, 2] or bwd.kwargs or len(bwd.args) != 11 or extras[0] is not None:
        return None  # (an addend to dq has no place in the kernel)
    if any(u.target is not operator.getitem or u.args[1] not in (0, 1, 2, 3) for u in bwd.users):
        return None
    if any(u.args[1] in (0, 1, 2) and u not in {c[-1] for c in chains} for u in bwd.users):
        return None  # a second reader of dq, dk or dv
    qkv = [getattr(a, "meta", {}).get("val") for a in bwd.args[1:4]]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in qkv):
        return None
    for i, chain in zip(order, chains):  # each part is (batch, seq, heads * head_dim) of q's batch and seq
        part, like = chain[0].meta.get("val"), qkv[i]
        if not isinstance(part, torch.Tensor) or part.dim() != 3:
            return None
        if not all(statically_known_true(a == b) for a, b in zip(
                part.shape, (qkv[0].shape[0], qkv[0].shape[2], like.shape[1] * like.shape[3]))):
            return None  # not a fused projection's layout (or cross-attention: another length)
    for i, extra in extras.items():  # an addend of dk's or dv's own shape and dtype (no broadcast)
        val = getattr(extra, "meta", {}).get("val") if extra is not None else None
        if extra is not None and not (isinstance(val, torch.Tensor) and val.dtype == qkv[i].dtype and all(
                statically_known_true(a == b) for a, b in zip(val.shape, qkv[i].shape)) and val.dim() == 4):
            return None
    return bwd, order, chains, extras


def _grad_chain(part):
    """([view, (clone), transpose(1, 2), (add), getitem(attention_train_bwd, 0..2)], the add's other
    operand or None), each node read only by the next, else None."""
    if not isinstance(part, fx.Node) or part.target not in _VIEWS or len(part.users) != 1:
        return None
    chain = [part]
    transpose = part.args[0]
    if isinstance(transpose, fx.Node) and transpose.target is torch.ops.aten.clone.default:
        if len(transpose.users) != 1 or set(transpose.kwargs) - {"memory_format"}:
            return None
        chain.append(transpose)
        transpose = transpose.args[0]
    if not isinstance(transpose, fx.Node) or transpose.target is not torch.ops.aten.transpose.int:
        return None
    if sorted(d % 4 for d in transpose.args[1:3]) != [1, 2] or len(transpose.users) != 1:
        return None
    chain.append(transpose)
    getitem, extra = transpose.args[0], None
    if isinstance(getitem, fx.Node) and getitem.target is torch.ops.aten.add.Tensor and not getitem.kwargs \
            and len(getitem.users) == 1 and len(getitem.args) == 2:
        chain.append(getitem)
        a, b = getitem.args
        getitem, extra = (a, b) if _is_bwd_getitem(a) else (b, a)
        if not isinstance(extra, fx.Node):
            return None
    if not isinstance(getitem, fx.Node) or getitem.target is not operator.getitem or len(getitem.users) != 1:
        return None
    bwd = getitem.args[0]
    if not isinstance(bwd, fx.Node) or bwd.target is not torch.ops.transfuse.attention_train_bwd.default:
        return None
    if getitem.args[1] not in (0, 1, 2):
        return None
    return [*chain, getitem], extra


def _is_bwd_getitem(node) -> bool:
    return (isinstance(node, fx.Node) and node.target is operator.getitem
            and getattr(node.args[0], "target", None) is torch.ops.transfuse.attention_train_bwd.default)
