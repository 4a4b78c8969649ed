"""Linear + bias + activation (+ residual add) as one GEMM with an epilogue (`LinearEpilogue`).

The activation is recognised by meaning: a chain of element-wise operations that reads only the
linear's output (and constants) is evaluated on probe values and compared against each activation
the kernel implements. So `F.gelu(x)`, `F.gelu(x, approximate="tanh")`, Hugging Face's
hand-written `NewGELUActivation` (0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))),
`x * torch.sigmoid(x)` and `nn.SiLU` all match, whatever constants or spellings they use, and a
chain that is none of them is left alone.

In a training graph the op is transfuse.linear_train, which keeps the pre-activation for its
backward (transfuse.ops.linear_autograd), and a bare linear (nothing to fuse) stays F.linear: the
same cuBLAS GEMMs forward and backward, without a custom op's overhead.

Under torch.autocast F.linear's output has the autocast dtype while its operands need not (fp32
parameters, often an fp32 input): autocast casts all three before the GEMM, so the rewrite puts the
same casts in front of the op, and the GEMM and its epilogue run in that dtype, as eager's do. An
activation that autocast finishes in fp32 (CUDA autocast runs `pow` in fp32) is fused when only
such casting linears read it: see _narrowed_views.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
import torch.fx as fx

from transfuse.passes.graph import (POINTWISE, arg, autocast_readers, cast_to, kind, record_dtype, same_shape, scalar, shape,
                                    tensor_meta)
from transfuse.passes.manager import PassContext
from transfuse.reference.gemm import ACTIVATION_FUNCTIONS

PATTERN = "LinearEpilogue"
GATED = "GatedLinearUnit"  # the rejections' name; each match is counted under its own (GATED_NAMES)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

ACTIVATIONS = {name: fn for name, fn in ACTIVATION_FUNCTIONS.items() if name != "none"}  # what a region may compute
# The gated units the kernels fuse, act(gate) * up: the kernels' "<act>_mul", named as in Shazeer 2020.
GATED_NAMES = {"silu": "SwiGLU", "gelu": "GeGLU", "gelu_tanh": "GeGLU", "relu": "ReGLU"}
_PROBE = torch.cat([torch.linspace(-8.0, 8.0, 801, dtype=torch.float64), torch.tensor([-20.0, -0.5e-3, 0.0, 1e-3, 20.0], dtype=torch.float64)])


def run(ctx: PassContext) -> None:
    graph = ctx.gm.graph
    for node in list(graph.nodes):
        if kind(node) != "linear":
            continue
        reason = _check(node)
        if reason:
            ctx.reject(PATTERN, node, reason)
            continue
        op = torch.ops.transfuse.linear_train.default if ctx.training else torch.ops.transfuse.linear.default
        unit = _gated(node)
        if unit.refusal:
            ctx.reject(GATED, node, unit.refusal)  # a gated unit the kernel cannot fuse
        if unit.mul is not None:
            with graph.inserting_before(unit.mul):
                new = graph.call_function(op, (*_operands(graph, node), f"{unit.activation}_mul", None))
            new.meta["example_value"] = unit.mul.meta.get("example_value")
            unit.mul.replace_all_uses_with(new)
            ctx.matched(GATED_NAMES[unit.activation])
            continue
        view = _row_view(node)
        activation, last, narrowed = _activation(view or node)
        residual, last = _residual(last, view or node)
        if last is view:  # nothing to fuse after the view
            view, last = None, node
        if ctx.training and activation == "none" and residual is None:
            ctx.reject(PATTERN, node, "training graph: nothing to fuse; F.linear's own backward is as good")
            continue
        with graph.inserting_before(last):
            if view is not None and residual is not None:
                residual = _flat_residual(graph, residual, node)
            new = graph.call_function(op, (*_operands(graph, node), activation, residual))
            if view is not None:
                # the epilogue ran on the linear's own rows: view its result as the model did
                new.meta["example_value"] = node.meta.get("example_value")
                new = graph.call_method(view.target, (new, *view.args[1:]), dict(view.kwargs))
        recorded = tensor_meta(last)
        if narrowed is not None:  # see _narrowed_views
            record_dtype(narrowed, tensor_meta(node).dtype)
            recorded = recorded.to(tensor_meta(node).dtype)
        new.meta["example_value"] = recorded if recorded is not None else last.meta.get("example_value")
        last.replace_all_uses_with(new)
        ctx.matched(PATTERN)


def _check(node: fx.Node) -> str | None:
    x, w = tensor_meta(arg(node, 0, "input")), tensor_meta(arg(node, 1, "weight"))
    b = arg(node, 2, "bias")
    if x is None or w is None:
        return "input or weight has no recorded tensor value"
    if x.dim() < 2 or w.dim() != 2:
        return "input is 1-D or weight is not 2-D"
    out = tensor_meta(node)
    if out is None or (b is not None and tensor_meta(b) is None):
        return "output or bias has no recorded tensor value"
    dtypes = {x.dtype, w.dtype, out.dtype} | ({tensor_meta(b).dtype} if b is not None else set())
    if not dtypes <= set(SUPPORTED_DTYPES):
        return f"dtypes input {x.dtype}, weight {w.dtype}, output {out.dtype}: not all float16, bfloat16 or float32"
    return None


def _operands(graph: fx.Graph, linear: fx.Node) -> tuple:
    """(x, weight, bias) for the op, each cast to the linear's output dtype where it differs: that is
    what torch.autocast does to them before the GEMM (outside autocast the dtypes all agree). `.to`
    is differentiable, so fp32 parameters get their gradients back in fp32, as under autocast."""
    dtype = tensor_meta(linear).dtype
    operands = []
    for a in (arg(linear, 0, "input"), arg(linear, 1, "weight"), arg(linear, 2, "bias")):
        if a is not None:
            with graph.inserting_before(linear):
                a = cast_to(graph, a, dtype)
        operands.append(a)
    return tuple(operands)


def _activation(linear: fx.Node) -> tuple[str, fx.Node, list[fx.Node] | None]:
    """('none', linear, None) or (name, last node of the element-wise chain that computes it, the
    views to its readers when the epilogue writes the chain's fp32 value narrower: _narrowed_views)."""
    region, exit_node = _pointwise_region(linear)
    if exit_node is None:
        return "none", linear, None
    out = tensor_meta(exit_node)
    if out is None:
        return "none", linear, None
    narrowed = None
    if out.dtype != tensor_meta(linear).dtype:
        narrowed = _narrowed_views(exit_node, linear)
        if narrowed is None:
            return "none", linear, None
    name = _which_activation(region, linear, exit_node)
    return (name, exit_node, narrowed) if name is not None else ("none", linear, None)


def _which_activation(region: list[fx.Node], start: fx.Node, exit_node: fx.Node) -> str | None:
    """The name in ACTIVATIONS of what the element-wise region computes from `start`, judged on
    probe values; None when it is none of them (or the probe cannot run it)."""
    try:
        probed = _evaluate(region, start, exit_node, _PROBE)
    except Exception:  # an op our probe cannot evaluate: not a recognisable activation
        return None
    for name, fn in ACTIVATIONS.items():
        expected = fn(_PROBE)
        if probed.shape == expected.shape and torch.allclose(probed, expected, rtol=1e-5, atol=1e-6):
            return name
    return None


def _narrowed_views(exit_node: fx.Node, linear: fx.Node) -> list[fx.Node] | None:
    """The views between the activation and its readers (graph.autocast_readers) when the activation's
    fp32 value is only read by linears that cast it back to the GEMM's half dtype, else None. CUDA
    autocast runs `pow` in fp32, so Hugging Face's NewGELUActivation on a bf16 GEMM result ends in
    fp32; GPT-2's next projection casts it to bf16 again. The epilogue then writes bf16: the same fp32
    activation rounded once, as eager's reader rounds it."""
    readers = autocast_readers(exit_node)
    return readers[1] if readers is not None and readers[0] == tensor_meta(linear).dtype else None


class GatedUnit(NamedTuple):
    """What _gated found after a linear: the `mul` of act(gate) * up and act's name in GATED_NAMES
    when the kernel fuses it; else a refusal when it is a gated unit the kernel cannot fuse."""
    mul: fx.Node | None = None
    activation: str | None = None
    refusal: str | None = None


def _gated(linear: fx.Node) -> GatedUnit:
    """The gated unit `linear` feeds when it computes [gate; up] in one GEMM (SiblingLinears merged
    a gated MLP's two projections, or the model has one gate_up projection that it chunks, as
    Phi-3 does) and its halves meet as act(gate) * up; an empty GatedUnit when there is none."""
    meta = tensor_meta(linear)
    halves = _halves(linear, meta)
    if halves is None:
        return GatedUnit()
    first, second = halves
    for gate, up in ((first, second), (second, first)):
        region, exit_node = _pointwise_region(gate)
        if exit_node is None or len(exit_node.users) != 1 or len(up.users) != 1:
            continue
        mul = next(iter(exit_node.users))
        if kind(mul) != "mul" or set(mul.args[:2]) != {exit_node, up} or tensor_meta(mul) is None:
            continue
        if tensor_meta(mul).dtype != meta.dtype or not same_shape(shape(mul), shape(up)):
            continue
        name = _which_activation(region, gate, exit_node)
        if name not in GATED_NAMES:
            return GatedUnit(refusal=f"a gated unit whose activation is {name or 'not one the kernel knows'} (the "
                                     f"kernel fuses act(gate) * up for {', '.join(GATED_NAMES)})")
        if gate is second:
            return GatedUnit(refusal="the gate projection comes after the up projection in the merged weight")
        return GatedUnit(mul, name)
    return GatedUnit()


def _halves(linear: fx.Node, meta) -> tuple[fx.Node, fx.Node] | None:
    """The nodes holding the first and second half of `linear`'s last dimension, when its only
    uses split it in two: two `narrow`s (SiblingLinears), or `chunk(2, -1)` / `split(n, -1)` and
    the two items taken from it."""
    users = list(linear.users)
    if meta is None or meta.shape[-1] % 2:
        return None
    total = meta.shape[-1]
    last = (-1, meta.dim() - 1)
    if len(users) == 2 and all(_is_narrow(u) for u in users):
        starts = {}
        for u in users:
            dim, start, length = u.args[1], u.args[2], u.args[3]
            if dim not in last or not isinstance(start, int) or length != total // 2:
                return None
            starts[start] = u
        return (starts[0], starts[total // 2]) if set(starts) == {0, total // 2} else None
    if len(users) != 1:
        return None
    split = users[0]
    name = split.target if split.op == "call_method" else getattr(split.target, "__name__", None)
    if name not in ("chunk", "split") or split.op not in ("call_method", "call_function"):
        return None
    size = split.args[1] if len(split.args) > 1 else split.kwargs.get("chunks", split.kwargs.get("split_size_or_sections"))
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if dim not in last or size != (2 if name == "chunk" else total // 2):
        return None
    items = {u.args[1]: u for u in split.users if u.target is operator.getitem and isinstance(u.args[1], int)}
    if len(items) != len(split.users) or set(items) != {0, 1}:
        return None
    return items[0], items[1]


def _is_narrow(node: fx.Node) -> bool:
    """`t.narrow(dim, start, length)` as SiblingLinears writes its column slices."""
    return node.op == "call_method" and node.target == "narrow" and len(node.args) == 4


def _pointwise_region(start: fx.Node) -> tuple[list[fx.Node], fx.Node | None]:
    """Element-wise nodes computed from `start` alone (and constants), in graph order, and the one
    node of the region whose value leaves it. (None for the exit when there is no single exit.)"""
    region: list[fx.Node] = []
    inside = {start}
    node = start.next
    # Only look a short way ahead: activations are a handful of nodes right after the GEMM.
    for _ in range(24):
        if node.op == "output":
            break
        if kind(node) in POINTWISE and _reads_only(node, inside):
            region.append(node)
            inside.add(node)
        node = node.next
    # Trim to the part that leaves through a single node.
    while region:
        exits = [n for n in [start] + region if any(u not in inside for u in n.users)]
        if exits == [region[-1]]:
            return region, region[-1]
        inside.discard(region[-1])
        region.pop()
    return [], None


def _reads_only(node: fx.Node, inside: set) -> bool:
    tensors = [a for a in list(node.args) + list(node.kwargs.values()) if isinstance(a, fx.Node)]
    if not any(t in inside for t in tensors):
        return False
    return all(t in inside or scalar(t) is not None for t in tensors)


def _evaluate(region: list[fx.Node], start: fx.Node, exit_node: fx.Node, probe: torch.Tensor) -> torch.Tensor:
    env = {start: probe}

    def load(a):
        if isinstance(a, fx.Node):
            return env[a] if a in env else scalar(a)
        if isinstance(a, (list, tuple)):
            return type(a)(load(x) for x in a)
        return a

    for n in region:
        args, kwargs = load(n.args), {k: load(v) for k, v in n.kwargs.items()}
        if n.op == "call_method":
            if kind(n) == "to":
                env[n] = args[0]  # a cast: the kernel computes the epilogue in fp32 and casts once
                continue
            env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
        else:
            env[n] = n.target(*args, **kwargs)
    return env[exit_node]


def _row_view(linear: fx.Node) -> fx.Node | None:
    """The linear's only user when it is a view or reshape that keeps the last dimension (GPT-2's
    Conv1D views its (rows, N) addmm result back to (batch, seq, N) before the activation and the
    residual add): element-wise epilogues commute with it, so they are looked for after it."""
    users = list(linear.users)
    if len(users) != 1 or kind(users[0]) not in ("view", "reshape") or users[0].args[0] is not linear:
        return None
    before, after = tensor_meta(linear), tensor_meta(users[0])
    if before is None or after is None or after.dim() == 0 or not same_shape(before.shape[-1:], after.shape[-1:]):
        return None
    return users[0]


def _flat_residual(graph: fx.Graph, residual: fx.Node, linear: fx.Node) -> fx.Node:
    """The residual, shaped like the view, reshaped to the linear's own (rows, N) (only a 2-D
    linear's residual passes the view: see _residual)."""
    flat = graph.call_method("reshape", (residual, -1, tensor_meta(linear).shape[-1]))
    flat.meta["example_value"] = tensor_meta(residual).reshape(tensor_meta(linear).shape)
    return flat


def _residual(last: fx.Node, linear: fx.Node) -> tuple[fx.Node | None, fx.Node]:
    """(residual, add node) when `last` feeds one residual add of its own shape, else (None, last).
    `linear` may be the linear's row view (_row_view) when the linear is 2-D with a fixed N."""
    if kind(linear) in ("view", "reshape"):
        rows = tensor_meta(linear.args[0])
        if rows is None or rows.dim() != 2 or not isinstance(rows.shape[-1], int):
            return None, last
    users = list(last.users)
    if len(users) != 1 or kind(users[0]) != "add" or arg(users[0], 2, "alpha", 1) != 1:
        return None, last
    add = users[0]
    if len(add.args) < 2:
        return None, last
    other = add.args[1] if add.args[0] is last else add.args[0]
    if other is last or not isinstance(other, fx.Node) or tensor_meta(other) is None:
        return None, last
    if not same_shape(shape(other), shape(last)) or tensor_meta(other).dtype != tensor_meta(last).dtype or not same_shape(shape(add), shape(last)):
        return None, last
    return other, add
