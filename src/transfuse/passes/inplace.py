"""In-place arithmetic on a temporary, written out of place, so that the patterns after it can read
the chain: `scores += position_bias` (MPNet, transformers/models/mpnet/modeling_mpnet.py) appears in
the graph as `operator.iadd(scores, bias)`, which breaks `q @ k^T -> + bias -> softmax`.

* `InplaceArithmetic` — `a += b` (also -=, *=, /= and the `add_`-style methods) becomes `a + b` when
  nothing can observe the difference: `a` is the fresh result of an arithmetic op (not an input, a
  parameter or a view of one), this is its only reader, and the out-of-place result has a's dtype.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from transfuse.passes.graph import POINTWISE, kind, tensor_meta, value
from transfuse.passes.manager import PassContext

PATTERN = "InplaceArithmetic"
_FUNCTIONS = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
              operator.itruediv: operator.truediv}
_METHODS = {"add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div"}
_FRESH = (POINTWISE - {"to"}) | {"matmul"}  # ops whose result is a new tensor, never a view


def run(ctx: PassContext) -> None:
    for node in list(ctx.gm.graph.nodes):
        if node.op == "call_function" and node.target in _FUNCTIONS:
            replacement = ("call_function", _FUNCTIONS[node.target])
        elif node.op == "call_method" and node.target in _METHODS:
            replacement = ("call_method", _METHODS[node.target])
        else:
            continue
        if len(node.args) < 2 or node.kwargs or not _unobserved(node):
            continue
        node.op, node.target = replacement
        ctx.matched(PATTERN)


def _unobserved(node: fx.Node) -> bool:
    a, b = node.args[0], node.args[1]
    if not isinstance(a, fx.Node) or a.op not in ("call_function", "call_method") or kind(a) not in _FRESH:
        return False
    if list(a.users) != [node]:
        return False
    am = tensor_meta(a)
    bv = value(b) if isinstance(b, fx.Node) else b
    if am is None or not isinstance(bv, (torch.Tensor, int, float)):
        return False
    try:
        return torch.result_type(am, bv) == am.dtype
    except (TypeError, RuntimeError):
        return False
