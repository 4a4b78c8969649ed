"""RMSNorm, hand-written or not, fused with the residual add that feeds it.

* `RMSNorm` — the normalisation `h * rsqrt(mean(h**2, -1, keepdim=True) + eps)` (h: the input, often
  cast to fp32 first) followed by its scale, however a family writes it:
  Llama/Mistral/Qwen2 `weight * h.to(input_dtype)` (transformers/models/llama/modeling_llama.py,
  LlamaRMSNorm), Gemma `(h * (1.0 + weight.float())).type_as(x)`, T5 `weight * h.to(weight.dtype)`;
  and `F.rms_norm`.
* `ResidualRMSNorm` — the same whose input is `a + b` (pre-norm decoders: the sum is also the next
  residual, so the kernel stores it too).

Matched by meaning: the skeleton (a mean of squares over the last dim, plus a constant, rsqrt,
times the input) is found structurally, then the tail up to the output (casts, the weight, an offset
added to it) is identified by evaluating that piece of graph on probe values against each flavour
of transfuse.reference.norm.rms_norm_ref; nothing is read from names or literal constants.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from transfuse.passes.graph import arg, evaluate, kind, same_size, scalar, static_inputs, tensor_meta, value
from transfuse.passes.manager import PassContext
from transfuse.passes.norm import is_last_dim_mean, norm_input, replace_with_norm, statistic_plus_eps, walk_tail
from transfuse.reference.norm import rms_norm_ref

FUSED = "ResidualRMSNorm"
PLAIN = "RMSNorm"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLAVOURS = [(0.0, True), (0.0, False), (1.0, False), (1.0, True)]  # (weight_offset, cast_before_weight)
_FUNCTIONAL = {f for f in (getattr(F, "rms_norm", None), getattr(torch, "rms_norm", None)) if f is not None}


def run(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    statics = static_inputs(ctx.gm)
    for node in list(graph.nodes):
        if node.graph is not graph or node.op not in ("call_function", "call_method"):
            continue
        if node.op == "call_function" and node.target in _FUNCTIONAL:
            match = _functional(node)
        elif kind(node) == "rsqrt":
            match = _hand_written(node, statics)
        else:
            continue
        if isinstance(match, str):
            ctx.reject(PLAIN, node, match)
            continue
        if match is not None:
            _replace(ctx, *match)


def _functional(node: fx.Node):
    x, shape_, weight = arg(node, 0, "input"), arg(node, 1, "normalized_shape"), arg(node, 2, "weight")
    eps = arg(node, 3, "eps")
    if isinstance(shape_, (list, tuple)):
        shape_ = [value(d) if isinstance(d, fx.Node) else d for d in shape_]  # `x.shape[-1]` traced
    xm = tensor_meta(x)
    if xm is None or xm.dtype not in SUPPORTED_DTYPES:
        return "input dtype is not supported"
    if not isinstance(shape_, (list, tuple)) or len(shape_) != 1 or not same_size(shape_[0], xm.shape[-1]):
        return f"normalized_shape {shape_} is not the last dimension alone"
    eps = torch.finfo(torch.float32).eps if eps is None else scalar(eps)
    if eps is None:
        return "eps is not a compile-time constant"
    return node, x, weight, eps, 0.0, False


def _hand_written(rsqrt: fx.Node, statics: dict):
    """(output node, x, weight, eps, offset, cast_before) or None when this rsqrt is no RMSNorm."""
    denominator = statistic_plus_eps(rsqrt)
    if denominator is None or not is_last_dim_mean(denominator[1]):
        return None
    added, mean, eps = denominator
    square = mean.args[0]
    h = _squared(square)
    if h is None:
        return None
    x = norm_input(h)
    # Llama scales the fp32 copy, T5 the input itself (promoted to fp32 by the product): the same.
    normed = next((u for u in rsqrt.users if kind(u) == "mul" and (h in u.args[:2] or x in u.args[:2])), None)
    if normed is None:
        return None
    xm = tensor_meta(x)
    if xm is None or xm.dtype not in SUPPORTED_DTYPES or xm.dim() < 1:
        return None
    chain, params = walk_tail(normed, x, statics, max_params=1)
    weight = params[0] if params else None
    # The longest tail that computes one flavour of RMSNorm is the match.
    region = [h] if h is not x else []
    region += [square, mean, added, rsqrt]
    for stop in range(len(chain), 0, -1):
        nodes = region + chain[:stop]
        out = chain[stop - 1]
        w = weight if weight is not None and any(weight in n.all_input_nodes for n in nodes) else None
        flavour = _flavour(nodes, out, x, w, eps)
        if flavour is not None:
            return out, x, w, eps, flavour[0], flavour[1]
    return None


def _squared(node: fx.Node) -> fx.Node | None:
    """h for `h.pow(2)`, `h ** 2` or `h * h`."""
    if kind(node) == "pow" and len(node.args) > 1 and scalar(node.args[1]) == 2.0 and isinstance(node.args[0], fx.Node):
        return node.args[0]
    if kind(node) == "mul" and len(node.args) > 1 and node.args[0] is node.args[1] and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def _flavour(nodes: list, out: fx.Node, x: fx.Node, weight: fx.Node | None, eps: float):
    """Which (weight_offset, cast_before_weight) this piece of graph computes, judged on probe values."""
    xm = tensor_meta(x)
    wm = tensor_meta(weight) if weight is not None else None
    om = tensor_meta(out)
    if om is None or om.dtype != xm.dtype:
        return None  # the kernel returns x's dtype
    gen = torch.Generator().manual_seed(0)
    n = 64
    probe_x = (torch.randn(3, n, generator=gen) * 3).to(xm.dtype)
    probe_w = (torch.randn(n, generator=gen) * 0.5 + 1).to(wm.dtype) if wm is not None else None
    try:
        got = evaluate(nodes, out, {x: probe_x, **({weight: probe_w} if weight is not None else {})})
    except Exception:  # noqa: BLE001 - a piece of graph we cannot replay is simply not a match
        return None
    if not isinstance(got, torch.Tensor) or got.shape != probe_x.shape or got.dtype != xm.dtype:
        return None
    tol = 1e-5 if xm.dtype == torch.float32 else 1e-2
    for offset, cast_before in FLAVOURS if weight is not None else [(0.0, True)]:
        if weight is not None and cast_before and wm.dtype != xm.dtype:
            continue
        want = rms_norm_ref(probe_x, probe_w, eps, offset, cast_before)
        if torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
            return offset, cast_before
    return None


def _replace(ctx: PassContext, out: fx.Node, x: fx.Node, weight, eps: float, offset: float, cast_before: bool) -> None:
    replace_with_norm(ctx, out, x, torch.ops.transfuse.rms_norm.default, torch.ops.transfuse.add_rms_norm.default,
                      (weight, float(eps), offset, cast_before), (PLAIN, FUSED))
