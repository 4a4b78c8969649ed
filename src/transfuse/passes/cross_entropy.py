"""`CrossEntropy` and `LinearCrossEntropy`: a language model's loss.

    F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=..., label_smoothing=..., reduction=...)

as nanoGPT writes it, and Hugging Face's ForCausalLMLoss (transformers/loss/loss_utils.py:
`logits.float()`, then the same call) -> torch.ops.transfuse.cross_entropy over the logits in their
own dtype: eager upcasts them to an fp32 copy, keeps an fp32 log-softmax for backward and writes an
fp32 gradient (GPT-2 at 8 x 1024 tokens: 1.6 GB each); the kernel reads the half-precision logits,
computes in fp32, and its backward rewrites one copy of them into the gradient.

When nothing but the loss reads the logits (a model that does not return them), the LM-head linear
goes into the loss too (`transfuse.ops.cross_entropy.linear_cross_entropy`): the logits are formed
chunk by chunk and never exist whole. A vocabulary that is not a multiple of 64 is padded inside
that op (the user's weight and its gradient keep their shape).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from transfuse.ops.cross_entropy import linear_cross_entropy
from transfuse.passes.graph import arg, kind, single_user, tensor_meta
from transfuse.passes.manager import PassContext

PATTERN = "CrossEntropy"
FUSED = "LinearCrossEntropy"
VOCAB_MULTIPLE = 64
_REDUCTIONS = ("mean", "sum", "none")
_HALF = (torch.float16, torch.bfloat16)


def _upcast_source(node: fx.Node) -> fx.Node:
    """x for `x.float()` / `x.to(torch.float32)` of a half-precision x (exact: the kernel widens
    every logit to fp32 itself), else node."""
    if kind(node) != "to" or not node.args or not isinstance(node.args[0], fx.Node):
        return node
    source, out = tensor_meta(node.args[0]), tensor_meta(node)
    if source is None or out is None or source.dtype not in _HALF or out.dtype != torch.float32:
        return node
    return node.args[0]


def _settings(ce: fx.Node) -> tuple | str:
    """(ignore_index, label_smoothing, reduction), or why the call is left alone."""
    if arg(ce, 2, "weight") is not None:
        return "class weights"
    if arg(ce, 3, "size_average") is not None or arg(ce, 5, "reduce") is not None:
        return "the deprecated size_average/reduce arguments"
    ignore_index, reduction, smoothing = arg(ce, 4, "ignore_index", -100), arg(ce, 6, "reduction", "mean"), \
        arg(ce, 7, "label_smoothing", 0.0)
    if not isinstance(ignore_index, int) or reduction not in _REDUCTIONS or not isinstance(smoothing, (int, float)):
        return "settings that are not constants"
    return int(ignore_index), float(smoothing), reduction


def _lm_head(logits: fx.Node, ce_input: fx.Node) -> fx.Node | None:
    """The linear that makes the logits, when the loss is all that reads them."""
    chain = ce_input
    while chain is not logits:
        if not chain.args or single_user(chain.args[0]) is not chain:
            return None
        chain = chain.args[0]
    head = _head_of(logits)
    return head if head is not None and single_user(head) is not None else None


def _head_of(logits: fx.Node) -> fx.Node | None:
    """The linear that makes the logits (through a view), whoever else reads them."""
    node = logits
    if kind(node) in ("view", "reshape") and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node if kind(node) == "linear" else None


def _pad_vocab(ctx: PassContext, linear: fx.Node) -> None:
    """`VocabPadding`: the LM head's GEMMs (forward and both backward ones) run over a vocabulary
    padded to a multiple of 64 and the logits are the first V columns of the result: cuBLAS falls back
    to slow kernels for GPT-2's 50257 (sm75 CUTLASS tiles, 15 ms of a 41 ms nanoGPT step on an
    H100). The padded weight is a fresh F.pad of the user's each step (their parameter and its
    gradient keep their shape; the zero rows get gradients that are dropped)."""
    weight, bias = arg(linear, 1, "weight"), arg(linear, 2, "bias")
    w_meta = tensor_meta(weight)
    vocab = w_meta.shape[0] if w_meta is not None and w_meta.dim() == 2 else None
    if not isinstance(vocab, int) or vocab % VOCAB_MULTIPLE == 0:
        return
    extra = -vocab % VOCAB_MULTIPLE
    graph = ctx.gm.graph
    with graph.inserting_before(linear):
        padded_w = graph.call_function(F.pad, (weight, (0, 0, 0, extra)))
        padded_b = graph.call_function(F.pad, (bias, (0, extra))) if isinstance(bias, fx.Node) else bias
        full = graph.call_function(F.linear, (arg(linear, 0, "input"), padded_w, padded_b))
    with graph.inserting_after(full):
        cut = graph.call_function(operator.getitem, (full, (Ellipsis, slice(None, vocab))))
    with graph.inserting_after(cut):
        # The user gets the logits back: contiguous, as eager's are (a view of the padded GEMM output
        # would refuse .view(-1) where eager's logits allow it): one copy of the logits.
        dense = graph.call_method("contiguous", (cut,))
    cut.meta["example_value"] = dense.meta["example_value"] = linear.meta.get("example_value")
    linear.replace_all_uses_with(dense)
    graph.erase_node(linear)
    ctx.matched("VocabPadding")


def run(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is F.cross_entropy):
            continue
        ce_input, target = arg(node, 0, "input"), arg(node, 1, "target")
        logits = _upcast_source(ce_input) if isinstance(ce_input, fx.Node) else None
        if logits is ce_input and kind(ce_input) in ("view", "reshape") and isinstance(ce_input.args[0], fx.Node):
            # Hugging Face: logits.float() first, the view after it: view the half-precision logits.
            source = _upcast_source(ce_input.args[0])
            if source is not ce_input.args[0]:
                with graph.inserting_before(node):
                    logits = graph.call_method(ce_input.target if ce_input.op == "call_method" else "reshape",
                                               (source, *ce_input.args[1:]))
                logits.meta["example_value"] = tensor_meta(ce_input).to(tensor_meta(source).dtype)
        meta, target_meta = tensor_meta(logits), tensor_meta(target)
        settings = _settings(node)
        if isinstance(settings, str):
            ctx.reject(PATTERN, node, settings)
            continue
        if meta is None or meta.dim() != 2 or not meta.dtype.is_floating_point:
            ctx.reject(PATTERN, node, "input is not (rows, classes) floating point")
            continue
        if target_meta is None or target_meta.dim() != 1 or target_meta.dtype != torch.int64:
            ctx.reject(PATTERN, node, "target is not (rows,) class indices")
            continue
        linear = _lm_head(logits, ce_input)
        with graph.inserting_before(node):
            if linear is not None:
                x, weight, bias = arg(linear, 0, "input"), arg(linear, 1, "weight"), arg(linear, 2, "bias")
                out_dtype = tensor_meta(linear).dtype
                if tensor_meta(x).dtype != out_dtype:  # under autocast: the GEMM runs in the autocast dtype
                    x = graph.call_method("to", (x, out_dtype))
                vocab = tensor_meta(weight).shape[0]
                pad = VOCAB_MULTIPLE if isinstance(vocab, int) and vocab % VOCAB_MULTIPLE else 0
                new = graph.call_function(linear_cross_entropy, (x, weight, bias, target, *settings, pad))
                ctx.matched(FUSED)
            else:
                new = graph.call_function(torch.ops.transfuse.cross_entropy.default, (logits, target, *settings))
                ctx.matched(PATTERN)
                head = _head_of(logits)
                if head is not None and ctx.training:
                    _pad_vocab(ctx, head)
        new.meta["example_value"] = node.meta.get("example_value")
        node.replace_all_uses_with(new)
        graph.erase_node(node)
