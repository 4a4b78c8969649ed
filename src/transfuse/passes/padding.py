"""Which dynamic dimensions of a graph may be padded up to a bucket without changing the real outputs.

The runtime (runtime/buckets.py) pads batch and sequence dimensions to a few bucket sizes so that one
CUDA graph serves many shapes. Padding is exact only when every real output element depends on real
input elements alone. This module proves that per symbol, by meaning, from the rewritten graph:

* element-wise operations, views, embeddings and gathers from fixed tables are row-local;
* a contraction (GEMM, matmul), a reduction (sum, softmax, max, ...), a concatenation, or an index
  computed from the end (`x[:, -1]`) along a padded dimension is not, and forbids padding it;
* `cumsum` along a dimension padded at its end only reads earlier positions: allowed;
* `transfuse.attention` reduces over its keys: allowed, because this pass gives it a `key_len`
  input that ends the keys at the real length (the padded keys are never read);
* a size used as a value (`x / seq_len`) would change with padding: forbidden;
* anything else that touches a padded dimension is unknown, and unknown forbids.

A symbol that cannot be padded is run at its exact size instead (a graph per size); the reason is
reported, never guessed around.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from transfuse.passes.graph import method_name, same_size, static_inputs, value

_POINTWISE = {
    "add", "sub", "mul", "truediv", "div", "floordiv", "mod", "neg", "pow", "abs", "exp", "log",
    "sqrt", "rsqrt", "sigmoid", "tanh", "relu", "gelu", "silu", "erf", "softplus", "clamp",
    "clamp_min", "clamp_max", "minimum", "maximum", "where", "masked_fill", "masked_fill_", "eq",
    "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "invert", "logical_not", "logical_and",
    "logical_or", "bitwise_not", "bitwise_and", "bitwise_or", "to", "type", "type_as", "float",
    "half", "bfloat16", "int", "long", "bool", "double", "contiguous", "clone", "detach", "isnan",
    "isinf", "nan_to_num", "sin", "cos", "reciprocal", "square", "sign", "fill_", "zero_", "add_",
    "mul_", "sub_", "div_", "dropout", "rsub", "iadd", "imul", "isub", "itruediv", "ifloordiv", "imod", "ipow",
    "iand", "ior", "ixor", "not_", "sgn", "log1p", "expm1",
}
_LAYOUT = {
    "view", "reshape", "permute", "transpose", "unsqueeze", "squeeze", "expand", "expand_as",
    "flatten", "unflatten", "t", "size", "dim", "stride", "numel", "movedim", "swapaxes", "view_as",
    "reshape_as", "sym_size",
}
_SAME_VALUES = {"to", "long", "int", "contiguous", "clone", "detach", "type_as"}  # element-wise, values kept
_CREATE = {"ones", "zeros", "empty", "new_ones", "new_zeros", "new_empty", "ones_like", "zeros_like", "empty_like"}
_FILL = {"full", "new_full", "full_like", "tensor", "scalar_tensor"}  # these also take a value
_REDUCE = {
    "sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "prod", "std", "var", "norm",
    "logsumexp", "softmax", "log_softmax", "any", "all", "count_nonzero", "median", "mode", "sort",
    "argsort", "topk", "cummax", "cummin", "unique", "nansum", "nanmean", "kthvalue",
}
_PREFIX = {"cumsum", "cumprod"}
_NORMS = {"transfuse.layer_norm", "transfuse.add_layer_norm", "transfuse.rms_norm", "transfuse.add_rms_norm"}


@dataclasses.dataclass
class PaddingPlan:
    """What the runtime needs to pad one graph. Symbols are sympy symbols of Dynamo's shape env."""

    names: dict                       # symbol -> readable name ("input_ids.size(1)")
    upper: dict                       # symbol -> largest value its guards allow (None: unbounded)
    sym_args: dict                    # graph input position of a SymInt -> its symbol
    tensor_dims: list                 # (input position, dim, symbol) of every dynamic input dim
    output_dims: list                 # per output: [(dim, symbol)] to slice back, or None (not a tensor)
    paddable: set                     # symbols that may be padded
    refused: dict                     # symbol -> why it may not be padded
    key_lens: list = dataclasses.field(default_factory=list)  # (symbol, int32 buffer attention reads)
    lower: dict = dataclasses.field(default_factory=dict)  # symbol -> smallest value its guards allow


def plan_padding(gm: fx.GraphModule) -> PaddingPlan | None:
    """Analyse `gm` (after the rewrite passes); add key_len inputs to attention over padded keys.
    None when the graph has no dynamic dimension."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    statics = static_inputs(gm)
    names: dict = {}
    sym_args: dict = {}
    tensor_dims: list = []
    refused: dict = {}
    shape_env = None
    for i, node in enumerate(placeholders):
        v = value(node)
        if isinstance(v, torch.SymInt):
            shape_env = v.node.shape_env
            expr = v.node.expr
            if isinstance(expr, sympy.Symbol):
                sym_args[i] = expr
        elif isinstance(v, torch.Tensor) and node not in statics:
            for d, size in enumerate(v.shape):
                if not isinstance(size, torch.SymInt):
                    continue
                shape_env = size.node.shape_env
                expr = size.node.expr
                if isinstance(expr, sympy.Symbol):
                    tensor_dims.append((i, d, expr))
                    names.setdefault(expr, f"{_readable(node.name)}.size({d})")
                else:
                    for s in expr.free_symbols:
                        refused.setdefault(s, f"input '{node.name}' has a dimension {expr}")
    for expr in sym_args.values():
        names.setdefault(expr, str(expr))
    symbols = set(names)
    if not symbols:
        return None

    unbacked = _first_unbacked(gm)
    if unbacked is not None:
        for s in symbols:
            refused.setdefault(s, f"'{unbacked[0]}' has a data-dependent size {unbacked[1]} whose relation to the "
                                  "padded sizes padding could break")
    analysis = _Analysis(symbols, refused)
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            try:
                analysis.visit(node)
            except Exception as e:  # noqa: BLE001 - a call form this analysis does not know: pad nothing
                for s in symbols:
                    refused.setdefault(s, f"'{node.name}' could not be analysed ({type(e).__name__}: {e})")
    output = next(iter(gm.graph.find_nodes(op="output")))
    output_dims = [analysis.output_slices(o) for o in _flat_outputs(output.args[0])]

    plan = PaddingPlan(
        names=names,
        upper={s: _capped(_upper_bound(shape_env, s), analysis.caps.get(s)) for s in symbols},
        sym_args=sym_args,
        tensor_dims=tensor_dims,
        output_dims=output_dims,
        paddable=symbols - set(refused),
        refused=refused,
        lower={s: _lower_bound(shape_env, s) for s in symbols},
    )
    _add_key_lengths(gm, plan, analysis.attention_keys)
    return plan


def _first_unbacked(gm: fx.GraphModule) -> tuple[str, str] | None:
    """(node name, symbol) of the first size Dynamo could only learn from data (an unbacked symbol:
    GPT-Neo's causal-mask slice of its `bias` buffer), or None. The analysis reasons over the input
    sizes; such a size is tied to them by runtime assertions it does not follow."""
    for node in gm.graph.nodes:
        v = value(node)
        try:
            found = free_unbacked_symbols(v) if isinstance(v, (torch.Tensor, torch.SymInt, torch.SymBool)) else ()
        except Exception:  # noqa: BLE001 - a value it cannot iterate holds no size
            found = ()
        if found:
            return node.name, str(next(iter(found)))
    return None


def _arg(node: fx.Node, index: int, *names: str):
    """The call's argument at `index`, or passed by one of its keyword names."""
    if len(node.args) > index:
        return node.args[index]
    for name in names:
        if name in node.kwargs:
            return node.kwargs[name]
    raise ValueError(f"{_name(node)} without argument {index} ({'/'.join(names)})")


def _readable(placeholder: str) -> str:
    for prefix in ("l_kwargs_", "l_args_", "l_"):
        if placeholder.startswith(prefix):
            placeholder = placeholder[len(prefix):]
            break
    return placeholder.rstrip("_")


def _flat_outputs(out: Any) -> list:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _lower_bound(shape_env, symbol) -> int:
    """The smallest value Dynamo's guards allow (2 for a dimension traced as dynamic: sizes 0 and 1
    get traces of their own)."""
    bound = shape_env.var_to_range.get(symbol)
    if bound is None or not isinstance(bound.lower, sympy.Integer):
        return 0
    return int(bound.lower)


def _capped(upper: int | None, cap: int | None) -> int | None:
    return cap if upper is None else upper if cap is None else min(upper, cap)


def _upper_bound(shape_env, symbol) -> int | None:
    """The largest value Dynamo's guards allow (e.g. the position table's length)."""
    bound = shape_env.var_to_range.get(symbol)
    if bound is None or not isinstance(bound.upper, sympy.Integer):
        return None  # unbounded (torch's int_oo)
    return int(bound.upper)


def _name(node: fx.Node) -> str:
    target = node.target
    if node.op == "call_method":
        return method_name(node)
    text = str(target)
    if text.startswith("transfuse."):
        return text.rsplit(".", 1)[0]  # "transfuse.linear.default" -> "transfuse.linear"
    return getattr(target, "__name__", text)


def _dims(meta: Any) -> list:
    return list(meta.shape) if isinstance(meta, torch.Tensor) else []


class _Analysis:
    def __init__(self, symbols: set, refused: dict):
        self.symbols = symbols
        self.refused = refused
        self.identity: set = set()  # nodes whose value at position p is p (aranges and their views)
        # Values that count along a padded dimension (a cumsum over it): in padded positions they
        # keep counting past anything the real input reaches, so they must never index a table.
        self.counts: dict = {}
        # Positions along a padded dimension (an arange over it, shifted by `offset`, None when
        # some other arithmetic made them): node -> (offset, symbols). Padding makes them run up to
        # the bucket size, so a table they look up bounds the bucket (caps: symbol -> largest size).
        self.positions: dict = {}
        self.caps: dict = {}
        self.attention_keys: list = []  # (attention node, symbol of its key axis)

    # ---- helpers
    def syms(self, size: Any) -> set:
        if isinstance(size, torch.SymInt):
            return set(size.node.expr.free_symbols) & self.symbols
        return set()

    def refuse(self, syms: set, node: fx.Node, why: str) -> None:
        for s in syms:
            self.refused.setdefault(s, f"{_name(node)} ('{node.name}') {why}")

    def tensor_args(self, node: fx.Node) -> list:
        out = []
        for a in list(node.args) + list(node.kwargs.values()):
            for item in a if isinstance(a, (list, tuple)) else [a]:
                if isinstance(item, fx.Node) and isinstance(value(item), torch.Tensor):
                    out.append(item)
        return out

    def dim_syms(self, node: Any, dim: int) -> set:
        dims = _dims(value(node))
        if not dims:
            return set()
        return self.syms(dims[dim % len(dims)])

    def all_syms(self, node: Any) -> set:
        out: set = set()
        v = value(node)
        for t in v if isinstance(v, (list, tuple)) else [v]:
            for size in _dims(t):
                out |= self.syms(size)
        return out

    def value_syms(self, node: fx.Node) -> set:
        """Symbols used as values (not sizes) in the arguments of an element-wise op."""
        return set().union(*(self.value_syms_of(a) for a in list(node.args) + list(node.kwargs.values())))

    # ---- the rules
    def visit(self, node: fx.Node) -> None:
        if isinstance(value(node), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
            return  # arithmetic on sizes, not on tensor values: its users are judged instead
        name = _name(node)
        tensor_args = self.tensor_args(node)
        involved = set().union(*(self.all_syms(a) for a in tensor_args)) | self.all_syms(node)
        counted = set().union(*(self.counts.get(a, set()) for a in tensor_args))
        if counted and (name in _POINTWISE or name in _LAYOUT):
            self.counts[node] = counted
        if name in _POINTWISE or name in _LAYOUT:
            self._follow_positions(node, name, tensor_args)
        if name in _POINTWISE:
            self.refuse(self.value_syms(node), node, "uses a padded size as a value")
            if node.args and node.args[0] in self.identity and (
                name in _SAME_VALUES
                or (name in ("add", "sub", "iadd", "add_", "sub_") and len(node.args) > 1 and node.args[1] == 0)
            ):
                self.identity.add(node)  # positions stay positions (HF adds a kv offset of 0)
            return
        if name in _LAYOUT:
            if name in ("expand", "view", "reshape", "unsqueeze") and node.args and node.args[0] in self.identity:
                self.identity.add(node)
            return
        if name == "arange":
            self._arange(node)
            return
        if name in _CREATE:
            return  # sizes only
        if name in _FILL:
            self.refuse(self.value_syms(node), node, "uses a padded size as a value")
            return
        if not involved:
            return
        if name == "getitem":
            self._getitem(node)
        elif name in ("embedding",):
            table = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            self.refuse(self.dim_syms(table, 0), node, "looks up a padded table")
            self.refuse(self.counts.get(node.args[0], set()), node, "looks up positions counted along it")
            self._bound_by_table(node, node.args[0], _dims(value(table))[:1])
        elif name == "transfuse.embedding_layer_norm":  # lookups as above, then a norm over the hidden dim
            indices, tables = node.args[0], node.args[1]
            for table in tables:
                self.refuse(self.dim_syms(table, 0), node, "looks up a padded table")
            for idx, table in zip(indices, tables):
                self.refuse(self.counts.get(idx, set()), node, "looks up positions counted along it")
                self._bound_by_table(node, idx, _dims(value(table))[:1])
            self.refuse(self.dim_syms(node, -1), node, "normalises over a padded dimension")
        elif name == "gather":
            self._gather(node)
        elif name in _PREFIX:
            # Position p reads positions <= p: padding at the end never reaches a real one.
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            self.counts[node] = self.dim_syms(node.args[0], dim) | counted
        elif name in _REDUCE:
            self._reduce(node)
        elif name == "narrow":
            self._narrow(node)
        elif name in ("cat", "concat", "concatenate"):
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            first = node.args[0][0] if node.args and node.args[0] else None
            self.refuse(self.dim_syms(first, dim) if first is not None else involved, node, "concatenates along a padded dimension")
        elif name == "stack":
            pass
        elif name in ("split", "chunk", "unbind", "split_with_sizes", "tensor_split"):
            default = 0
            dim = node.args[2] if len(node.args) > 2 and name != "unbind" else (node.args[1] if name == "unbind" and len(node.args) > 1 else node.kwargs.get("dim", default))
            self.refuse(self.dim_syms(node.args[0], dim), node, "splits a padded dimension")
        elif name in ("linear", "transfuse.linear"):
            self.refuse(self.dim_syms(node.args[0], -1), node, "contracts over a padded dimension")
        elif name in _NORMS:
            self.refuse(self.dim_syms(node.args[0], -1), node, "normalises over a padded dimension")
        elif name in ("transfuse.rms_norm_linear", "transfuse.layer_norm_linear"):  # a norm, then a linear, both over the last dim
            self.refuse(self.dim_syms(node.args[0], -1), node, "normalises over a padded dimension")
        elif name in ("conv1d", "conv2d", "conv3d"):  # images and audio: samples of a batch stay apart
            src = node.args[0]
            self.refuse(set().union(*(self.dim_syms(src, d) for d in range(1, len(_dims(value(src)))))), node,
                        "convolves over a padded dimension")
        elif name in ("layer_norm", "rms_norm", "group_norm"):  # torch's own, left as they were
            shape = node.args[1] if len(node.args) > 1 else node.kwargs.get("normalized_shape", ())
            count = len(shape) if isinstance(shape, (list, tuple)) and name != "group_norm" else len(_dims(value(node.args[0])))
            self.refuse(set().union(*(self.dim_syms(node.args[0], -1 - i) for i in range(count))), node,
                        "normalises over a padded dimension")
        elif name in ("addmm", "baddbmm", "addbmm"):  # bias + a @ b (GPT-2's Conv1D; BLOOM's ALiBi by keyword)
            a, b = _arg(node, 1, "mat1", "batch1"), _arg(node, 2, "mat2", "batch2")
            self.refuse(self.dim_syms(a, -1) | self.dim_syms(b, -2), node, "contracts over a padded dimension")
        elif name in ("matmul", "bmm", "mm"):
            a, b = _arg(node, 0, "input"), _arg(node, 1, "other", "mat2")
            self.refuse(self.dim_syms(a, -1) | self.dim_syms(b, -2 if len(_dims(value(b))) > 1 else 0), node, "contracts over a padded dimension")
        elif name == "transfuse.attention":
            self._attention(node)
        elif name in ("transfuse.attention_mask_summary", "mask_summary_for"):
            pass
        elif name == "transfuse.rotary_table":  # row (b, s) of the tables reads positions[b, s] alone
            pass
        elif name == "transfuse.rotary":  # element-wise but for the head dim, which it rotates
            self.refuse(self.dim_syms(node.args[0], -1), node, "rotates across a padded dimension")
        elif name == "transfuse.rotary_pair":
            self.refuse(self.dim_syms(node.args[0], -1) | self.dim_syms(node.args[1], -1), node,
                        "rotates across a padded dimension")
        else:
            self.refuse(involved, node, "is not known to keep padded positions apart")

    def _arange(self, node: fx.Node) -> None:
        args = [a for a in node.args]
        if len(args) == 1 or (len(args) >= 2 and args[0] == 0 and (len(args) < 3 or args[2] == 1)):
            self.identity.add(node)
            self.positions[node] = (0, frozenset(self.value_syms_of(args[1] if len(args) > 1 else args[0])))
            return
        self.refuse(set().union(*(self.value_syms_of(a) for a in args[:1])), node, "starts at a padded size")
        if len(args) >= 2:
            start = args[0] if isinstance(args[0], int) and (len(args) < 3 or args[2] == 1) else None
            self.positions[node] = (start, frozenset(self.value_syms_of(args[1])))

    def _follow_positions(self, node: fx.Node, name: str, tensor_args: list) -> None:
        """Positions stay positions through views and casts, and shift by a constant added."""
        found = [self.positions[a] for a in tensor_args if a in self.positions]
        if not found:
            return
        syms = frozenset().union(*(f[1] for f in found))
        first = self.positions.get(node.args[0]) if node.args else None
        offset = None
        if first is not None and len(found) == 1:
            if name in _LAYOUT or name in _SAME_VALUES:
                offset = first[0]
            elif name in ("add", "iadd", "add_", "sub", "isub", "sub_") and len(node.args) > 1 \
                    and isinstance(node.args[1], int) and not isinstance(node.args[1], bool) and first[0] is not None:
                offset = first[0] + (node.args[1] if name.startswith(("add", "iadd")) else -node.args[1])
        elif first is None and len(found) == 1 and name in ("add", "iadd", "add_") and len(node.args) > 1 \
                and node.args[1] in self.positions and isinstance(node.args[0], int) and found[0][0] is not None:
            offset = found[0][0] + node.args[0]
        self.positions[node] = (offset, syms)

    def _bound_by_table(self, node: fx.Node, index: Any, rows: list) -> None:
        """A table of `rows` rows looked up at positions along a padded dimension: padded positions
        must stay inside it, so that dimension's buckets stop at rows - offset."""
        if index not in self.positions or not rows:
            return
        offset, syms = self.positions[index]
        n = rows[0]
        if isinstance(n, torch.SymInt) or offset is None:
            # A padded table is padded with the positions (equal sizes are padded alike). Positions
            # through other arithmetic are left as before: T5's relative buckets clamp them into
            # the table, which this analysis cannot see.
            return
        for sym in syms:
            self.caps[sym] = min(self.caps.get(sym, n - offset), n - offset)

    def _bound_by_slice(self, node: fx.Node, stop: Any, rows: int) -> None:
        """`table[:s + c]` of a fixed-size dimension (BERT's position and token-type buffers sliced
        to the input's length): past rows - c the slice would stop growing with s, so s's buckets
        stop there."""
        if not isinstance(stop, torch.SymInt):
            return
        expr = stop.node.expr
        syms = set(expr.free_symbols) & self.symbols
        if not syms:
            return
        const, rest = expr.as_coeff_Add()
        if rest.is_Symbol and rest in self.symbols and const.is_Integer:
            cap = rows - int(const)
            self.caps[rest] = min(self.caps.get(rest, cap), cap)
        else:
            self.refuse(syms, node, f"slices a fixed-size dimension up to {expr}")

    def value_syms_of(self, a: Any) -> set:
        v = value(a) if isinstance(a, fx.Node) else a
        return set(v.node.expr.free_symbols) & self.symbols if isinstance(v, (torch.SymInt, torch.SymFloat)) else set()

    def _getitem(self, node: fx.Node) -> None:
        src, index = node.args[0], node.args[1]
        src_meta = value(src)
        if not isinstance(src_meta, torch.Tensor):
            return  # a tuple element (multi-output op)
        items = list(index) if isinstance(index, tuple) else [index]
        n_consuming = sum(1 for it in items if it is not None and it is not Ellipsis)
        dims = list(src_meta.shape)
        d = 0
        identity = src in self.identity
        for it in items:
            if it is None:
                continue
            if it is Ellipsis:
                d += len(dims) - n_consuming
                continue
            syms = self.syms(dims[d]) if d < len(dims) else set()
            if isinstance(it, slice):
                start_ok = it.start in (None, 0)
                step_ok = it.step in (None, 1)
                stop_ok = it.stop is None or (syms and same_size(value(it.stop) if isinstance(it.stop, fx.Node) else it.stop, dims[d]))
                if syms and not (start_ok and step_ok and stop_ok):
                    self.refuse(syms, node, "slices a padded dimension away from its start")
                if not (start_ok and step_ok and it.stop is None):
                    identity = False
                if not syms and d < len(dims) and isinstance(dims[d], int) and it.stop is not None:
                    self._bound_by_slice(node, value(it.stop) if isinstance(it.stop, fx.Node) else it.stop, dims[d])
            elif isinstance(it, fx.Node) and isinstance(value(it), torch.Tensor):
                self.refuse(self.counts.get(it, set()), node, "indexes with positions counted along it")
                self._bound_by_table(node, it, dims[d:d + 1])
                if syms and it not in self.identity:
                    self.refuse(syms, node, "indexes a padded dimension with computed positions")
                identity = False
            elif isinstance(it, int) and not isinstance(it, bool):
                if syms and it < 0:
                    self.refuse(syms, node, "counts a padded dimension from its end")
                identity = False
            else:
                self.refuse(syms | self.value_syms_of(it), node, "indexes a padded dimension")
                identity = False
            d += 1
        if identity:
            self.identity.add(node)
        # The elements picked are some of src's: what bounds src's values bounds theirs.
        if src in self.counts:
            self.counts[node] = self.counts[src]
        if src in self.positions:
            self.positions[node] = self.positions[src]

    def _gather(self, node: fx.Node) -> None:
        src = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        index = node.args[2] if len(node.args) > 2 else node.kwargs.get("index")
        syms = self.dim_syms(src, dim)
        if syms and index not in self.identity:
            self.refuse(syms, node, "gathers along a padded dimension")
        self.refuse(self.counts.get(index, set()), node, "gathers positions counted along it")
        if isinstance(dim, int):
            self._bound_by_table(node, index, _dims(value(src))[dim:][:1])

    def _reduce(self, node: fx.Node) -> None:
        name = _name(node)
        src = node.args[0]
        if name in ("max", "min") and len(node.args) > 1 and isinstance(node.args[1], fx.Node) and isinstance(value(node.args[1]), torch.Tensor):
            return  # element-wise max/min of two tensors
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if name in ("topk", "kthvalue"):
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
        elif name in ("sort", "argsort", "mode") and dim is None:
            dim = -1  # their default: along the last dimension (a router's sort over its experts)
        if dim is None:
            self.refuse(self.all_syms(src), node, "reduces over every dimension, padded ones included")
            return
        for d in dim if isinstance(dim, (list, tuple)) else [dim]:
            self.refuse(self.dim_syms(src, d), node, "reduces over a padded dimension")

    def _narrow(self, node: fx.Node) -> None:
        src, dim, start = node.args[0], node.args[1], node.args[2]
        if self.dim_syms(src, dim) and start != 0:
            self.refuse(self.dim_syms(src, dim), node, "narrows a padded dimension away from its start")

    def _attention(self, node: fx.Node) -> None:
        q, k = node.args[0], node.args[1]
        key_dims = _dims(value(k))
        syms = self.syms(key_dims[-2]) if key_dims else set()
        self.refuse(self.dim_syms(q, -1) | self.dim_syms(k, -1), node, "has a padded head dimension")
        if not syms:
            return
        expr = key_dims[-2].node.expr
        if isinstance(expr, sympy.Symbol):
            self.attention_keys.append((node, expr))
        else:
            self.refuse(syms, node, f"has {expr} keys (not one padded dimension)")

    def output_slices(self, out: Any) -> list | None:
        v = value(out) if isinstance(out, fx.Node) else out
        if isinstance(v, torch.Tensor):
            slices = []
            for d, size in enumerate(v.shape):
                syms = self.syms(size)
                if not syms:
                    continue
                expr = size.node.expr
                if isinstance(expr, sympy.Symbol):
                    slices.append((d, expr))
                else:
                    for s in syms:
                        self.refused.setdefault(s, f"an output has a dimension {expr}")
            return slices
        if isinstance(v, (torch.SymInt, torch.SymFloat)):
            for s in set(v.node.expr.free_symbols) & self.symbols:
                self.refused.setdefault(s, "the graph returns a padded size")
        return None


def _add_key_lengths(gm: fx.GraphModule, plan: PaddingPlan, attention_keys: list) -> None:
    """One int32 buffer per padded key symbol, read by every attention over those keys; the runtime
    writes the real length into it before each call. (A buffer, not a new graph input: Dynamo owns
    the graph's inputs.)"""
    graph = gm.graph
    nodes: dict = {}
    for node, symbol in attention_keys:
        if symbol not in plan.paddable:
            continue
        if symbol not in nodes:
            device = value(node.args[1]).device
            name = f"_transfuse_key_len_{len(nodes)}"
            buffer = torch.zeros(1, dtype=torch.int32, device=device)
            gm.register_buffer(name, buffer, persistent=False)
            first = next(iter(n for n in graph.nodes if n.op != "placeholder"))
            with graph.inserting_before(first):
                nodes[symbol] = graph.get_attr(name)
            nodes[symbol].meta["example_value"] = buffer
            plan.key_lens.append((symbol, buffer))
        args = list(node.args) + [None] * (9 - len(node.args))
        args[8] = nodes[symbol]
        node.args = tuple(args)
    if nodes:
        graph.lint()
        gm.recompile()
