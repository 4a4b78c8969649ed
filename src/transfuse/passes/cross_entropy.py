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

When the model returns its logits next to the loss (nanoGPT's `return logits, loss`), a training
graph gets the head and the loss as one op, `transfuse.ops.cross_entropy.linear_logits_cross_entropy`:
one GEMM into a vocabulary padded to a multiple of 64 (`VocabPadding`: cuBLAS falls back to slow
kernels for GPT-2's 50257, 15 ms of a 41 ms nanoGPT step on an H100), then one kernel pass that
copies the (rows, V) logits out for the user, computes the loss and overwrites the padded buffer
with the loss's gradient, which the backward's GEMMs read as it is (grad_output scales their small
results). Eval graphs keep the logits GEMM as it was and the plain CrossEntropy op.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from transfuse.ops.cross_entropy import linear_cross_entropy, linear_logits_cross_entropy
from transfuse.passes.graph import arg, cast_to, kind, node_order, remove_dead_code, single_user, tensor_meta
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


def _is_upcast(node: fx.Node) -> bool:
    """`x.float()` / `x.to(torch.float32)` of a floating-point x: exact, the kernels widen to fp32."""
    if kind(node) != "to" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    source, out = tensor_meta(node.args[0]), tensor_meta(node)
    return (source is not None and out is not None and source.dtype.is_floating_point
            and source.dtype.itemsize <= 4 and out.dtype == torch.float32)


def _returned_head(ce_input: fx.Node) -> fx.Node | str:
    """The linear whose output, viewed as (rows, V) (and perhaps upcast), is the loss's input, or
    why there is none. A view or reshape of a contiguous linear output keeps its rows in order, so
    the loss's row r is the linear's row r whatever the views in between."""
    node = ce_input
    while kind(node) != "linear":
        if not (kind(node) in ("view", "reshape") or _is_upcast(node)) or not isinstance(node.args[0], fx.Node):
            return "the logits do not come from a linear through views"
        node = node.args[0]
    x, weight, bias = arg(node, 0, "input"), arg(node, 1, "weight"), arg(node, 2, "bias")
    x_meta, w_meta, out_meta, in_meta = tensor_meta(x), tensor_meta(weight), tensor_meta(node), tensor_meta(ce_input)
    if (x_meta is None or w_meta is None or out_meta is None or in_meta is None or w_meta.dim() != 2
            or x_meta.dim() < 1 or in_meta.dim() != 2):
        return "the LM head's shapes are unknown"
    vocab, hidden = w_meta.shape
    if not (isinstance(vocab, int) and in_meta.shape[1] == vocab and out_meta.shape[-1] == vocab
            and x_meta.shape[-1] == hidden):
        return "the loss's classes are not the LM head's outputs"
    b_meta = tensor_meta(bias) if isinstance(bias, fx.Node) else None
    if bias is not None and b_meta is None:
        return "the LM head's bias is not a tensor"
    params = [w_meta] + ([b_meta] if b_meta is not None else [])
    if out_meta.dtype not in (*_HALF, torch.float32) or any(p.dtype not in (out_meta.dtype, torch.float32)
                                                             for p in params):
        return "the LM head's parameters are neither its compute dtype nor fp32"
    return node


# What may be computed earlier than written: values with no effects (a target's views, HF's shifted
# labels: pad, slice, contiguous, view, to(device)) and the size arithmetic around them.
_MOVABLE_METHODS = frozenset({"view", "reshape", "contiguous", "to", "long", "flatten", "size", "__getitem__"})
_MOVABLE_FUNCTIONS = frozenset({operator.getitem, F.pad, torch.reshape, torch.flatten, operator.add, operator.sub,
                                operator.mul, operator.floordiv, operator.neg}
                               # F.pad as Dynamo records it on torch 2.13 (the C function it calls)
                               | ({torch._C._nn.pad} if hasattr(torch._C._nn, "pad") else set()))


def _movable(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _MOVABLE_METHODS
    return node.op == "call_function" and node.target in _MOVABLE_FUNCTIONS


def _hoist_before(node: fx.Node, anchor: fx.Node) -> bool:
    """Move `node` and whatever it is computed from that comes after `anchor` in the graph to just
    before `anchor`, in their order; False (nothing moved) when one of them reads `anchor`."""
    order = node_order(anchor.graph)
    late, stack = set(), [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in late or order[n] < order[anchor]:
            continue
        if n is anchor or not _movable(n):
            return False
        late.add(n)
        stack.extend(n.all_input_nodes)
    for n in sorted(late, key=order.__getitem__):
        anchor.prepend(n)
    return True


def _fuse_returned_head(ctx: PassContext, ce: fx.Node, linear: fx.Node, target: fx.Node, settings: tuple) -> bool:
    """Head and loss -> linear_logits_cross_entropy, its logits replacing the linear's for every
    other reader (the user, the views that fed the loss). False when the target is computed from the
    logits (nothing changed then)."""
    graph = ctx.gm.graph
    if not _hoist_before(target, linear):
        return False
    x, weight, bias = arg(linear, 0, "input"), arg(linear, 1, "weight"), arg(linear, 2, "bias")
    out_meta = tensor_meta(linear)
    vocab = tensor_meta(weight).shape[0]
    pad = VOCAB_MULTIPLE if vocab % VOCAB_MULTIPLE else 0
    with graph.inserting_after(linear):
        x = cast_to(graph, x, out_meta.dtype)  # under autocast: the GEMM runs in the autocast dtype
    with graph.inserting_after(x if x is not arg(linear, 0, "input") else linear):
        pair = graph.call_function(linear_logits_cross_entropy, (x, weight, bias, target, *settings, pad))
    with graph.inserting_after(pair):
        logits = graph.call_function(operator.getitem, (pair, 0))
    with graph.inserting_after(logits):
        loss = graph.call_function(operator.getitem, (pair, 1))
    logits.meta["example_value"] = linear.meta.get("example_value")
    loss.meta["example_value"] = ce.meta.get("example_value")
    linear.replace_all_uses_with(logits)
    ce.replace_all_uses_with(loss)
    graph.erase_node(ce)
    graph.erase_node(linear)
    remove_dead_code(graph)  # the views that fed the loss
    _return_logits_outside(ctx, pair, logits, x, weight, bias)
    ctx.matched(PATTERN)
    if pad:
        ctx.matched("VocabPadding")
    return True


def _return_logits_outside(ctx: PassContext, pair: fx.Node, logits: fx.Node, x: fx.Node, weight: fx.Node,
                           bias: fx.Node | None) -> None:
    """When the graph returns the logits and nothing else in it reads them, they leave the graph
    without a gradient and get it outside (ops.cross_entropy.ReturnedLogits, from x, which becomes
    a graph output, and the weight and bias inputs): a step that backpropagates the loss alone then
    never forms the (rows, V) zeros AOTAutograd would hand the backward for them."""
    graph = ctx.gm.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    returned = output.args[0]
    weight_at = ctx.placeholder_index(weight)
    bias_at = ctx.placeholder_index(bias) if isinstance(bias, fx.Node) else None
    if (set(logits.users) != {output} or not isinstance(returned, (tuple, list)) or x.op == "placeholder"
            or weight_at is None or (bias is not None and bias_at is None)):
        return
    positions = [i for i, value in enumerate(returned) if value is logits]
    if len(positions) != 1:
        return
    pair.kwargs = {**pair.kwargs, "logits_differentiable": False}
    output.args = (type(returned)([*returned, x]),)
    ctx.returned_logits.append((positions[0], len(returned), weight_at, bias_at))
    ctx.matched("ReturnedLogits")


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
        if linear is None and ctx.training:
            head = _returned_head(ce_input)
            if isinstance(head, fx.Node) and _fuse_returned_head(ctx, node, head, target, settings):
                continue
        with graph.inserting_before(node):
            if linear is not None:
                x, weight, bias = arg(linear, 0, "input"), arg(linear, 1, "weight"), arg(linear, 2, "bias")
                out_dtype = tensor_meta(linear).dtype
                x = cast_to(graph, x, out_dtype)  # under autocast: the GEMM runs in the autocast dtype
                vocab = tensor_meta(weight).shape[0]
                pad = VOCAB_MULTIPLE if isinstance(vocab, int) and vocab % VOCAB_MULTIPLE else 0
                new = graph.call_function(linear_cross_entropy, (x, weight, bias, target, *settings, pad))
                ctx.matched(FUSED)
            else:
                new = graph.call_function(torch.ops.transfuse.cross_entropy.default, (logits, target, *settings))
                ctx.matched(PATTERN)
        new.meta["example_value"] = node.meta.get("example_value")
        node.replace_all_uses_with(new)
        graph.erase_node(node)
