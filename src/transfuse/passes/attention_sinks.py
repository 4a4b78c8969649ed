"""The pieces of hand-written attention with sinks (GPT-OSS), read by passes/attention.py's matcher.

Hugging Face's GPT-OSS eager attention (transformers/models/gpt_oss/modeling_gpt_oss.py) gives every
query head one learned logit that takes part in the softmax but has no value:

    sinks = module.sinks.reshape(1, -1, 1, 1).expand(batch, -1, seq_q, -1)
    combined = torch.cat([scores, sinks], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1)[..., :-1]        # the sink's column dropped
    out = probs @ v

Read by meaning, each piece on its own: a row maximum subtracted from the scores (softmax does not
change when every score of a row moves by one value, so it is dropped wherever it appears), a sink
column concatenated after the keys, and that last column dropped after the softmax. The sink must
be one value per query head (broadcast over batch and queries): the kernel reads one float per head.

Granite-SWA (transformers/models/granite_swa/modeling_granite_swa.py) writes the same sink after the
value product instead:

    lse = torch.logsumexp(scores, dim=-1)
    out = (softmax(scores) @ v) * sigmoid(lse - sinks.view(1, -1, 1)).unsqueeze(-1)    (casts anywhere)

sigmoid(lse - sink) = sum(e^s) / (sum(e^s) + e^sink): the sink logit in the softmax's denominator,
GPT-OSS's meaning (lse_sink_scale).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from transfuse.passes.graph import arg, kind, single_user, tensor_meta

_CATS = (torch.cat, torch.concat, torch.concatenate)


def _is_method(node, *names) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target in names


def _last_dim(dim, rank: int) -> bool:
    return isinstance(dim, int) and rank > 0 and dim % rank == rank - 1


def row_max(node, of: fx.Node) -> list[fx.Node] | None:
    """The nodes of `of.max(dim=-1, keepdim=True).values` (or `.amax(-1, keepdim=True)`, torch.max,
    torch.amax) when `node` is that; else None."""
    reduce = node
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem:
        if node.args[1] != 0:
            return None
        reduce = node.args[0]
    if not isinstance(reduce, fx.Node):
        return None
    is_max = _is_method(reduce, "max") or (reduce.op == "call_function" and reduce.target is torch.max)
    is_amax = _is_method(reduce, "amax") or (reduce.op == "call_function" and reduce.target is torch.amax)
    if not (is_max or is_amax) or reduce.args[0] is not of:
        return None
    if (is_max and reduce is node) or (is_amax and reduce is not node):
        return None  # max with a dim returns (values, indices), its values are item 0; amax a tensor
    meta = tensor_meta(of)
    if meta is None or not arg(reduce, 2, "keepdim", False) or not _last_dim(arg(reduce, 1, "dim"), meta.dim()):
        return None
    return [node] if reduce is node else [node, reduce]


def drops_last_column(node: fx.Node) -> bool:
    """`probs[..., :-1]` (any spelling of full slices before it)."""
    if not (node.op == "call_function" and node.target is operator.getitem):
        return False
    index = node.args[1]
    if not isinstance(index, tuple) or not index:
        return False
    *lead, last = index
    full = slice(None, None, None)
    meta = tensor_meta(node.args[0])
    if meta is None or last not in (slice(None, -1, None), slice(0, -1, None)):
        return False
    if lead == [Ellipsis]:
        return True
    return len(lead) == meta.dim() - 1 and all(i == full for i in lead)


def sink_column(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(scores, per-head sinks before their broadcast) for `torch.cat([scores, sinks], dim=-1)`
    whose second part is one column broadcast from one value per head; else None."""
    if not (node.op == "call_function" and node.target in _CATS):
        return None
    parts = arg(node, 0, "tensors")
    dim = arg(node, 1, "dim", 0)
    scores = tensor_meta(parts[0]) if isinstance(parts, (list, tuple)) and len(parts) == 2 else None
    if scores is None or scores.dim() != 4 or not _last_dim(dim, 4):
        return None
    sinks = parts[1]
    while _is_method(sinks, "expand", "expand_as"):
        sinks = sinks.args[0]
    if not _one_per_head(sinks, scores.shape[1], 4):
        return None
    return parts[0], sinks


def _one_per_head(sinks, heads, rank: int) -> bool:
    """Whether `sinks`, right-aligned against a tensor of `rank` dims whose dim 1 holds the `heads`
    query heads, is one value per head: size `heads` along dim 1 and 1 along every other (not
    varying by batch or query: the kernel reads one float per head)."""
    meta = tensor_meta(sinks)
    if meta is None or not isinstance(heads, int) or meta.dim() > rank or meta.numel() != heads:
        return False
    shape = (1,) * (rank - meta.dim()) + tuple(meta.shape)
    return shape[1] == heads and all(s == 1 for i, s in enumerate(shape) if i != 1)


def is_row_logsumexp(node, of: fx.Node) -> bool:
    """`torch.logsumexp(of, dim=-1)` (or the method), without keepdim."""
    if not isinstance(node, fx.Node) or not ((node.op == "call_function" and node.target is torch.logsumexp)
                                             or _is_method(node, "logsumexp")):
        return False
    meta = tensor_meta(of)
    return (node.args[0] is of and meta is not None and _last_dim(arg(node, 1, "dim"), meta.dim())
            and not arg(node, 2, "keepdim", False))


def lse_sink_scale(lse: fx.Node, output: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(the product that ends the pattern, the sinks) for Granite-SWA's `output * sigmoid(lse -
    sinks.view(1, -1, 1)).unsqueeze(-1)` (casts anywhere on the scale's path), where `lse` is the
    scores' row logsumexp (is_row_logsumexp) and `output` the value product; else None. The sinks must
    be one value per query head and the product keep `output`'s dtype."""
    sub = single_user(lse)
    if sub is None or kind(sub) != "sub" or sub.args[0] is not lse:
        return None
    sinks, lse_meta = sub.args[1], tensor_meta(lse)
    if lse_meta is None or lse_meta.dim() != 3 or not _one_per_head(sinks, lse_meta.shape[1], 3):
        return None
    cur, sigmoids = sub, 0
    while (user := single_user(cur)) is not None and user.op != "output":
        k = kind(user)
        if k == "sigmoid":
            sigmoids += 1
        elif k == "to" or (_is_method(user, "unsqueeze") and arg(user, 1, "dim") in (-1, 3)):
            pass
        else:
            break
        cur = user
    product = single_user(cur)
    if sigmoids != 1 or tensor_meta(cur) is None or tensor_meta(cur).dim() != 4 or product is None:
        return None
    if kind(product) != "mul" or {id(a) for a in product.args[:2]} != {id(cur), id(output)}:
        return None
    out_meta, product_meta = tensor_meta(output), tensor_meta(product)
    if single_user(output) is not product or out_meta is None or product_meta is None \
            or product_meta.dtype != out_meta.dtype or tuple(product_meta.shape) != tuple(out_meta.shape):
        return None
    return product, sinks
