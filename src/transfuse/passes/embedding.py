"""Embedding lookups summed into a layer norm -> one transfuse.embedding_layer_norm.

* `EmbeddingLayerNorm` — `LayerNorm(word(ids) + token_type(tt) + position(pos))`, the input layer
  of BERT, RoBERTa, ELECTRA, ALBERT, DistilBERT and MiniLM
  (transformers/models/bert/modeling_bert.py, BertEmbeddings.forward). Runs after the norm passes
  and matches what they left: `transfuse.layer_norm(sum)` where the position lookup broadcasts
  ((1, S) positions against (B, S) ids), `transfuse.add_layer_norm(a, b)` where it does not
  (RoBERTa counts positions per sequence), its two inputs being the last addend and the rest.

The sum must be a chain of adds (each adds one lookup to the running sum) whose only reader is the
next add, and each leaf `F.embedding` without max_norm (which renormalises the table in place);
padding_idx only changes gradients and is ignored. The lookups are passed in eager's order, so the
kernel rounds after each add exactly where eager does. Forward only (not in training graphs).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from transfuse.kernels.embedding import MAX_LOOKUPS
from transfuse.kernels.norm import MAX_N
from transfuse.passes.graph import arg, kind, tensor_meta
from transfuse.passes.manager import PassContext

PATTERN = "EmbeddingLayerNorm"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def run(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.transfuse.layer_norm.default:
            sums, params, outputs = [node.args[0]], node.args[1:4], [node]
            shared = [] if len(node.args[0].users) == 1 else [node.args[0]]
        elif node.target is torch.ops.transfuse.add_layer_norm.default:
            sums, params = list(node.args[:2]), node.args[2:5]
            outputs = list(node.users)  # getitem 0, and getitem 1 when the sum is stored
            if not outputs:
                continue
            shared = [node] if node.args[5] or any(u.args[1] != 0 for u in outputs) else []
        else:
            continue
        found = _lookups(node, sums, shared)
        if found is None:
            continue  # no embedding among the addends: not this pattern
        if isinstance(found, str):
            ctx.reject(PATTERN, node, found)
            continue
        leaves, adds = found
        _replace(ctx, node, outputs, leaves, adds, params)


def _is_add(node) -> bool:
    """`a + b` of two tensors, no alpha."""
    return (isinstance(node, fx.Node) and kind(node) == "add" and len(node.args) >= 2
            and all(isinstance(a, fx.Node) and tensor_meta(a) is not None for a in node.args[:2])
            and arg(node, 2, "alpha", 1) == 1)


def _is_embedding(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is F.embedding


def _terms(node: fx.Node, adds: list, problems: list) -> list:
    """The addends of `node` in the order eager adds them: a chain `((e0 + e1) + e2)` gives
    [e0, e1, e2]; `e2 + (e0 + e1)` the same (addition of two numbers commutes bit for bit). Only
    single-reader adds are opened: a sum read elsewhere is a leaf."""
    if not _is_add(node) or len(node.users) != 1:
        return [node]
    adds.append(node)
    return _chain(_terms(node.args[0], adds, problems), _terms(node.args[1], adds, problems), node, problems)


def _chain(left: list, right: list, node: fx.Node, problems: list) -> list:
    """The addends of left + right in eager's order, if one side is a single term."""
    if len(left) > 1 and len(right) > 1:
        problems.append(f"'{node.name}' adds two sums: eager's rounding order is not a chain of lookups")
    return left + right if len(right) == 1 else right + left


def _lookups(norm: fx.Node, sums: list, shared: list):
    """([embedding leaves in eager's order], [the adds between them]) for the norm's addends; None
    when no leaf is an embedding (not this pattern); a reason when it looked like one but isn't."""
    adds, problems = [], []
    if len(sums) == 1 and shared and _is_add(sums[0]):
        # transfuse.layer_norm(s) with s read elsewhere too: look inside only to say why not
        leaves = _terms(sums[0].args[0], adds, problems) + _terms(sums[0].args[1], adds, problems)
    elif len(sums) == 2:  # add_layer_norm(x, residual) adds x + residual itself
        leaves = _chain(_terms(sums[0], adds, problems), _terms(sums[1], adds, problems), norm, problems)
    else:
        leaves = _terms(sums[0], adds, problems)
    if not any(_is_embedding(leaf) for leaf in leaves):
        return None
    if shared:
        return f"the sum '{shared[0].name}' is also read elsewhere (a residual stream): the kernel does not store it"
    if problems:
        return problems[0]
    for leaf in leaves:
        if not _is_embedding(leaf):
            return f"addend '{leaf.name}' is not an embedding lookup (or its sum is read elsewhere)"
        reason = _check_lookup(leaf)
        if reason:
            return reason
    if len(leaves) > MAX_LOOKUPS:
        return f"{len(leaves)} lookups, more than the kernel's {MAX_LOOKUPS}"
    tables = [tensor_meta(arg(leaf, 1, "weight")) for leaf in leaves]
    if len({t.dtype for t in tables}) != 1:
        return f"tables of mixed dtypes {sorted({str(t.dtype) for t in tables})}"
    if len({t.shape[1] for t in tables}) != 1:
        return f"tables of different embedding sizes {[t.shape[1] for t in tables]}"
    return leaves, adds


def _check_lookup(leaf: fx.Node) -> str | None:
    idx, table = tensor_meta(arg(leaf, 0, "input")), tensor_meta(arg(leaf, 1, "weight"))
    if len(leaf.users) != 1:
        return f"lookup '{leaf.name}' is also read elsewhere"
    if arg(leaf, 3, "max_norm") is not None:
        return f"lookup '{leaf.name}' has max_norm (renormalises its table in place)"
    if idx is None or idx.dtype not in INDEX_DTYPES:
        return f"lookup '{leaf.name}' has indices of {getattr(idx, 'dtype', None)}, not int32 or int64"
    if table is None or table.dim() != 2 or table.dtype not in SUPPORTED_DTYPES:
        return f"lookup '{leaf.name}' reads a table that is not a 2-D 16/32-bit float tensor"
    if not isinstance(table.shape[1], int) or table.shape[1] > MAX_N:
        return f"lookup '{leaf.name}' has an embedding size above MAX_N={MAX_N} or not static"
    return None


def _replace(ctx: PassContext, norm: fx.Node, outputs: list, leaves: list, adds: list, params) -> None:
    graph = ctx.gm.graph
    weight, bias, eps = params
    indices = [arg(leaf, 0, "input") for leaf in leaves]
    tables = [arg(leaf, 1, "weight") for leaf in leaves]
    with graph.inserting_before(norm):
        new = graph.call_function(torch.ops.transfuse.embedding_layer_norm.default,
                                  (indices, tables, weight, bias, eps))
    new.meta["example_value"] = outputs[0].meta.get("example_value", outputs[0].meta.get("val"))
    for out in outputs:
        out.replace_all_uses_with(new)
        if out is not norm:
            graph.erase_node(out)  # add_layer_norm's getitem
    # The dead-code pass does not know F.embedding: erase the replaced nodes here, readers first.
    graph.erase_node(norm)
    for node in dict.fromkeys(adds + leaves):  # a lookup added to itself (`p + p`) is one node
        if not node.users:
            graph.erase_node(node)
    ctx.matched(PATTERN)

