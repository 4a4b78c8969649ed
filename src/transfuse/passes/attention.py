"""Attention, matched by meaning, to `torch.ops.transfuse.attention`.

Two source idioms:

* `TorchSDPA` — `F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p=0, is_causal, scale,
  enable_gqa)`, as Hugging Face's "sdpa" attention and most modern code calls it.
* `ManualAttention` — the hand-written form: `softmax(scale * (q @ k^T) + mask) @ v`, as written by
  Hugging Face's "eager" attention (`eager_attention_forward` in
  transformers/models/bert/modeling_bert.py and its copies) and by nanoGPT
  (`att.masked_fill(bias == 0, -inf)`). Any number of scalar multiplications/divisions (the scale,
  whatever its value or spelling), additive masks of any broadcastable shape, a boolean mask applied
  with `masked_fill(-inf)` or `torch.where`, dtype casts around the softmax; no literal constant
  is ever compared against. Also with sinks (GPT-OSS: one logit per head concatenated to the scores,
  its column dropped after the softmax; Granite-SWA: the output scaled by sigmoid(logsumexp(scores) -
  sink); passes/attention_sinks.py), with the row maximum
  subtracted before the softmax, and with 3-D scores viewed to (batch, heads, ...) for a 4-D mask
  and clamped at finfo.min (XGLM, FSMT; passes/attention_views.py).

A mask shared by several layers gets one block summary (`attention_mask_summary`) per forward,
inserted once next to the mask and reused by every attention that reads it.
"""

from __future__ import annotations

import collections
import math
import operator

import torch
import torch.fx as fx

from transfuse.kernels.attention import MAX_HEAD_DIM
from transfuse.ops.attention import mask_summary_for
from transfuse.passes import causal_mask
from transfuse.passes.attention_sinks import drops_last_column, is_row_logsumexp, lse_sink_scale, row_max, sink_column
from transfuse.passes.attention_views import floor_clamp, heads_view

from transfuse.passes.graph import (
    arg,
    cast_to,
    is_last_two_transpose,
    is_tensor,
    kind,
    hint,
    node_order,
    same_shape,
    same_size,
    scalar,
    shape,
    size_arg,
    single_user,
    tensor_meta,
)
from transfuse.passes.manager import PassContext

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SDPA = "TorchSDPA"
MANUAL = "ManualAttention"
DROPOUT_SDPA = "AttentionDropoutToSDPA"
DECODE_QUERIES = 16  # at most one block of queries: the kernel's smallest BLOCK_M


class Reject(Exception):
    """A candidate that is left as it was; the message is the reason shown in the report."""


def run(ctx: PassContext) -> None:
    matches = []
    key_rows: dict = {}  # KeyPadding: a mask -> its (batch, 1, 1, keys) row of kept keys, or None
    for node in list(ctx.gm.graph.nodes):
        k = kind(node)
        if k == "sdpa":
            pattern, matcher = SDPA, _match_sdpa
        elif k == "softmax":
            if (scores := shape(node)) is not None and len(scores) < 3:
                continue  # a softmax over 1-D or 2-D rows (an MoE router's) is no attention candidate
            pattern, matcher = MANUAL, _match_manual
        else:
            continue
        try:
            spec = matcher(node)
            _check_operands(spec)
        except Reject as reason:
            ctx.reject(pattern, node, str(reason))
            continue
        if spec.get("sinks") is not None and ctx.training:
            ctx.reject(pattern, node, "attention sinks in a training graph (the training kernel has none)")
            continue
        if ctx.training and tensor_meta(spec["v"]).shape[-1] != tensor_meta(spec["q"]).shape[-1]:
            ctx.reject(pattern, node, "a value head dim other than the query's in a training graph "
                                      "(the training kernel has one head dim)")
            continue
        if ctx.training and spec.get("floor") is not None:
            # torch.max(scores, finfo.min) splits the gradient of a tie in half: a query that sees no
            # key (left padding) has every score at the floor, and eager passes half of dS to q and k
            # there, which the training kernel's backward does not.
            ctx.reject(pattern, node, "scores clamped at finfo.min in a training graph (eager's backward halves "
                                      "the gradient of queries that see no key; the training kernel does not)")
            continue
        if spec.get("dropout_p", 0.0) and (spec.get("heads_shape") is not None or spec.get("floor") is not None):
            ctx.reject(pattern, node, "dropout on probabilities viewed to heads or floored (the SDPA it would become "
                                      "reads neither)")
            continue
        if spec.get("dropout_p", 0.0) and not ctx.training:
            ctx.reject(pattern, node, f"dropout p={spec['dropout_p']} on the probabilities (model.train() without gradients)")
            continue
        if spec.get("floor") is not None:
            pass  # a floored mask keeps its form: as a causal flag or a bool key mask its fully masked rows would be NaN
        elif causal_mask.causal_buffer(ctx, spec):
            spec.update(is_causal=True, bool_masks=[])
            ctx.matched("CausalMaskBuffer")
        elif causal_mask.causal_from_shapes(ctx, spec):
            spec.update(is_causal=True, bool_masks=[], masks=[])
            ctx.matched("CausalMaskFromShapes")
        elif (padding := causal_mask.causal_key_padding(ctx, spec)) is not None:
            key_mask = _key_mask(ctx.gm.graph, *padding, spec)
            if key_mask is None:
                ctx.reject(pattern, node, "causal with key padding, but the batch or key length is held by no graph input")
            else:
                spec.update(is_causal=True, bool_masks=[], masks=[key_mask])
                ctx.matched("CausalKeyPadding")
        elif not ctx.training and spec["masks"] and not spec.get("is_causal"):
            whole = spec["masks"][0]
            if whole not in key_rows:
                key_rows[whole] = causal_mask.key_rows(ctx, spec)  # once per mask: every layer reads it
            if key_rows[whole] is not None:
                spec.update(masks=[key_rows[whole]])
                ctx.matched("KeyPadding")
        if spec.get("dropout_p", 0.0):
            _replace_with_sdpa(ctx, spec)
            ctx.matched(DROPOUT_SDPA)
            continue
        matches.append((pattern, spec))
    readers = collections.Counter(_mask_key(spec) for _, spec in matches)
    summaries: dict[tuple, fx.Node] = {}
    for pattern, spec in matches:
        _replace(ctx, spec, summaries, summarise=_worth_a_summary(spec, readers[_mask_key(spec)]))
        ctx.matched(pattern)


def _key_mask(graph: fx.Graph, padding: fx.Node, exact: tuple[bool, bool], spec: dict) -> fx.Node | None:
    """causal_mask.key_padding_mask of the attention_mask `padding` for this attention's batch and
    keys: (batch, 1, 1, keys) bool; None when those sizes are expressions no graph input holds."""
    batch, keys = tensor_meta(spec["q"]).shape[0], tensor_meta(spec["v"]).shape[-2]
    batch_arg, keys_arg = size_arg(graph, batch), size_arg(graph, keys)
    if batch_arg is None or keys_arg is None:
        return None
    with graph.inserting_before(spec["out"]):
        mask = graph.call_function(causal_mask.key_padding_mask, (padding, batch_arg, keys_arg, exact))
    mask.meta["example_value"] = tensor_meta(padding).new_empty((batch, 1, 1, keys), dtype=torch.bool)
    return mask


def _replace_with_sdpa(ctx: PassContext, spec: dict) -> None:
    """Hand-written attention with dropout on the probabilities, in a training graph: transfuse's
    kernels have no dropout yet, so it becomes PyTorch's fused F.scaled_dot_product_attention with
    the same dropout_p (the same distribution; not eager's random stream) instead of the T x T
    probabilities eager materialises and keeps for backward."""
    graph = ctx.gm.graph
    out: fx.Node = spec["out"]
    with graph.inserting_before(out):
        operands = (spec["q"], _keys(graph, spec), spec["v"])
        settings = dict(attn_mask=_combined_mask(graph, spec), dropout_p=float(spec["dropout_p"]),
                        is_causal=spec["is_causal"], scale=float(spec["scale"]))
        new = graph.call_function(torch.nn.functional.scaled_dot_product_attention, operands, settings)
    new.meta["example_value"] = out.meta.get("example_value")
    out.replace_all_uses_with(new)
    graph.erase_node(out)


def _mask_key(spec: dict) -> tuple:
    """The nodes a spec's mask is made of, and its query length: equal keys share one summary."""
    return (tuple(spec["masks"]), tuple(c for _, c in spec["bool_masks"]), str(tensor_meta(spec["q"]).shape[-2]))


def _worth_a_summary(spec: dict, readers: int) -> bool:
    """A decode step (a few queries, a fixed number at trace time) whose mask no other layer reads
    (T5 adds its position bias to the mask in every layer) gains nothing from a block summary: one
    block of queries reads each mask row once anyway, and the summary is a launch of its own per
    layer (t5-base: 24 per step, each longer than the attention it serves)."""
    seq_q = tensor_meta(spec["q"]).shape[-2]
    return readers > 1 or not isinstance(seq_q, int) or seq_q > DECODE_QUERIES


# --------------------------------------------------------------------------------------------
# Matching: each matcher returns a spec dict or raises Reject.


def _match_sdpa(node: fx.Node) -> dict:
    q, k, v = arg(node, 0, "query"), arg(node, 1, "key"), arg(node, 2, "value")
    mask = arg(node, 3, "attn_mask")
    dropout_p = scalar(arg(node, 4, "dropout_p", 0.0))
    is_causal = arg(node, 5, "is_causal", False)
    scale = arg(node, 6, "scale", None)
    enable_gqa = arg(node, 7, "enable_gqa", False)
    if dropout_p != 0.0:
        raise Reject(f"dropout_p={arg(node, 4, 'dropout_p')} (only inference attention is fused)")
    if not isinstance(is_causal, bool) or not isinstance(enable_gqa, bool):
        raise Reject("is_causal / enable_gqa are not compile-time constants")
    if scale is not None and scalar(scale) is None:
        raise Reject("scale is not a compile-time constant")
    head_dim = shape(q)[-1] if shape(q) else None
    if head_dim is None:
        raise Reject("query has no static shape")
    if mask is not None and not is_tensor(mask):
        raise Reject("attn_mask is not a tensor")
    if (not enable_gqa and not same_shape(shape(q)[:-3] + shape(q)[-3:-2], shape(k)[:-3] + shape(k)[-3:-2])
            and not _one_kv_head_broadcast(q, k, v)):
        raise Reject("query and key head counts differ without enable_gqa")
    return dict(
        out=node, q=q, k=k, v=v, k_transposed=False, masks=[mask] if mask is not None else [],
        bool_masks=[], scale=1.0 / math.sqrt(head_dim) if scale is None else scalar(scale),
        is_causal=is_causal, masked_rows_zero=True, chain=[], autocast=_autocast_dtype(node, (q, k, v)),
    )


def _one_kv_head_broadcast(q: fx.Node, k: fx.Node, v: fx.Node) -> bool:
    """Multi-query attention written as SDPA's broadcast (Falcon's multi_query): one key/value head
    of size 1 that SDPA broadcasts over the query heads, batch sizes equal. The kernel reads it as
    grouped-query attention with one group."""
    qs, ks, vs = shape(q), shape(k), shape(v)
    return (qs is not None and ks is not None and vs is not None and len(qs) == len(ks) == len(vs) == 4
            and ks[1] == 1 and vs[1] == 1 and same_shape(qs[:1], ks[:1]) and same_shape(ks[:1], vs[:1]))


def _autocast_dtype(node: fx.Node, operands) -> torch.dtype | None:
    """The half dtype torch.autocast runs this SDPA in, or None. Under autocast SDPA casts every
    floating argument to the autocast dtype, which its recorded output then has; without autocast q,
    k and v must share a dtype, which the output keeps. (Llama's rotary products and its cache's
    torch.cat leave q, k and v in fp32 on an autocast model: eager's attention still runs in bf16.)"""
    out, metas = tensor_meta(node), [tensor_meta(t) for t in operands]
    if out is None or any(m is None or not m.dtype.is_floating_point for m in metas):
        return None
    if out.dtype in (torch.float16, torch.bfloat16) and any(m.dtype != out.dtype for m in metas):
        return out.dtype
    return None


def _leads_to_scores(node, depth: int = 12) -> bool:
    """Whether `node` is the score chain: reaches a matmul through casts/scales/masks."""
    while depth > 0 and isinstance(node, fx.Node):
        k = kind(node)
        if k == "matmul":
            return True
        if k not in ("to", "mul", "div", "add", "sub", "masked_fill", "where", "view", "reshape"):
            return False
        nxt = [a for a in node.args if isinstance(a, fx.Node) and is_tensor(a)]
        if k == "where":
            nxt = nxt[1:]
        return any(_leads_to_scores(a, depth - 1) for a in nxt)
    return False


def _match_manual(softmax: fx.Node) -> dict:
    scores_shape = shape(softmax)
    if scores_shape is None or len(scores_shape) not in (3, 4):
        raise Reject("softmax input is not a 3-D or 4-D score tensor")
    dim = arg(softmax, 1, "dim")
    if dim is None or dim % len(scores_shape) != len(scores_shape) - 1:
        raise Reject(f"softmax over dim {dim}, not the key dimension")

    # Forward: casts, then `probs @ v`.
    chain = [softmax]
    cur = softmax
    dropout_p = 0.0
    drop_last = False  # the sink's column dropped from the probabilities
    while (user := single_user(cur)) is not None:
        if heads_view(user) is not None:
            pass  # a view that splits or merges batch and heads: checked by the shape below
        elif not drop_last and drops_last_column(user):
            drop_last = True
        elif kind(user) == "dropout" and not dropout_p:  # only p > 0 in training mode is left by the dropout pass
            dropout_p = scalar(arg(user, 1, "p", 0.5))
            if dropout_p is None or arg(user, 2, "training", True) is not True or arg(user, 3, "inplace", False):
                raise Reject("dropout on the probabilities with settings that are not constants")
        elif kind(user) != "to":
            break
        chain.append(user)
        cur = user
    pv = single_user(cur)
    if pv is None or kind(pv) != "matmul" or pv.args[0] is not cur:
        raise Reject("softmax output is not (only) multiplied by a value tensor")
    if not drop_last and not same_shape(shape(cur), scores_shape):
        raise Reject("the probabilities are viewed to another shape before the value product")
    v = pv.args[1]
    out = pv

    # Sinks applied after the value product, as a scale from the scores' row logsumexp (Granite-SWA)
    scores_in = arg(softmax, 0, "input")
    lse = [u for u in scores_in.users if is_row_logsumexp(u, scores_in)] if isinstance(scores_in, fx.Node) else []
    lse_sinks = None
    if len(lse) == 1:
        found = lse_sink_scale(lse[0], pv)
        if found is None or drop_last:
            raise Reject("the scores' row logsumexp is read otherwise than as a sink scale of the output")
        out, lse_sinks = found
    else:
        lse = []  # several: the scores have other users (below)

    # Backward from the softmax input: casts, scalar scales, masks, down to `q @ k^T`.
    scale = 1.0
    masks: list = []
    bool_masks: list = []
    sinks = None
    floor = None  # a clamp of the scores at finfo.min
    heads_shape = None  # (B, H, T, S) of a view that splits 3-D scores into batch and heads
    row_maxima: set = set()  # the row maximum subtracted from a node also reads that node
    x = arg(softmax, 0, "input")
    while True:
        if not isinstance(x, fx.Node):
            raise Reject("softmax input is not a graph value")
        k = kind(x)
        if len(set(x.users) - row_maxima - (set(lse) if x is scores_in else set())) != 1:
            raise Reject(f"intermediate score tensor '{x.name}' has other users")
        chain.append(x)
        if (column := sink_column(x)) is not None:
            if not drop_last or sinks is not None:
                raise Reject("a column concatenated to the scores that the softmax output keeps")
            x, sinks = column
            continue
        if (view := heads_view(x)) is not None:
            x, four = view
            heads_shape = four if four is not None else heads_shape
            continue
        if (clamp := floor_clamp(x)) is not None:
            if floor is not None:
                raise Reject("the scores are clamped twice")
            x, floor = clamp
            continue
        if k == "matmul":
            qk = x
            break
        if k == "to":
            x = x.args[0]
        elif k in ("mul", "div"):
            a, b = x.args[0], x.args[1]
            if scalar(b) is not None and is_tensor(a):
                c, x = scalar(b), a
            elif k == "mul" and scalar(a) is not None and is_tensor(b):
                c, x = scalar(a), b
            else:
                raise Reject(f"'{x.name}' multiplies the scores by a tensor, not a constant scale")
            scale = scale * c if k == "mul" else scale / c
        elif k in ("add", "sub"):
            if arg(x, 2, "alpha", 1) != 1:
                raise Reject("add with alpha")
            a, b = x.args[0], x.args[1]
            if not is_tensor(b) and scalar(b) is not None:
                x = a  # a constant shift of every score leaves softmax unchanged
                continue
            if k == "sub" and (maximum := row_max(b, a)) is not None:
                row_maxima.update(maximum)  # so does a shift of each row by its own maximum
                chain.extend(maximum)
                x = a
                continue
            if k == "sub":
                raise Reject("a tensor subtracted from the scores")
            if _leads_to_scores(a):
                x, term = a, b
            elif _leads_to_scores(b):
                x, term = b, a
            else:
                raise Reject(f"'{x.name}': neither addend leads to q @ k^T")
            if getattr(tensor_meta(term), "dtype", None) == torch.bool:
                # `scores + bool_mask` promotes the mask to 0 / 1: a bias of one, not an exclusion
                # (the op reads a boolean mask as SDPA does, as "attend here")
                raise Reject("a boolean tensor added to the scores (eager adds it as 0 / 1, not as a mask)")
            masks.append(term)
        elif k == "masked_fill":
            fill = scalar(arg(x, 2, "value"))
            if fill != float("-inf"):
                raise Reject(f"masked_fill with {fill}: only -inf excludes keys exactly")
            bool_masks.append(("fill", arg(x, 1, "mask")))
            x = x.args[0]
        elif k == "where":
            cond, a, b = x.args[0], x.args[1], x.args[2]
            if scalar(b) == float("-inf") and is_tensor(a):
                bool_masks.append(("keep", cond))
                x = a
            elif scalar(a) == float("-inf") and is_tensor(b):
                bool_masks.append(("fill", cond))
                x = b
            else:
                raise Reject("torch.where on the scores that is not a -inf mask")
        else:
            raise Reject(f"'{x.name}' ({x.target}) between q @ k^T and softmax is not a scale, mask or cast")

    q, kt = qk.args[0], qk.args[1]
    if not isinstance(kt, fx.Node):
        raise Reject("keys are not a graph value")
    if len(masks) > 0 and len(bool_masks) > 0:
        raise Reject("both an additive and a boolean mask")
    if len(bool_masks) > 1:
        raise Reject("more than one boolean mask")
    if drop_last and sinks is None:
        raise Reject("the softmax output loses its last column, which no sink column made")
    if lse_sinks is not None:
        sinks = lse_sinks
    if floor is not None and bool_masks:
        raise Reject("a floor clamp of the scores with a boolean mask")
    return dict(
        out=out, q=q, k=kt, v=v, k_transposed=True, masks=masks, bool_masks=bool_masks, scale=scale,
        is_causal=False, masked_rows_zero=False, chain=chain, dropout_p=dropout_p, sinks=sinks, floor=floor,
        heads_shape=heads_shape if len(scores_shape) == 3 else None,
        # Under autocast both matmuls run in its dtype whatever q, k and v hold (CodeGen upcasts q and
        # k to fp32 first): the op gets them cast. A mask is added to the scores outside the matmuls,
        # in the promoted dtype, so it keeps its own (finfo(fp32).min would round to -inf in bf16).
        autocast=_autocast_dtype(pv, (q, kt, v)), cast_mask=False,
    )


def _check_operands(spec: dict) -> None:
    q, k, v = (tensor_meta(spec[n]) for n in ("q", "k", "v"))
    if q is None or k is None or v is None:
        raise Reject("q, k or v has no recorded tensor value")
    if spec.get("autocast") is not None:  # the op gets them cast, as autocast casts them
        q, k, v = (t.to(spec["autocast"]) for t in (q, k, v))
    if not (q.dtype == k.dtype == v.dtype):
        raise Reject(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if q.dtype not in SUPPORTED_DTYPES:
        raise Reject(f"dtype {q.dtype} is not supported")
    if q.dim() != k.dim() or q.dim() not in (3, 4) or v.dim() != q.dim():
        raise Reject("q, k, v are not all 3-D or 4-D")
    k_shape = tuple(k.shape)
    if spec["k_transposed"]:
        k_shape = k_shape[:-2] + (k_shape[-1], k_shape[-2])
    # Sizes may be symbolic (dynamic batch/sequence): every comparison must hold for all values,
    # and none may add a guard (same_size), or Dynamo would recompile for the sizes it excluded.
    if not isinstance(q.shape[-1], int):
        raise Reject("the head dimension is dynamic")
    if not isinstance(v.shape[-1], int):
        raise Reject("the value head dimension is dynamic")
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        raise Reject(f"head dim {max(q.shape[-1], v.shape[-1])} is above the kernels' {MAX_HEAD_DIM}")
    # v may have a head dim of its own (DeepSeek's latent attention: 192 for q and k, 128 for v)
    if not same_size(q.shape[-1], k_shape[-1]):
        raise Reject(f"query and key head dims differ (q {q.shape[-1]}, k {k_shape[-1]})")
    if not _runtime_checked_equal(k_shape[-2], v.shape[-2]):
        raise Reject("key and value lengths differ")
    if not (_runtime_checked_equal(q.shape[0], k_shape[0]) and _runtime_checked_equal(q.shape[0], v.shape[0])):
        raise Reject("batch sizes of q, k, v differ (broadcast matmul)")
    if q.dim() == 4:
        hq, hk = q.shape[1], k_shape[1]
        if not (isinstance(hq, int) and isinstance(hk, int)):
            raise Reject("the head count is dynamic")
        if not same_size(hk, v.shape[1]) or hq % hk != 0:
            raise Reject(f"{hq} query heads cannot share {hk} key/value heads")
        if spec["k_transposed"] and hq != hk:
            raise Reject("broadcast over heads in a hand-written matmul")
    four = spec.get("heads_shape")  # 3-D scores that the model viewed as (B, H, T, S)
    rank = 4 if four is not None else q.dim()
    for m in spec["masks"] + [b for _, b in spec["bool_masks"]]:
        mt = tensor_meta(m)
        if mt is None:
            raise Reject("mask is not a tensor")
        if mt.dim() > rank:
            raise Reject(f"mask has {mt.dim()} dims for {q.dim()}-D scores")
        if four is not None:
            scores = (four[0], four[1], q.shape[-2], k_shape[-2])
        else:
            scores = (q.shape[0],) + ((q.shape[1],) if q.dim() == 4 else ()) + (q.shape[-2], k_shape[-2])
        # Right-aligned, each mask dim is 1 (broadcast) or provably the scores' own size.
        for m_dim, s_dim in zip(reversed(tuple(mt.shape)), reversed(scores)):
            if not (isinstance(m_dim, int) and m_dim == 1) and not _runtime_checked_equal(m_dim, s_dim):
                raise Reject(f"mask shape {tuple(mt.shape)} does not broadcast to the scores {scores}")
        if mt.dtype != torch.bool and not mt.dtype.is_floating_point:
            raise Reject(f"mask dtype {mt.dtype}")


def _runtime_checked_equal(a, b) -> bool:
    """Equal for every value of the symbols, or two symbols Dynamo left unrelated (a KV cache's keys
    and values, a mask's length) that were equal when traced: the kernel checks such sizes at each
    call and raises where they differ, as eager attention does; it never guesses."""
    return same_size(a, b) or (not isinstance(a, int) and not isinstance(b, int) and hint(a) == hint(b))


# --------------------------------------------------------------------------------------------
# Rewriting.


def _mask_summary(graph: fx.Graph, spec: dict, q: fx.Node, mask: fx.Node, seq_q, seq_k, summaries: dict) -> fx.Node:
    """The block summary of `mask` for this attention: one per mask and query length per forward.

    Nodes are visited in graph order, so the first layer's summary precedes every later use. Each
    layer's KV cache gets a length symbol of its own from Dynamo: a later layer whose key length is
    another symbol reuses the first summary when the lengths are equal at run time
    (ops.attention.mask_summary_for), else computes its own."""
    out = spec["out"]
    sizes = (size_arg(graph, seq_q), size_arg(graph, seq_k))
    if None in sizes:
        # A length that is an expression of Dynamo's symbols: measured from this layer's q and v.
        with graph.inserting_before(out):
            sizes = (graph.call_method("size", (q, -2)), graph.call_method("size", (spec["v"], -2)))
        for node, size in zip(sizes, (seq_q, seq_k)):
            node.meta["example_value"] = size
        anchor = None
    else:
        # After the mask and the size placeholders (a mask that is an input is a placeholder
        # itself, possibly before the symbols Dynamo lifted for its sizes).
        defined = [mask, *(s for s in sizes if isinstance(s, fx.Node))]
        if any(d.op == "placeholder" for d in defined):
            defined.append(list(graph.find_nodes(op="placeholder"))[-1])
        order = node_order(graph)
        anchor = max(defined, key=order.__getitem__)
    first = summaries.get((mask, str(seq_q)))
    if first is not None and first[1] == str(seq_k):
        return first[0]
    if first is None:
        with graph.inserting_after(anchor) if anchor is not None else graph.inserting_before(out):
            summary = graph.call_function(torch.ops.transfuse.attention_mask_summary.default, (mask, *sizes))
        summaries[(mask, str(seq_q))] = (summary, str(seq_k), sizes[1])
        return summary
    with graph.inserting_before(out):
        return graph.call_function(mask_summary_for, (first[0], first[2], mask, *sizes))


def _replace(ctx: PassContext, spec: dict, summaries: dict, summarise: bool = True) -> None:
    graph = ctx.gm.graph
    out: fx.Node = spec["out"]
    q_meta = tensor_meta(spec["q"])
    three_d = q_meta.dim() == 3
    split = three_d and spec.get("heads_shape") is not None
    with graph.inserting_before(out):
        q, k, v = spec["q"], _keys(graph, spec), spec["v"]
        if split:  # (batch*heads, seq, dim) -> (batch, heads, seq, dim), as the model viewed its scores
            heads = int(spec["heads_shape"][1])
            q, k, v = (_view(graph, t, "unflatten", 0, (-1, heads)) for t in (q, k, v))
        elif three_d:  # (batch*heads, seq, dim) -> (batch*heads, 1, seq, dim)
            q, k, v = (_view(graph, t, "unsqueeze", 1) for t in (q, k, v))
        else:
            # K/V heads repeated for grouped-query attention: the kernel reads each KV head once
            # for its query group instead (the repeat would copy the whole cache every layer).
            k_heads, v_heads = _repeated_heads(k), _repeated_heads(v)
            if (k_heads is not None and v_heads is not None
                    and [str(x) for x in shape(k_heads)[:2]] == [str(x) for x in shape(v_heads)[:2]]):
                k, v = k_heads, v_heads
                ctx.matched("GroupedKV")
        mask = _combined_mask(graph, spec)
        if mask is not None and three_d and not split and tensor_meta(mask) is not None and tensor_meta(mask).dim() == 3:
            mask = _view(graph, mask, "unsqueeze", 1)
        if mask is not None and spec.get("floor") is not None:
            mask = _view(graph, mask, "clamp_min", spec["floor"])  # the scores' floor, on the mask
    summary = None
    if mask is not None and summarise and not ctx.training:
        summary = _mask_summary(graph, spec, q, mask, q_meta.shape[-2], tensor_meta(spec["v"]).shape[-2], summaries)
    with graph.inserting_before(out):
        if spec.get("autocast") is not None:
            # what torch.autocast does to SDPA's arguments: every floating one to its dtype
            q, k, v = (cast_to(graph, t, spec["autocast"]) for t in (q, k, v))
            if mask is not None and spec.get("cast_mask", True) and tensor_meta(mask) is not None \
                    and tensor_meta(mask).dtype.is_floating_point:
                mask = cast_to(graph, mask, spec["autocast"])
        if ctx.training:
            new = graph.call_function(torch.ops.transfuse.attention_train.default,
                                      (q, k, v, _additive(graph, mask), float(spec["scale"]), spec["is_causal"]))
        else:
            args = (q, k, v, mask, summary, float(spec["scale"]), spec["is_causal"], spec["masked_rows_zero"])
            if spec.get("sinks") is not None:
                args += (None, _view(graph, spec["sinks"], "reshape", -1))  # no key_len; one sink per head
            new = graph.call_function(torch.ops.transfuse.attention.default, args)
        if split:  # the op's own (batch, heads, seq, dim_v); the model's 3-D output is its flatten
            new.meta["example_value"] = tensor_meta(out).unflatten(0, (-1, int(spec["heads_shape"][1])))
        else:
            new.meta["example_value"] = out.meta.get("example_value")
        if three_d:
            new = graph.call_method("flatten" if split else "squeeze", (new, 0, 1) if split else (new, 1))
            new.meta["example_value"] = out.meta.get("example_value")
    out.replace_all_uses_with(new)
    graph.erase_node(out)


def _keys(graph: fx.Graph, spec: dict) -> fx.Node:
    """k as (..., seq_k, head_dim). `q @ k.transpose(-2, -1)`: read k itself; anything else: a
    transposed view of what was multiplied."""
    k = spec["k"]
    if spec["k_transposed"]:
        k = k.args[0] if is_last_two_transpose(k) else _view(graph, k, "transpose", -2, -1)
    return k


def _repeated_heads(node: fx.Node) -> fx.Node | None:
    """x for `x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)`, the
    repeat of KV heads that grouped-query attention is written with (Hugging Face's repeat_kv);
    None for anything else. Matched on shapes: dims other than the inserted one are x's own."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target in ("reshape", "view")):
        return None
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.op == "call_method" and expand.target == "expand"):
        return None
    index = expand.args[0]
    if not (isinstance(index, fx.Node) and index.op == "call_function" and index.target is operator.getitem):
        return None
    source, key = index.args
    full = slice(None, None, None)
    if not (isinstance(key, tuple) and key == (full, full, None, full, full)):
        return None
    src, wide, out = tensor_meta(source), tensor_meta(expand), tensor_meta(node)
    if src is None or wide is None or out is None or src.dim() != 4 or wide.dim() != 5 or out.dim() != 4:
        return None
    b, h, s, d = (str(x) for x in src.shape)
    if [str(x) for x in wide.shape[:2]] + [str(x) for x in wide.shape[3:]] != [b, h, s, d]:
        return None
    if [str(out.shape[0]), str(out.shape[2]), str(out.shape[3])] != [b, s, d]:
        return None
    if str(out.shape[1]) != str(wide.shape[1] * wide.shape[2]):
        return None
    return source


def _view(graph: fx.Graph, node: fx.Node, method: str, *args) -> fx.Node:
    """A view node with its recorded value, so later passes and the report can read its shape."""
    view = graph.call_method(method, (node,) + args)
    meta = tensor_meta(node)
    if meta is not None:
        view.meta["example_value"] = getattr(meta, method)(*args)
    return view


def _additive(graph: fx.Graph, mask: fx.Node | None) -> fx.Node | None:
    """The training kernel reads an additive bias: a boolean "attend here" mask becomes 0 / -inf."""
    meta = tensor_meta(mask) if mask is not None else None
    if meta is None or meta.dtype != torch.bool:
        return mask
    bias = graph.call_function(torch.where, (mask, 0.0, float("-inf")))
    bias.meta["example_value"] = torch.empty_like(meta, dtype=torch.float32)
    return bias


def _combined_mask(graph: fx.Graph, spec: dict) -> fx.Node | None:
    if spec["bool_masks"]:
        how, cond = spec["bool_masks"][0]
        if how == "keep":
            return cond
        node = graph.call_function(torch.logical_not, (cond,))
        node.meta["example_value"] = tensor_meta(cond)
        return node
    masks = spec["masks"]
    if not masks:
        return None
    mask = masks[0]
    for extra in masks[1:]:
        mask = graph.call_function(torch.add, (mask, extra))
        # Only the rank matters to later code; the summed shape is their broadcast.
        mask.meta["example_value"] = tensor_meta(extra)
    return mask
