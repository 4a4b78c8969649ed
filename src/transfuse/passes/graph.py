"""Reading a Dynamo FX graph by meaning.

Dynamo hands the backend a graph of torch-level calls: the same operation can appear as a function
(`torch.matmul`), an operator (`a @ b`), or a tensor method (`x.matmul(y)`), with arguments
positional or by keyword. The passes never look at those spellings directly: `kind(node)` names the
operation and `arg(node, i, name)` fetches an argument however it was passed.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

# One canonical name per operation; every spelling Dynamo can produce maps to it.
_FUNCTIONS: dict[Any, str] = {
    F.linear: "linear",
    torch.matmul: "matmul",
    operator.matmul: "matmul",
    torch.bmm: "matmul",
    F.softmax: "softmax",
    torch.softmax: "softmax",
    torch.nn.functional.dropout: "dropout",
    torch.dropout: "dropout",
    F.layer_norm: "layer_norm",
    torch.layer_norm: "layer_norm",
    F.scaled_dot_product_attention: "sdpa",
    operator.add: "add",
    torch.add: "add",
    operator.mul: "mul",
    torch.mul: "mul",
    operator.truediv: "div",
    torch.div: "div",
    torch.true_divide: "div",
    operator.sub: "sub",
    torch.sub: "sub",
    operator.neg: "neg",
    torch.neg: "neg",
    operator.pow: "pow",
    torch.pow: "pow",
    F.gelu: "gelu",
    F.relu: "relu",
    torch.relu: "relu",
    F.silu: "silu",
    torch.tanh: "tanh",
    F.tanh: "tanh",
    torch.sigmoid: "sigmoid",
    F.sigmoid: "sigmoid",
    torch.erf: "erf",
    torch.exp: "exp",
    torch.sqrt: "sqrt",
    torch.rsqrt: "rsqrt",
    torch.masked_fill: "masked_fill",
    torch.where: "where",
    torch.transpose: "transpose",
    torch.permute: "permute",
    torch.reshape: "reshape",
    torch.abs: "abs",
    operator.eq: "eq",
    torch.eq: "eq",
    operator.ne: "ne",
    torch.ne: "ne",
}
if hasattr(torch._C._nn, "gelu"):
    _FUNCTIONS[torch._C._nn.gelu] = "gelu"

_METHODS = {
    "matmul": "matmul",
    "bmm": "matmul",
    "softmax": "softmax",
    "add": "add",
    "mul": "mul",
    "div": "div",
    "sub": "sub",
    "neg": "neg",
    "pow": "pow",
    "relu": "relu",
    "tanh": "tanh",
    "sigmoid": "sigmoid",
    "exp": "exp",
    "sqrt": "sqrt",
    "rsqrt": "rsqrt",
    "masked_fill": "masked_fill",
    "transpose": "transpose",
    "permute": "permute",
    "view": "view",
    "reshape": "reshape",
    "contiguous": "contiguous",
    "to": "to",
    "type": "to",
    "float": "to",
    "half": "to",
    "bfloat16": "to",
    "type_as": "to",
    "eq": "eq",
    "ne": "ne",
}

# Operators that Dynamo records as Tensor methods on some torch versions (2.11 writes
# `mask == 0` as call_method "__eq__", 2.13 as operator.eq): read as the named method. Only the
# ones whose operands keep their order (no __rsub__, __rtruediv__).
_DUNDERS = {
    "__eq__": "eq", "__ne__": "ne", "__add__": "add", "__radd__": "add", "__mul__": "mul", "__rmul__": "mul",
    "__sub__": "sub", "__truediv__": "div", "__neg__": "neg", "__pow__": "pow", "__matmul__": "matmul",
}


def method_name(node: fx.Node) -> str:
    """A call_method's target, with operator dunders read as their method ("__eq__" -> "eq")."""
    return _DUNDERS.get(node.target, node.target)

# Element-wise operations: a chain of these after a GEMM is an activation candidate.
POINTWISE = {
    "add", "mul", "div", "sub", "neg", "pow", "gelu", "relu", "silu", "tanh", "sigmoid", "erf",
    "exp", "sqrt", "rsqrt", "to", "abs",
}


def kind(node: fx.Node) -> str | None:
    if node.op == "call_function":
        found = _FUNCTIONS.get(node.target)
    elif node.op == "call_method":
        found = _METHODS.get(method_name(node))
    else:
        return None
    # A `.to` that lands on another device is a copy, not a cast: no pass may fold it into a kernel
    # (whose output stays on its input's device), so it is not "to" and not element-wise.
    return "to_device" if found == "to" and _changes_device(node) else found


def _changes_device(node: fx.Node) -> bool:
    source = tensor_meta(node.args[0]) if node.args else None
    out = tensor_meta(node)
    return source is not None and out is not None and source.device != out.device


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument `index` (counting the tensor `self` of a method as 0) or keyword `name`."""
    if name in node.kwargs:
        return node.kwargs[name]
    if index < len(node.args):
        return node.args[index]
    return default


def value(node: Any) -> Any:
    """The fake tensor (or Python value) Dynamo recorded for a node; constants pass through."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def tensor_meta(node: Any) -> torch.Tensor | None:
    v = value(node)
    return v if isinstance(v, torch.Tensor) else None


def cast_to(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    """`node.to(dtype)` at the graph's insertion point, with its recorded value; node itself when it
    already has that dtype, or node's source when node only widened it exactly from that dtype
    (x.to(fp32).to(bf16) is x). What the passes insert where torch.autocast casts an op's operands."""
    if tensor_meta(node).dtype == dtype:
        return node
    source = node.args[0] if kind(node) == "to" and node.args and isinstance(node.args[0], fx.Node) else None
    if source is not None and tensor_meta(source) is not None and tensor_meta(source).dtype == dtype \
            and dtype in (torch.float16, torch.bfloat16) and tensor_meta(node).dtype == torch.float32 \
            and tensor_meta(source).device == tensor_meta(node).device:
        return source
    cast = graph.call_method("to", (node, dtype))
    cast.meta["example_value"] = tensor_meta(node).to(dtype)
    return cast


def autocast_readers(node: fx.Node) -> tuple[torch.dtype, list[fx.Node]] | None:
    """(the half dtype that every reader of node's fp32 value casts it to before using it, the view,
    reshape and slice nodes on the way), or None. A reader is a linear taking the value (or a view of
    it) as its input whose result has that narrower dtype: under autocast it casts its input first
    (and only then could an fp32 input give a bf16 result). So the op computing node may write that
    dtype itself: the same rounding, one pass, no cast in either direction."""
    out = tensor_meta(node)
    if out is None or out.dtype != torch.float32 or not node.users:
        return None
    dtypes, views, stack = set(), [], [node]
    while stack:
        source = stack.pop()
        for user in source.users:
            if (kind(user) in ("view", "reshape") or slices_only(user)) and user.args[0] is source and user.users:
                # GPT-2's Conv1D reads the rows through x.view(-1, hidden), its head through
                # hidden[:, -k:, :] (logits_to_keep)
                views.append(user)
                stack.append(user)
                continue
            meta = tensor_meta(user)
            if kind(user) != "linear" or user.args[0] is not source or source in user.args[1:] or meta is None:
                return None
            dtypes.add(meta.dtype)
    if len(dtypes) != 1:
        return None
    dtype = dtypes.pop()
    return (dtype, views) if dtype in (torch.float16, torch.bfloat16) else None


def record_dtype(views: list[fx.Node], dtype: torch.dtype) -> None:
    """Record `dtype` on autocast_readers' views once the op before them writes that dtype: later
    passes read these dtypes."""
    for view in views:
        if tensor_meta(view) is not None:
            view.meta["example_value"] = tensor_meta(view).to(dtype)


def slices_only(node: fx.Node) -> bool:
    """Whether node is `t[...]` with slices only (a view of t, no gather)."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return False
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    return all(isinstance(i, slice) and all(isinstance(b, (int, type(None))) for b in (i.start, i.stop, i.step))
               or i is None or i is Ellipsis for i in index)


def is_tensor(node: Any) -> bool:
    return tensor_meta(node) is not None


def shape(node: Any) -> tuple[int, ...] | None:
    t = tensor_meta(node)
    return tuple(t.shape) if t is not None else None


def dtype(node: Any) -> torch.dtype | None:
    t = tensor_meta(node)
    return t.dtype if t is not None else None


def scalar(node: Any) -> float | None:
    """A Python number, or a node that is a compile-time constant scalar tensor built from one
    (`torch.full([], c)`, `torch.tensor(c)`, `math.sqrt(c)` folded by Dynamo). None otherwise."""
    if isinstance(node, bool):
        return None
    if isinstance(node, (int, float)):
        return float(node)
    if isinstance(node, fx.Node) and node.op == "call_function":
        if node.target in (torch.full,) and len(node.args) >= 2 and scalar(node.args[1]) is not None:
            size = node.args[0]
            if isinstance(size, (list, tuple)) and math.prod(size) == 1:
                return scalar(node.args[1])
        if node.target is torch.tensor and node.args and isinstance(node.args[0], (int, float)):
            return float(node.args[0])
        if kind(node) in ("to", "to_device") and node.args:  # a constant's value survives a copy
            return scalar(node.args[0])
    return None


def single_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def positive_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def is_last_two_transpose(node: fx.Node) -> bool:
    """`x.transpose(-1, -2)` / `x.transpose(2, 3)` / `x.permute(..., -1, -2)` / `x.mT`."""
    k = kind(node)
    src = tensor_meta(node.args[0]) if node.args else None
    if src is None:
        return False
    nd = src.dim()
    if k == "transpose":
        d0 = positive_dim(arg(node, 1, "dim0"), nd)
        d1 = positive_dim(arg(node, 2, "dim1"), nd)
        return {d0, d1} == {nd - 1, nd - 2}
    if k == "permute":
        dims = node.args[1:] if len(node.args) > 2 else arg(node, 1, "dims")
        dims = [positive_dim(d, nd) for d in dims]
        return dims == list(range(nd - 2)) + [nd - 1, nd - 2]
    return False


def static_inputs(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Placeholders that hold module parameters or buffers (Dynamo lifts them as graph inputs):
    placeholder node -> its position among the graph's inputs. Tensors only: the size of a module's
    tensor attribute, lifted as a SymInt input, has the module's guard source too (RecurrentGemma's
    recurrent state in training, under torch 2.11)."""
    out = {}
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        if not isinstance(node.meta.get("example_value"), torch.Tensor):
            continue
        if node.meta.get("transfuse_static"):  # tagged by trace_cache.py, where Dynamo's grapharg is gone
            out[node] = i
            continue
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
        guard = getattr(source, "guard_source", None)
        if guard is not None and (guard.is_unspecialized_nn_module() or guard.is_specialized_nn_module()):
            out[node] = i
    return out


def node_order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


# Tensor methods and functions that only compute a value: unused, they are dead. (A rewritten norm
# leaves its statistic behind: `variance = x.float().pow(2).mean(-1)`, three kernels a call.)
_PURE_METHODS = frozenset({
    "to", "float", "half", "bfloat16", "type_as", "pow", "mean", "sum", "rsqrt", "sqrt", "exp", "cos", "sin",
    "mul", "add", "sub", "div", "neg", "view", "reshape", "transpose", "permute", "contiguous", "unsqueeze",
    "squeeze", "expand", "narrow", "size", "dim", "clone", "any", "all", "isinf", "isnan", "abs", "eq", "ne",
    "isfinite", "logical_not", "logical_or", "logical_and", "clamp", "where",
    # views into pieces: a fused projection's output split after its readers moved to a merged op
    # (Phi-3's gate_up_proj, chunked, once SwiGLU reads the weight itself) keeps the GEMM alive
    "chunk", "split", "unbind", "tensor_split", "split_with_sizes",
    # row reductions that hand-written attention with sinks reads beside the softmax (passes/attention_sinks.py)
    "logsumexp", "max", "amax",
    # what a mask replaced by its row of kept keys leaves behind (passes/causal_mask.py's KeyPadding)
    "new_ones", "new_zeros", "bool", "long", "int",
})
_PURE_FUNCTIONS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow, operator.getitem,
    torch.cat, torch.rsqrt, torch.mean, torch.pow, torch.cos, torch.sin, torch.exp, torch.arange,
    # what a replaced guard leaves behind (T5's `torch.where(torch.isinf(h).any(), ...)`)
    torch.isinf, torch.isnan, torch.any, torch.all, torch.abs, torch.eq, torch.ne,
    # and the BART family's, made a select (branchless.py, passes/clamp.py's OverflowSelect)
    torch.isfinite, torch.logical_not, torch.logical_or, torch.logical_and, torch.clamp, torch.where,
    torch.chunk, torch.split, torch.unbind, torch.tensor_split,
    torch.logsumexp, torch.max, torch.amax,
    # Hugging Face's mask functions, combined with & and | over comparisons of aranges (KeyPadding)
    operator.and_, operator.or_, operator.invert, operator.ge, operator.gt, operator.le, operator.lt,
    operator.eq, operator.ne,
})


def add_buffer(gm: fx.GraphModule, prefix: str, tensor: torch.Tensor) -> str:
    """Registers `tensor` on `gm` as a non-persistent buffer named `prefix` + the first free index
    (prefix "_transfuse_...": Backend.release() drops such buffers); returns the name."""
    i = 0
    while hasattr(gm, f"{prefix}{i}"):
        i += 1
    gm.register_buffer(f"{prefix}{i}", tensor, persistent=False)
    return f"{prefix}{i}"


def replace_by_buffer(gm: fx.GraphModule, node: fx.Node, prefix: str, tensor: torch.Tensor, recorded=None) -> None:
    """Every use of `node` reads `tensor`, registered on gm as a buffer (add_buffer), instead; node
    goes. `recorded`: the value the new node records (default the tensor itself)."""
    graph = gm.graph
    with graph.inserting_before(node):
        constant = graph.get_attr(add_buffer(gm, prefix, tensor))
    constant.meta = dict(node.meta)
    constant.meta["example_value"] = tensor if recorded is None else recorded
    node.replace_all_uses_with(constant)
    graph.erase_node(node)


def remove_dead_code(graph: fx.Graph) -> None:
    """Erase unused nodes whose operation we know to be pure. FX's own DCE would also drop an
    unused in-place call such as `x.masked_fill_(...)`, which is not ours to remove."""
    for node in reversed(list(graph.nodes)):
        if not node.users and node.op in ("call_function", "call_method"):
            pure = (method_name(node) in _PURE_METHODS if node.op == "call_method"
                    else node.target in _PURE_FUNCTIONS if _hashable(node.target) else False)
            if pure or kind(node) is not None or (_is_transfuse_op(node) and not _written_by_schema(node)):
                graph.erase_node(node)


def _hashable(target) -> bool:
    try:
        hash(target)
    except TypeError:
        return False
    return True


def _is_transfuse_op(node: fx.Node) -> bool:
    return "transfuse" in str(getattr(node.target, "namespace", "")) or str(node.target).startswith("transfuse.")


# --------------------------------------------------------------------------------------------
# Symbolic shapes: with dynamic batch/sequence dimensions a size is a SymInt (a sympy expression
# over Dynamo's symbols) instead of an int. Passes compare sizes without adding guards.


def symbols_of(size: Any) -> frozenset:
    """The sympy symbols a size depends on (empty for a plain int)."""
    if isinstance(size, torch.SymInt):
        return frozenset(size.node.expr.free_symbols)
    return frozenset()


def same_size(a: Any, b: Any) -> bool:
    """True when two sizes are equal for every value of their symbols (no guard is added)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


def same_shape(a: Any, b: Any) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def size_arg(graph: fx.Graph, size: Any) -> Any:
    """`size` as a graph argument: an int as itself; a SymInt as the placeholder Dynamo lifted for
    it (None when the size is an expression no placeholder holds)."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr = size.node.expr
    for node in graph.find_nodes(op="placeholder"):
        v = value(node)
        if isinstance(v, torch.SymInt) and v.node.expr == expr:
            return node
    return None


UNBACKED_HINT = 64  # stands in for a data-dependent size (Dynamo's unbacked symbol: no example value)


def hint(size: Any) -> int:
    """A size's value in the example Dynamo traced (the int itself when static). Only for checks
    whose answer cannot depend on the value, such as whether a view of a column slice exists, and
    for estimates (the report's FLOPs): a data-dependent size, which has no example, counts as
    UNBACKED_HINT."""
    if isinstance(size, torch.SymInt):
        if size.node.hint is not None:
            return int(size.node.hint)
        value = size.node.shape_env.size_hint(size.node.expr, allow_none=True)
        return int(value) if value is not None else UNBACKED_HINT
    return int(size)


def evaluate(nodes: list, out: fx.Node, env: dict):
    """Run `nodes` (in graph order) on real tensors: `env` maps the region's inputs to values."""
    return evaluate_all(nodes, env)[out]


def evaluate_all(nodes: list, env: dict) -> dict:
    """evaluate()'s run, every node's value: `env` with each of `nodes` added."""
    env = dict(env)

    def load(a):
        return fx.node.map_arg(a, lambda n: env[n])

    for node in nodes:
        if node in env:
            continue
        args, kwargs = load(node.args), load(node.kwargs)
        recorded = tensor_meta(node)
        if kind(node) == "to" and recorded is not None and isinstance(args[0], torch.Tensor):
            # Only the cast's dtype: one that also names the graph's device (`.to("cuda:0")`, a
            # no-op there) must not send the host's probes to it.
            env[node] = args[0].to(recorded.dtype)
        elif node.op == "call_method":
            env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            env[node] = node.target(*args, **kwargs)
    return env


_VIEW_METHODS = {
    "view", "view_as", "reshape", "narrow", "transpose", "permute", "unsqueeze", "squeeze", "expand",
    "expand_as", "select", "__getitem__", "contiguous", "t", "flatten", "unflatten", "as_strided", "detach",
}
_VIEW_FUNCTIONS = {operator.getitem, torch.narrow, torch.transpose, torch.permute, torch.reshape, torch.unsqueeze,
                   torch.squeeze, torch.select, torch.flatten, torch.t, torch.as_strided, torch.detach}
_INPLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv}


def _is_view(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _VIEW_METHODS) or (
        node.op == "call_function" and node.target in _VIEW_FUNCTIONS)


def _reads_strides(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in ("as_strided", "as_strided_", "stride", "data_ptr")
    return node.op == "call_function" and node.target in (torch.as_strided, torch.Tensor.as_strided, torch.Tensor.stride)


def strides_read_downstream(node: fx.Node) -> fx.Node | None:
    """The first node that reads `node`'s memory layout through views of it (`as_strided`,
    `.stride()`), or None. Dynamo traces such a node with the strides of the example it saw (as
    constants), so a pass that gives `node` a different layout (a column slice of a merged output)
    would make it read the wrong elements. Longformer/LED's sliding-window chunking does this."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        for user in n.users:
            if user in seen:
                continue
            seen.add(user)
            if _reads_strides(user):
                return user
            if _is_view(user):
                todo.append(user)
    return None


def written_inputs(gm: fx.GraphModule) -> set[int]:
    """Positions of the graph inputs that the graph writes in place, directly or through a view
    (a static KV cache's `index_copy_`, `x[i] = v`, `x += y` on an input). Conservative: a view op
    is anything that may alias its input."""
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    base: dict[fx.Node, fx.Node] = {n: n for n in placeholders}
    written: set[int] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or not node.args:
            continue
        declared = _written_by_schema(node)
        if declared is not None:  # an op with a schema says which arguments it writes (kv_cache_write)
            for i in declared:
                arg = node.args[i] if i < len(node.args) else None
                for a in arg if isinstance(arg, (list, tuple)) else (arg,):  # a Tensor[] argument (_foreach_add_)
                    if isinstance(a, fx.Node) and base.get(a) is not None:
                        written.add(placeholders[base[a]])
            continue
        first = node.args[0]
        root = base.get(first) if isinstance(first, fx.Node) else None
        if root is None:
            continue
        if _writes_first_arg(node):
            written.add(placeholders[root])
        elif _is_view(node):
            base[node] = root
    return written


def writes_in_place(node: fx.Node) -> bool:
    """Whether the node may write one of its arguments in place: an in-place name (`add_`, `x += y`)
    or a schema that declares a written argument (transfuse.kv_cache_write, aten's foreach ops)."""
    return _writes_first_arg(node) or bool(_written_by_schema(node))


def _written_by_schema(node: fx.Node) -> list[int] | None:
    """The positions of the arguments an op's schema declares written; None for a target without one."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return None
    return [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def _writes_first_arg(node: fx.Node) -> bool:
    target = node.target
    if node.op == "call_method":
        return target.endswith("_") and not target.startswith("__")
    if target in _INPLACE_OPERATORS:
        return True
    name = getattr(target, "__name__", "")
    return name.endswith("_") and not name.startswith("__")
