"""Branchless guards: a module forward's `if <tensor reduction>: x = f(x)` made into a select that
Dynamo traces, before the first trace.

Hugging Face's BART family (BART, mBART, Marian, Pegasus, Blenderbot, PLBart, M2M100, LED, ...: 27
modeling files in transformers 5.17) ends every encoder layer with an fp16 overflow guard:

    if hidden_states.dtype == torch.float16 and not torch.isfinite(hidden_states).all():
        clamp_value = torch.finfo(hidden_states.dtype).max - 1000
        hidden_states = torch.clamp(hidden_states, min=-clamp_value, max=clamp_value)

Python control flow on a GPU value: Dynamo breaks the graph there, so in fp16 every encoder layer
is a graph of its own and generate() runs the encoder as written (runtime/encoder.py). DETR-style
models spell it `if torch.isinf(h).any() or torch.isnan(h).any():`.

At optimize() time each module class whose forward has such a guard gets that forward recompiled
from its own source with the guard rewritten (the Python part of the test stays an `if`):

    if hidden_states.dtype == torch.float16:
        _tf_pred = torch.logical_not(torch.isfinite(hidden_states).all())
        _tf_old_0 = hidden_states
        clamp_value = torch.finfo(hidden_states.dtype).max - 1000
        hidden_states = torch.clamp(hidden_states, min=-clamp_value, max=clamp_value)
        hidden_states = _tf_select(_tf_pred, hidden_states, _tf_old_0)

`select` is torch.where when both sides are tensors of one shape, dtype and device (the values are
then exactly the guard's), and `new if bool(pred) else old` otherwise (the guard as written). The
body now always runs, so only guards whose body is pure and cannot raise are rewritten: assignments
to plain names of arithmetic and a short list of elementwise torch functions and out-of-place tensor
methods (no indexing, no data-dependent shapes); a name the body binds and the forward may read
afterwards must certainly be bound before the guard. Anything else is left as written. The
rewritten forward is set on each instance (never on the class) and restore() removes it; the
function is checked to compile to the same bytecode as the original before the rewrite, so a source
file changed on disk since import is never used.
"""

from __future__ import annotations

import __future__
import ast
import copy
import functools
import inspect
import logging
import textwrap
import types

import torch

log = logging.getLogger("transfuse")
NAME = "BranchlessGuard"
_REDUCTIONS = ("any", "all")
# What a guard body may call, now that it always runs: elementwise work that cannot raise on any
# value and has no data-dependent shape (never nonzero, indexing, .item(), in-place methods).
_PURE_METHODS = frozenset({"clamp", "clip", "masked_fill", "nan_to_num", "to", "float", "half", "bfloat16",
                           "type_as", "where", "abs", "neg"})
_PURE_TORCH = frozenset({"clamp", "clip", "finfo", "iinfo", "where", "nan_to_num", "maximum", "minimum", "abs",
                         "neg", "zeros_like", "ones_like", "full_like"})
_PURE_NODES = (ast.Name, ast.Load, ast.Constant, ast.Attribute, ast.Call, ast.keyword, ast.BinOp, ast.UnaryOp,
               ast.operator, ast.unaryop)


def select(pred, new, old):
    """What `if pred: old = new` leaves in the name: a select on the GPU when the two are alike."""
    if (isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor) and isinstance(pred, torch.Tensor)
            and pred.dtype == torch.bool and pred.dim() == 0 and new.shape == old.shape
            and new.dtype == old.dtype and new.device == old.device == pred.device):
        return torch.where(pred, new, old)
    return new if bool(pred) else old


def _is_reduction(node: ast.AST) -> bool:
    """`<expr>.any()` / `<expr>.all()` or `torch.any(<expr>)` / `torch.all(<expr>)`."""
    if not isinstance(node, ast.Call) or node.keywords or not isinstance(node.func, ast.Attribute):
        return False
    if node.func.attr not in _REDUCTIONS:
        return False
    if isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
        return len(node.args) == 1
    return not node.args


def _has_reduction(node: ast.AST) -> bool:
    return any(_is_reduction(n) for n in ast.walk(node))


def _tensor_test(node: ast.AST) -> ast.AST | None:
    """The data-dependent part of a test as one bool tensor expression (not/and/or over reductions)."""
    if _is_reduction(node):
        return node
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = _tensor_test(node.operand)
        return None if inner is None else _torch_call("logical_not", inner)
    if isinstance(node, ast.BoolOp):
        parts = [_tensor_test(v) for v in node.values]
        if any(p is None for p in parts):
            return None
        name = "logical_and" if isinstance(node.op, ast.And) else "logical_or"
        out = parts[0]
        for p in parts[1:]:
            out = _torch_call(name, out, p)
        return out
    return None


def _torch_call(name: str, *args: ast.AST) -> ast.Call:
    return ast.Call(func=ast.Attribute(value=ast.Name("_tf_torch", ast.Load()), attr=name, ctx=ast.Load()),
                    args=list(args), keywords=[])


def _split_test(test: ast.AST) -> tuple[list[ast.AST], ast.AST] | None:
    """(Python terms, tensor test): the `and` chain's terms without a reduction must all come first,
    so that the ones that stay an `if` are evaluated as before."""
    terms = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    first = next((i for i, t in enumerate(terms) if _has_reduction(t)), None)
    if first is None:
        return None
    tensor_terms = terms[first:]
    parts = [_tensor_test(t) for t in tensor_terms]
    if any(p is None for p in parts):
        return None
    out = parts[0]
    for p in parts[1:]:
        out = _torch_call("logical_and", out, p)
    return list(terms[:first]), out


def _pure(stmt: ast.stmt) -> list[str] | None:
    """The names a pure guard-body statement binds, or None."""
    if not isinstance(stmt, ast.Assign) or not all(isinstance(t, ast.Name) for t in stmt.targets):
        return None
    for node in ast.walk(stmt.value):
        if not isinstance(node, _PURE_NODES):
            return None  # subscripts, comprehensions, walrus, lambdas, ...
        if isinstance(node, ast.Call):
            func = node.func
            if not isinstance(func, ast.Attribute):
                return None
            on_torch = isinstance(func.value, ast.Name) and func.value.id == "torch"
            if func.attr not in (_PURE_TORCH if on_torch else _PURE_METHODS):
                return None
    return [t.id for t in stmt.targets]


def _parameters(fn_def: ast.FunctionDef) -> set[str]:
    a = fn_def.args
    return {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x is not None}


def _reads(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in ast.walk(node))


def _stores(stmt: ast.stmt, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store) for n in ast.walk(stmt))


def _blocks(stmt: ast.stmt) -> list[list[ast.stmt]]:
    out = [getattr(stmt, f) for f in ("body", "orelse", "finalbody") if isinstance(getattr(stmt, f, None), list)]
    return out + [h.body for h in getattr(stmt, "handlers", ())]


def _reads_before_assigned(name: str, stmts: list[ast.stmt], skip: ast.stmt, assigned: bool = False) -> bool:
    """Whether some statement (outside `skip`) may read `name`'s value from before it: a read not
    preceded, in its own statement list or an enclosing one, by an unconditional assignment."""
    for stmt in stmts:
        if stmt is skip:
            continue
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if _reads(stmt, name):
                return True  # a closure may read it at any time
            continue
        blocks = _blocks(stmt)
        if blocks:
            heads = [getattr(stmt, f) for f in ("test", "iter") if getattr(stmt, f, None) is not None]
            heads += [i.context_expr for i in getattr(stmt, "items", ())]
            if not assigned and any(_reads(h, name) for h in heads):
                return True
            if any(_reads_before_assigned(name, b, skip, assigned) for b in blocks):
                return True
            continue  # an assignment inside a branch or a loop may not run
        target_read = isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name
        if not assigned and (_reads(stmt, name) or target_read):
            return True
        assigned = assigned or _stores(stmt, name)
    return False


def _assigned_at(name: str, stmts: list[ast.stmt], node: ast.stmt) -> bool:
    """Whether `name` is certainly bound when `node` (somewhere under stmts) runs: an unconditional
    assignment before it in its own statement list or in an enclosing one."""
    for stmt in stmts:
        if stmt is node or any(n is node for n in ast.walk(stmt)):
            return stmt is not node and any(_assigned_at(name, b, node) for b in _blocks(stmt)
                                            if any(n is node for s in b for n in ast.walk(s)))
        if not _blocks(stmt) and _stores(stmt, name):
            return True
    return False


def _rewrite_if(node: ast.If, fn_def: ast.FunctionDef, k: int) -> list[ast.stmt] | None:
    """The statements replacing guard `node` (its temporaries numbered k), or None to keep it."""
    if node.orelse:
        return None
    split = _split_test(node.test)
    if split is None:
        return None
    python_terms, tensor_test = split
    bound: list[str] = []
    for stmt in node.body:
        names = _pure(stmt)
        if names is None:
            return None
        bound += [n for n in names if n not in bound]
    # a name the body binds needs its old value back (a select) where the rest of the forward may
    # read it; that old value must then exist when the guard runs
    selected = [n for n in bound if _reads_before_assigned(n, fn_def.body, node)]
    params = _parameters(fn_def)
    if not selected or any(n not in params and not _assigned_at(n, fn_def.body, node) for n in selected):
        return None
    pred = f"_tf_pred_{k}"
    body: list[ast.stmt] = [ast.Assign(targets=[ast.Name(pred, ast.Store())], value=tensor_test)]
    body += [ast.Assign(targets=[ast.Name(f"_tf_old_{k}_{i}", ast.Store())], value=ast.Name(n, ast.Load()))
             for i, n in enumerate(selected)]
    body += node.body
    body += [ast.Assign(targets=[ast.Name(n, ast.Store())],
                        value=ast.Call(func=ast.Name("_tf_select", ast.Load()),
                                       args=[ast.Name(pred, ast.Load()), ast.Name(n, ast.Load()),
                                             ast.Name(f"_tf_old_{k}_{i}", ast.Load())], keywords=[]))
             for i, n in enumerate(selected)]
    for stmt in body:
        ast.fix_missing_locations(ast.copy_location(stmt, node))  # a later guard compares line numbers
    if not python_terms:
        return body
    test = python_terms[0] if len(python_terms) == 1 else ast.BoolOp(op=ast.And(), values=python_terms)
    return [ast.copy_location(ast.If(test=test, body=body, orelse=[]), node)]


class _Guards(ast.NodeTransformer):
    def __init__(self, fn_def: ast.FunctionDef):
        self.fn_def = fn_def
        self.count = 0  # guards rewritten so far

    def visit_FunctionDef(self, node):  # nested functions keep their own guards
        return self.generic_visit(node) if node is self.fn_def else node

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node):
        self.generic_visit(node)
        new = _rewrite_if(node, self.fn_def, self.count)
        if new is None:
            return node
        self.count += 1
        return new


def _compile(fn_def: ast.FunctionDef, fn, freevars: tuple[str, ...]):
    """The function `fn_def` defines, with fn's globals and closure values, line numbers and file."""
    outer = ast.FunctionDef(
        name="_tf_outer",
        args=ast.arguments(posonlyargs=[], args=[ast.arg(n) for n in ("_tf_torch", "_tf_select", *freevars)],
                           kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=[fn_def, ast.Return(ast.Name(fn_def.name, ast.Load()))], decorator_list=[], returns=None)
    if "type_params" in ast.FunctionDef._fields:  # Python 3.12+
        outer.type_params = []
    # CPython 3.11 calls a function of an imported module with LOAD_ATTR, not LOAD_METHOD, when the
    # module's own symbol table says the name came from an import: say so here too (never runs), so
    # that the recompiled forward is the original's bytecode where the source is the same.
    modules = sorted(n for n, v in fn.__globals__.items() if isinstance(v, types.ModuleType) and n.isidentifier())
    marker = ast.If(test=ast.Constant(False), body=[ast.Import(names=[ast.alias(name="sys", asname=n)])
                                                     for n in modules], orelse=[])
    module = ast.Module(body=([marker] if modules else []) + [outer], type_ignores=[])
    ast.fix_missing_locations(module)
    namespace: dict = {}
    # the original module's own `from __future__ import annotations`, not this file's
    flags = __future__.annotations.compiler_flag if fn.__globals__.get("annotations") is __future__.annotations else 0
    code = compile(module, fn.__code__.co_filename, "exec", flags=flags, dont_inherit=True)
    exec(code, fn.__globals__, namespace)  # noqa: S102
    cells = [c.cell_contents for c in fn.__closure__ or ()]
    return namespace["_tf_outer"](torch, select, *cells)


def rewrite_forward(fn) -> tuple[types.FunctionType, int] | None:
    """fn with its guards made branchless and how many, or None (no guard, or its source unusable)."""
    if not isinstance(fn, types.FunctionType) or hasattr(fn, "__wrapped__"):
        return None
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    if ".any()" not in source and ".all()" not in source and "torch.any(" not in source and "torch.all(" not in source:
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    fn_def = tree.body[0] if tree.body else None
    if not isinstance(fn_def, ast.FunctionDef) or fn_def.decorator_list or fn_def.name != fn.__name__:
        return None
    ast.increment_lineno(tree, fn.__code__.co_firstlineno - 1)
    freevars = fn.__code__.co_freevars
    try:
        same = _compile(copy.deepcopy(fn_def), fn, freevars)
    except Exception:  # noqa: BLE001 - a forward we cannot rebuild stays as it is
        return None
    if same.__code__.co_code != fn.__code__.co_code:
        return None  # the file on disk is not what was imported
    guards = _Guards(fn_def)
    try:
        fn_def = guards.visit(fn_def)
        if guards.count == 0:
            return None
        new = _compile(fn_def, fn, freevars)
    except Exception:  # noqa: BLE001 - a forward we cannot rewrite stays as it is
        return None
    new.__defaults__, new.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__
    functools.update_wrapper(new, fn)
    new.__wrapped__ = fn
    new._transfuse_branchless = True  # what Rewritten.undo() removes
    return new, guards.count


@functools.lru_cache(maxsize=None)
def _for_class(cls: type):
    forward = inspect.getattr_static(cls, "forward", None)
    return rewrite_forward(forward)


class Rewritten:
    """The instances whose forward was replaced, to undo and to report."""

    def __init__(self):
        self.modules: list[torch.nn.Module] = []
        self.guards: dict[str, int] = {}  # class name -> guards made branchless in its forward

    def undo(self) -> None:
        _drop_branchless(self.modules)
        self.modules = []

    def describe(self) -> str:
        if not self.guards:
            return ""
        classes = ", ".join(f"{name} ({n})" for name, n in sorted(self.guards.items()))
        return (f"{NAME}: {len(self.modules)} module forward(s) with a data-dependent guard made branchless "
                f"before tracing: {classes}")


def undo_on(model: torch.nn.Module) -> None:
    """Drops every branchless forward set on a module of `model` (a deep copy of an optimized model,
    whose Rewritten record is the original's)."""
    _drop_branchless(model.modules())


def _drop_branchless(modules) -> None:
    for m in modules:
        if getattr(m.__dict__.get("forward"), "_transfuse_branchless", False):
            del m.__dict__["forward"]


def install(model: torch.nn.Module) -> Rewritten:
    """Sets the branchless forward on every module of `model` whose class has one."""
    done = Rewritten()
    for module in model.modules():
        if "forward" in module.__dict__:
            continue  # somebody else's forward (a hook, an earlier optimize) stays in charge
        found = _for_class(type(module))
        if found is None:
            continue
        fn, count = found
        module.__dict__["forward"] = types.MethodType(fn, module)
        done.modules.append(module)
        done.guards[type(module).__name__] = count
    if done.modules:
        log.info("transfuse: %s", done.describe())
    return done
