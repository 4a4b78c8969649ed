"""Attention masks that are exactly causal, recognised in a training graph so that the attention
kernels get `is_causal` and skip the blocks above the diagonal instead of reading a T x T mask.

Two sources, each proven causal before it is replaced:

* `CausalMaskBuffer` (causal_buffer) — nanoGPT's registered `tril(ones)` buffer, sliced to T x T
  and compared with 0. Its value is read at compile time.
* `CausalMaskFromShapes` (causal_from_shapes) — a mask computed from the sequence length alone, as
  Hugging Face's `create_causal_mask` builds one under tracing (`kv_idx <= q_idx` over aranges,
  expanded over the batch) when the model gets no attention_mask. The mask's subgraph reads no
  tensor input, only sizes, so it is run at compile time on sequence lengths beyond every integer
  constant it contains (a sliding window of W is causal below W and not above: the probe sees
  both), for two batch sizes, and must equal the lower triangle at every one of them.

Neither runs on inference graphs: there the mask gets a block summary once per forward, which skips
the same blocks and also handles padding.
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from transfuse.passes.graph import evaluate, kind, scalar, tensor_meta
from transfuse.passes.manager import PassContext

# The probe runs the mask at this many query positions at most (a bool T x T tensor: 64 MiB at 8192).
MAX_PROBE_LENGTH = 8192


def causal_buffer(ctx: PassContext, spec: dict) -> bool:
    """nanoGPT's mask: `scores.masked_fill(self.bias[:, :, :T, :T] == 0, -inf)` over a registered
    buffer that holds tril(ones) (or `torch.where(bias[..] != 0 / .bool(), scores, -inf)`). The top-left
    T x T corner of a lower-triangular buffer is causal for every T. The buffer is read at compile time
    and is assumed not to change afterwards, as a causal-mask buffer does not."""
    if not ctx.training or len(spec["bool_masks"]) != 1:
        return False
    how, cond = spec["bool_masks"][0]
    if not isinstance(cond, fx.Node):
        return False
    want_zero = how == "fill"  # masked where the buffer is 0, or kept where it is nonzero
    comparison = kind(cond)
    if comparison in ("eq", "ne") and len(cond.args) == 2 and scalar(cond.args[1]) == 0.0:
        if (comparison == "eq") != want_zero:
            return False
        sliced = cond.args[0]
    else:
        return False
    if not (isinstance(sliced, fx.Node) and sliced.op == "call_function" and sliced.target is operator.getitem):
        return False
    buffer, index = sliced.args
    value = ctx.placeholder_value(buffer) if isinstance(buffer, fx.Node) else None
    if value is None or value.dim() < 2 or value.shape[-1] != value.shape[-2] or not isinstance(index, tuple):
        return False
    *lead, rows, cols = index
    if len(index) != value.dim() or any(i != slice(None) for i in lead):
        return False
    if not all(isinstance(i, slice) and i.start in (None, 0) and i.step is None for i in (rows, cols)) \
            or rows.stop is not cols.stop and str(rows.stop) != str(cols.stop):
        return False
    q_len, k_len = tensor_meta(spec["q"]).shape[-2], tensor_meta(spec["v"]).shape[-2]
    if str(q_len) != str(k_len):
        return False
    n = value.shape[-1]
    tril = torch.ones(n, n, dtype=torch.bool, device=value.device).tril()
    return bool(((value != 0) == tril).all())


def causal_from_shapes(ctx: PassContext, spec: dict) -> bool:
    """Whether the spec's one mask is computed from sizes alone and is the causal lower triangle at
    every probed length (module docstring)."""
    if not ctx.training:
        return False
    if len(spec["masks"]) + len(spec["bool_masks"]) != 1:
        return False
    if spec["masks"]:
        mask, keep_where = spec["masks"][0], None  # SDPA: True keeps; additive: 0 keeps
    else:
        how, mask = spec["bool_masks"][0]
        keep_where = how == "keep"
    if not isinstance(mask, fx.Node) or tensor_meta(mask) is None:
        return False
    seq = _sequence_symbol(spec)
    if seq is None:
        return False
    region = _size_only_region(mask)
    if region is None:
        return False
    nodes, leaves, biggest = region
    length = 2 * biggest + 3
    if length > MAX_PROBE_LENGTH:
        return False
    for seq_len, other in ((1, 2), (17, 3), (max(length, 67), 2)):
        env = {}
        for leaf in leaves:
            value = _size_value(leaf, seq, seq_len, other)
            if value is None:
                return False
            env[leaf] = value
        try:
            with torch.no_grad():
                result = evaluate(nodes, mask, env)
        except Exception:  # an op the probe cannot run at compile time: not provably causal
            return False
        if not _is_causal(result, seq_len, keep_where):
            return False
    return True


def _sequence_symbol(spec: dict) -> sympy.Symbol | None:
    """The symbol of the query length when queries and keys have that same dynamic length."""
    q_len, k_len = tensor_meta(spec["q"]).shape[-2], tensor_meta(spec["v"]).shape[-2]
    if not isinstance(q_len, torch.SymInt) or str(q_len) != str(k_len):
        return None
    expr = q_len.node.expr
    return expr if isinstance(expr, sympy.Symbol) else None


def _size_only_region(mask: fx.Node) -> tuple[list[fx.Node], list[fx.Node], int] | None:
    """(the nodes computing `mask` in graph order, their size leaves, the largest integer constant
    among their arguments) when everything the mask reads is a size (a SymInt or int node: a
    placeholder, `x.size(1)`...) or a constant; None when it reads a tensor input or attribute."""
    seen: set[fx.Node] = set()
    nodes, leaves = [], []
    biggest = 0
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, (torch.SymInt, int)) and not isinstance(value, bool):
            leaves.append(node)  # a size: assigned a value by the probe, whatever computes it
            continue
        if node.op in ("placeholder", "get_attr", "output") or not isinstance(value, torch.Tensor):
            return None
        nodes.append(node)
        for a in _flat(node.args) + _flat(node.kwargs):
            if isinstance(a, fx.Node):
                stack.append(a)
            elif isinstance(a, int) and not isinstance(a, bool):
                biggest = max(biggest, abs(a))
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(nodes, key=order.__getitem__), leaves, biggest


def _flat(args) -> list:
    if isinstance(args, dict):
        args = list(args.values())
    out = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.extend(_flat(a))
        elif isinstance(a, slice):
            out.extend([a.start, a.stop, a.step])
        else:
            out.append(a)
    return out


def _size_value(leaf: fx.Node, seq: sympy.Symbol, seq_len: int, other: int) -> int | None:
    """The probe's value of a size node: its expression with the sequence symbol at seq_len and every
    other symbol (the batch) at `other`."""
    value = leaf.meta.get("example_value", leaf.meta.get("val"))
    if isinstance(value, int):
        return value
    expr = value.node.expr
    result = expr.subs({s: (seq_len if s == seq else other) for s in expr.free_symbols})
    return int(result) if result.is_Integer else None


def _is_causal(mask: torch.Tensor, seq_len: int, keep_where: bool | None) -> bool:
    """Whether `mask` (bool, or additive when keep_where is None and it is floating) keeps exactly
    the lower triangle of every (seq_len, seq_len) slice."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or tuple(mask.shape[-2:]) != (seq_len, seq_len):
        return False
    if mask.dtype == torch.bool:
        keep = mask if keep_where in (None, True) else ~mask
    elif mask.dtype.is_floating_point and keep_where is None:
        # additive: 0 keeps, and a masked score must vanish in the softmax as under -inf
        masked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool(((mask == 0) | masked).all()):
            return False
        keep = mask == 0
    else:
        return False
    tril = torch.ones(seq_len, seq_len, dtype=torch.bool, device=mask.device).tril()
    return bool((keep == tril).all())
