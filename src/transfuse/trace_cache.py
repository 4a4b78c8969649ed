"""Dynamo's trace of a forward kept on disk: a later process with the same model, inputs and versions
loads the traced graph and its guards instead of tracing the model again.

On a GPU host a warm first call of bert-base spends 3.0-4.8 of its 4.1-6.4 s in Dynamo's trace (H200,
torch 2.11, bench/results/*-first-call-ab-session39.log); everything else it does is cached on disk
already (Triton's binaries, transfuse's tuning choices). Dynamo's ahead-of-time compile
(`torch.compile(fn, fullgraph=True).aot_compile(...)`, experimental; used here on torch 2.11-2.13) traces a frame
once and returns the transformed bytecode, the guards and the backend's result as one object that
can be saved and loaded (torch/_dynamo/aot_compile.py). transfuse saves the graph as Dynamo traced
it, before any pass (torch.fx's GraphPickler keeps its fake-tensor metadata and symbolic sizes); a
load hands that graph to a fresh transfuse Backend at the first call, with that call's real tensors
as the example inputs, exactly as Dynamo hands over a graph it has just traced.

What decides whether a saved trace applies is a key over everything that shapes a trace and that the
guards kept here do not check: the versions (Python, torch, transformers, transfuse's own source),
the model (each module's type, plain attributes, private ones included, functions kept on it, forward
hooks, and tensors' shapes and dtypes; the code and plain class attributes of its classes and the
code of the modules that define them; its config, with the private switches to_dict() leaves out,
such as the attention implementation), torch's global forward hooks, the call (each input's kind,
dtype, device type and which dimensions are 1) and the modes (grad, inference, autocast,
transfuse's SDPA choice). The module-state guards optimize() drops anyway (guards.py) are dropped
here too; the key covers what they checked. Dynamo's guards on globals (the functions, flags and
registries the forward reads in any module) check object identities, which do not survive a process:
they are saved as what each one checks by value (a function's code, a class's name, a flag's value,
a registry's keys) and checked once when the trace loads; a global that changed since (a
monkeypatched function, another attention function registered under the config's name) makes the
saved trace stale, and the forward is traced and saved again. Dynamo's remaining guards (input
dtypes, ranks, static sizes, size relations) are checked at every call: a call they refuse goes
through torch.compile as usual.

Used for inference calls whose forward traces as one graph, with tensors (or None and plain
constants) as inputs, of a model that nothing rewrote before the trace (branchless.py). A forward
that cannot be traced whole, or whose guards cannot be saved, is remembered as such on disk (the next
process does not try again) and runs through torch.compile; transfuse.report(model) says which.
On by default; optimize(model, trace_cache=False) or TRANSFUSE_TRACE_CACHE=0 turns it off. The
traces live in $TRANSFUSE_CACHE_DIR/traces (default ~/.cache/transfuse), at most MAX_BYTES of them:
the least recently saved or loaded go first.
"""

from __future__ import annotations

import builtins
import contextlib
import enum
import hashlib
import importlib
import json
import logging
import os
import re
import sys
import threading
import time
import types
import weakref
from pathlib import Path

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from transfuse.runtime.tuning_cache import cache_dir

log = logging.getLogger("transfuse")
ENV = "TRANSFUSE_TRACE_CACHE"
FORMAT = 2  # bumped when what is saved changes (2: the checks of the guards on globals)
_PRIMITIVES = (bool, int, float, str, type(None))
_loading = threading.local()  # the backend a trace being loaded hands its graph to


class TraceCacheError(ValueError):
    """A bad TRANSFUSE_TRACE_CACHE value."""


def requested(option: bool | None) -> bool:
    """optimize()'s trace_cache, else TRANSFUSE_TRACE_CACHE (0 or 1, default 1)."""
    if option is not None:
        return bool(option)
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise TraceCacheError(f"{ENV}={value!r}: use 1 (keep Dynamo's traces on disk) or 0")
    return value == "1"


def available() -> bool:
    """Whether this torch has Dynamo's ahead-of-time compile and the graph pickler it needs."""
    try:
        import torch._dynamo.aot_compile  # noqa: F401
        from torch._dynamo.aot_compile_types import SerializableCallable  # noqa: F401
        from torch.fx._graph_pickler import GraphPickler  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch.compiler, "load_compiled_function")


# ----------------------------------------------------------------------------------------------------
# The key
# ----------------------------------------------------------------------------------------------------

_SOURCE_HASH: str | None = None


def _transfuse_source_hash() -> str:
    """transfuse's own sources: a changed pass or stand-in op may change what a trace records."""
    global _SOURCE_HASH
    if _SOURCE_HASH is None:
        root = Path(__file__).parent
        digest = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
        _SOURCE_HASH = digest.hexdigest()
    return _SOURCE_HASH


def _code_bytes(code: types.CodeType) -> bytes:
    """A code object's bytecode, names and constants (nested code objects alike). Not marshal's
    bytes: marshal marks objects by their reference counts, which differ between two calls."""
    consts = b",".join(_code_bytes(c) if isinstance(c, types.CodeType) else repr(c).encode() for c in code.co_consts)
    return b"|".join([code.co_code, consts, repr((code.co_names, code.co_varnames, code.co_freevars,
                                                    code.co_cellvars, code.co_argcount, code.co_kwonlyargcount,
                                                    code.co_flags)).encode()])


def _code_digest(digest, obj, seen: set) -> None:
    """The code of every function of a class or module namespace, names in order."""
    namespace = vars(obj)
    home = obj.__name__ if isinstance(obj, types.ModuleType) else None
    for name in sorted(namespace):
        value = namespace[name]
        if home is not None and (name.startswith("__") or getattr(value, "__module__", None) != home):
            continue  # a module's own functions; not its imports, nor the globals Dynamo installs there
        func = getattr(value, "__func__", value)  # staticmethod / classmethod
        func = getattr(func, "fget", func)  # property
        while hasattr(func, "__wrapped__") and id(func) not in seen:  # decorators: the wrapped code too
            seen.add(id(func))
            if isinstance(func, types.FunctionType):
                digest.update(_code_bytes(func.__code__))
            func = func.__wrapped__
        if isinstance(func, types.FunctionType) and id(func) not in seen:
            seen.add(id(func))
            digest.update(name.encode())
            digest.update(_code_bytes(func.__code__))
        elif home is None and (text := _value_key(value)):  # a class attribute (`is_causal = False`)
            digest.update(f"{name}={text};".encode())


def _value_key(value) -> str:
    """A plain attribute's value in the key, or '' for what is not a plain value."""
    if isinstance(value, _PRIMITIVES):
        return repr(value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PRIMITIVES) for v in value):
        return repr(tuple(value))
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, types.FunctionType):  # a function kept on a module (an activation)
        return f"{value.__module__}.{value.__qualname__}:{hashlib.sha256(_code_bytes(value.__code__)).hexdigest()[:16]}"
    if isinstance(value, types.BuiltinFunctionType):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return ""


def _model_key(model: torch.nn.Module, digest) -> None:
    classes, modules_seen, seen = [], set(), set()
    for name, module in model.named_modules():
        cls = type(module)
        digest.update(f"|{name}:{cls.__module__}.{cls.__qualname__}".encode())
        for attr in sorted(module.__dict__):  # private ones too: `_attn_implementation`-like switches
            text = _value_key(module.__dict__[attr])
            if text:
                digest.update(f"{attr}={text};".encode())
        for hooks in ("_forward_pre_hooks", "_forward_hooks"):  # Dynamo traces a module's hooks into the graph
            for hook in getattr(module, hooks, {}).values():
                digest.update(f"{hooks}:{getattr(hook, '__module__', '')}.{getattr(hook, '__qualname__', type(hook).__qualname__)};".encode())
        for pname, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is not None:
                digest.update(f"{pname}:{tuple(tensor.shape)}:{tensor.dtype}:{tensor.device.type}:"
                              f"{tensor.requires_grad};".encode())
        if cls not in classes:
            classes.append(cls)
    for cls in classes:
        for klass in cls.__mro__:
            if klass in (torch.nn.Module, object) or id(klass) in seen:
                continue
            seen.add(id(klass))
            _code_digest(digest, klass, seen)
            module = sys.modules.get(klass.__module__)
            if module is not None and module.__name__ not in modules_seen and not module.__name__.startswith("torch."):
                modules_seen.add(module.__name__)
                _code_digest(digest, module, seen)  # the module-level helpers a forward calls
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        digest.update(json.dumps(config.to_dict(), sort_keys=True, default=str).encode())
    if config is not None:
        # to_dict() leaves out private switches that choose code paths (Hugging Face's
        # `_attn_implementation`: "eager" and "sdpa" trace different graphs)
        for attr in sorted(vars(config)):
            text = _value_key(vars(config)[attr])
            if text:
                digest.update(f"config.{attr}={text};".encode())


def _input_key(value) -> str | None:
    if isinstance(value, torch.Tensor):
        ones = "".join("1" if s == 1 else ("0" if s == 0 else "n") for s in value.shape)
        return (f"T{value.dtype}:{value.device.type}:{ones}:{value.requires_grad}:{value.is_inference()}:"
                f"{value.is_contiguous()}")
    if isinstance(value, _PRIMITIVES):
        return f"P{value!r}"
    return None


def key(model: torch.nn.Module, args: tuple, kwargs: dict, extra: str) -> tuple[str | None, str]:
    """(the key, '') for a call a saved trace may serve, or (None, why not)."""
    parts = []
    for i, value in enumerate(args):
        text = _input_key(value)
        if text is None:
            return None, f"positional input {i} is a {type(value).__name__}, not a tensor"
        parts.append(text)
    for name in sorted(kwargs):
        text = _input_key(kwargs[name])
        if text is None:
            return None, f"input {name!r} is a {type(kwargs[name]).__name__}, not a tensor"
        parts.append(f"{name}={text}")
    digest = hashlib.sha256()
    autocast = [torch.is_autocast_enabled(d) for d in ("cuda", "cpu")] if hasattr(torch, "is_autocast_enabled") else []
    try:
        import transformers
        hf_version = transformers.__version__
    except ImportError:
        hf_version = "-"
    digest.update("|".join([str(FORMAT), sys.version, torch.__version__, hf_version, _transfuse_source_hash(),
                            str(torch.is_grad_enabled()), str(torch.is_inference_mode_enabled()), str(autocast),
                            str(torch.get_default_dtype()), extra, *parts]).encode())
    from torch.nn.modules import module as nn_module
    for name in ("_global_forward_pre_hooks", "_global_forward_hooks"):  # torch.nn.modules.module's, every module's
        for hook in getattr(nn_module, name, {}).values():
            digest.update(f"{name}:{getattr(hook, '__qualname__', type(hook).__qualname__)};".encode())
    _model_key(model, digest)
    return digest.hexdigest()[:32], ""


# ----------------------------------------------------------------------------------------------------
# What is saved: the graph as Dynamo traced it
# ----------------------------------------------------------------------------------------------------

_INSTANCE_ATTRIBUTES = ("forward", "__deepcopy__", "__reduce_ex__")  # what optimize() sets on the model
_KEPT_META = ("example_value", "val", "tensor_dict", "transfuse_static")


def _savable_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the traced graph for the pickler: Dynamo's own attributes (its shape env, which the
    pickler cannot write) left behind, metadata the passes read kept. A fake value that is a view
    is saved as a tensor of its own sizes and strides: the pickler writes the view's base with its
    fake mode (torch 2.11-2.13), which it cannot pickle; the passes read sizes, never bases."""
    graph = fx.Graph()
    env: dict = {}
    for node in gm.graph.nodes:
        new = graph.node_copy(node, lambda n: env[n])
        new.meta = {k: v for k, v in node.meta.items() if k in _KEPT_META}
        for name in ("example_value", "val"):
            if name in new.meta:  # a tuple of views too (GPT-2's split of its fused QKV)
                new.meta[name] = pytree.tree_map(_own_storage, new.meta[name])
        env[node] = new
    return fx.GraphModule(gm, graph)


def _own_storage(value):
    if isinstance(value, torch.Tensor) and getattr(value, "fake_mode", None) is not None and value._is_view():
        with value.fake_mode:
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    return value


def _serializable_base():
    try:
        from torch._dynamo.aot_compile_types import SerializableCallable
    except ImportError:  # a torch without the AOT compile: available() says so, nothing is cached
        return object
    return SerializableCallable


class SavedGraph(_serializable_base()):
    """The backend's result as Dynamo's AOT compile keeps it: the graph as traced, and transfuse's
    compile of it (made at once while tracing, at the first call after a load)."""

    def __init__(self, graph: fx.GraphModule, backend, compiled=None):
        self.graph = graph
        self.backend = backend
        self.compiled = compiled

    def __call__(self, *args):
        if self.compiled is None:
            self.compiled = self.backend(self.graph, list(args))
            self.graph = None  # the backend's passes rewrote it: nothing to save from here
        return self.compiled(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: "SavedGraph") -> bytes:
        from torch.fx._graph_pickler import GraphPickler, Options
        with _slices_as_pytree():
            return GraphPickler.dumps(fn.graph, Options(ops_filter=None))

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "SavedGraph":
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        with _slices_as_pytree():
            gm = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
        gm.recompile()
        return cls(gm, _loading.backend)


@contextlib.contextmanager
def _slices_as_pytree():
    """Node arguments that are slices (`x[:, :n]` with a symbolic n) hold nodes: torch 2.11's graph
    pickler maps nodes with pytree, which does not enter a slice, and refuses the raw node it then
    meets (2.13 registers slices itself while it pickles). Registered here the same way, for the
    pickling alone."""
    import torch.utils._pytree as pytree
    if slice in pytree.SUPPORTED_NODES:
        yield
        return
    pytree._private_register_pytree_node(slice, lambda x: ([x.start, x.stop, x.step], None), lambda x, _: slice(*x))
    try:
        yield
    finally:
        pytree._deregister_pytree_node(slice)


def _tag_static(gm: fx.GraphModule, example_inputs, model: torch.nn.Module) -> None:
    """Marks the placeholders that hold the model's parameters and buffers (passes/graph.py's
    static_inputs reads Dynamo's grapharg for that, which the AOT compile drops before the backend)."""
    owned = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.Tensor) and id(value) in owned:
            node.meta["transfuse_static"] = True


def _serializable_guard(entry) -> bool:
    from torch._dynamo.guards import CheckFunctionManager
    unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return not (entry.is_global or entry.guard_type in unsupported
                or any(t in unsupported for t in (entry.derived_guard_types or ()))
                or "__closure__" in entry.name or entry.name.startswith("func"))


# ----------------------------------------------------------------------------------------------------
# The guards on globals, checked at load by value
# ----------------------------------------------------------------------------------------------------

class StaleGlobals(Exception):
    """A global the saved trace read is not what it was when the trace was saved."""


def _plain(value) -> str:
    """What a guard on a global checks of `value`, in words that mean the same in another process:
    a constant's value, a function's code, a class's or module's name (not object identities)."""
    if isinstance(value, _PRIMITIVES):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_plain(v) for v in value) + ")"
    if isinstance(value, enum.Enum):
        return f"{_qualname(type(value))}.{value.name}"
    if isinstance(value, types.FunctionType):
        return f"{_qualname(value)}:{hashlib.sha256(_code_bytes(value.__code__)).hexdigest()[:16]}"
    if isinstance(value, types.CodeType):  # a closure's guard is on its function's __code__
        return f"code {value.co_qualname}:{hashlib.sha256(_code_bytes(value)).hexdigest()[:16]}"
    if isinstance(value, (type, types.BuiltinFunctionType, types.BuiltinMethodType)):
        return _qualname(value)
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    return f"a {_qualname(type(value))}"


def _qualname(obj) -> str:
    return f"{getattr(obj, '__module__', None) or ''}.{getattr(obj, '__qualname__', None) or type(obj).__qualname__}"


def _describe(value, guard_type: str) -> str:
    """The part of `value` a Dynamo guard of `guard_type` checks, as _plain() words."""
    if guard_type == "SEQUENCE_LENGTH":
        return f"len {len(value)}"
    if guard_type in ("DICT_KEYS_MATCH", "DICT_KEYS", "DICT_CONTAINS", "DICT_NOT_CONTAINS"):
        return "keys " + _plain(list(value.keys()))
    if guard_type == "NOT_PRESENT_IN_GENERIC_DICT":
        return "attributes " + _plain(sorted(getattr(value, "__dict__", {})))
    if guard_type == "TYPE_MATCH":
        return "type " + _qualname(type(value))
    return _plain(value)


_GLOBAL_NAME = re.compile(r"G\['([^']+)'\]")  # the globals a guard's source reads


class _Globals(dict):
    """The namespace a guard's source (`G['__import_transformers_dot_masking_utils'].x`) is read
    in at load: the forward's globals, and the aliases Dynamo names modules and the builtins by."""

    def __missing__(self, name: str):
        if name.startswith("__import_"):
            return importlib.import_module(name[len("__import_"):].replace("_dot_", "."))
        if name.startswith("__builtins_dict__"):
            return vars(builtins)
        raise KeyError(name)


def _global_checks(entries) -> list:
    """[source, guard type, description] of every guard on a global in `entries`: Dynamo checks
    those by object identity, which does not survive a process, so the saved trace checks them by
    value when it loads (a monkeypatched function, a changed flag, another attention function
    registered under the name the config gives: the saved trace is stale and the forward is traced
    again). A guard whose value is not known cannot be checked: the trace is not saved."""
    checks = []
    for entry in entries:
        if not entry.is_global or entry.guard_type == "DUPLICATE_INPUT":  # aliasing of two globals: not a value
            continue
        if not entry.has_value:
            raise StaleGlobals(f"a guard on {_short(entry.name)} has no value to check at load")
        checks.append([entry.name, entry.guard_type, _describe(entry.value, entry.guard_type)])
    return checks


def _module_refs(external_refs, checks, globals_now: dict) -> dict:
    """Alias -> module name for the globals of the saved bytecode and guards that are modules: Dynamo
    names some by object id (`G['_140672765925616_c5'].Tensor`: torch), a name only the saving
    process has, so a load maps it to the module again."""
    names = list(external_refs)
    for check in checks if isinstance(checks, list) else ():
        names += _GLOBAL_NAME.findall(check[0])
    return {name: globals_now[name].__name__ for name in dict.fromkeys(names)
            if isinstance(globals_now.get(name), types.ModuleType)}


def _check_globals(checks: list, f_globals: dict) -> None:
    namespace = {"G": _Globals(f_globals), "__builtins__": builtins}
    for name, guard_type, description in checks:
        try:
            now = _describe(eval(name, namespace), guard_type)  # noqa: S307 - a guard source Dynamo wrote
        except Exception as exc:
            raise StaleGlobals(f"{_short(name)} cannot be read now ({_first_line(exc)})") from None
        if now != description:
            raise StaleGlobals(f"{_short(name)} is {now[:100]}, the saved trace saw {description[:100]}")


def _short(name: str) -> str:
    return name if len(name) <= 160 else f"{name[:60]}...{name[-90:]}"


# ----------------------------------------------------------------------------------------------------
# One model's cached trace
# ----------------------------------------------------------------------------------------------------

class TraceCache:
    """Tried at the first call of an optimized model (capture.py); serves the calls its guards
    accept, and leaves the others to torch.compile."""

    MISS = object()

    def __init__(self, model: torch.nn.Module, state, extra: str = ""):
        self._model = weakref.ref(model)  # the model holds its state, which holds this: no strong cycle
        self.state = state
        self.extra = extra  # optimize()'s options that shape a trace
        self.fn = None  # Dynamo's AOTCompiledFunction
        self.tried = False
        self.status = "not tried yet"  # for the report
        self.calls = 0
        self.misses = 0
        self.refusal = ""  # the guard that refused the first call refused
        self._guards = None  # the guard manager of fn
        self._free: dict = {}  # the traced function's closure variables, by name (locals the guards may read)
        self._varargs = None  # (self, args, kwargs) names when the forward is `f(self, *args, **kwargs)`
        self._checks: list | str = []  # the guards on globals of the trace being saved (or why they cannot be)

    @property
    def model(self) -> torch.nn.Module:
        return self._model()

    def drop(self, why: str) -> None:
        """A re-compile (a changed module, a moved parameter): the saved trace's backend is gone."""
        if self.fn is not None:
            self.fn = None
            self.status += f"; dropped: {why}"

    def describe(self) -> str:
        text = f"trace cache: {self.status}"
        if self.calls or self.misses:
            text += f"; {self.calls} call(s) served, {self.misses} refused by its guards (traced as usual)"
        if self.refusal:
            text += f"; the first refusal: {self.refusal}"
        return text

    def __call__(self, args: tuple, kwargs: dict):
        if self.fn is None:
            if self.tried:
                return self.MISS
            self.tried = True
            self._first(args, kwargs)
            if self.fn is None:
                return self.MISS
        model = self.model
        if not self._guards.check(self._locals(model, args, kwargs)):
            if not self.misses:  # the first refusal's reason, for the report (check_verbose is slow)
                failed = self._guards.check_verbose(self._locals(model, args, kwargs))
                self.refusal = " / ".join(failed.verbose_code_parts)[:300]
            self.misses += 1
            return self.MISS
        self.calls += 1
        return self.fn.fn(model, *args, **kwargs)

    def _locals(self, model, args, kwargs) -> dict:
        """The frame's locals the guards read: AOTCompiledFunction.prepare_f_locals without its
        inspect.Signature.bind (14 us a call on the development CPU) for Hugging Face's
        `wrapper(self, *args, **kwargs)` forwards."""
        if self._varargs is None:
            return self.fn.prepare_f_locals(model, *args, **kwargs)
        names = self._varargs
        return {**self._free, names[0]: model, names[1]: args, names[2]: kwargs}

    def _ready(self, fn) -> None:
        import inspect

        self.fn = fn
        self._guards = fn._artifacts.guard_manager
        env = fn._artifacts.runtime_env
        self._free = ({name: cell.cell_contents for name, cell in zip(env.bytecode.co_freevars, env.closure)}
                      if env.closure else {})
        kinds = [(p.name, p.kind) for p in fn._artifacts.signature.parameters.values()]
        plain = [inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.VAR_POSITIONAL,
                 inspect.Parameter.VAR_KEYWORD]
        self._varargs = tuple(n for n, _ in kinds) if [k for _, k in kinds] == plain else None

    def _first(self, args, kwargs) -> None:
        model = self.model
        if not available():
            self.status = f"not used: torch {torch.__version__} has no ahead-of-time Dynamo compile"
            return
        if model.training or (torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())):
            self.status = "not used: a training call (gradients on); only inference traces are kept"
            return
        if self.state.branchless is not None and self.state.branchless.modules:
            self.status = "not used: transfuse rewrote a forward of the model before the trace (branchless.py)"
            return
        if "_transfuse_class_of" in type(model).__dict__:
            # generate()'s subclass (runtime/generation.py), made in this process: the saved guards
            # could not name it, and an attempt would cost a whole trace of a decoder
            self.status = "not used: a model with generate() (transfuse's subclass of its class is not savable)"
            return
        digest, why = key(model, args, kwargs, self.extra)
        if digest is None:
            self.status = f"not used: {why}"
            return
        path = cache_dir() / "traces" / f"{digest}.trace"
        refused = path.with_suffix(".refused")
        start = time.perf_counter()
        stale = ""
        if path.exists():
            try:
                self._ready(self._load(path, args, kwargs))
                self.status = f"loaded {path.name} in {time.perf_counter() - start:.2f} s"
                return
            except StaleGlobals as exc:  # traced again below, and the file replaced
                stale = f" (the saved one was stale: {exc})"
            except Exception as exc:  # a file from an interrupted writer, a torch that reads it otherwise
                self.status = f"not used: the saved trace did not load ({_first_line(exc)}); traced as usual"
                return
        elif refused.exists():
            self.status = f"not used: {refused.read_text().strip()} (remembered in {refused.name})"
            return
        backend = self.state.backend
        marks = [len(getattr(backend, name)) for name in _BACKEND_LISTS]
        try:
            fn = self._trace(args, kwargs)
        except torch._dynamo.exc.RestartAnalysis:
            raise
        except Exception as exc:
            _forget_compiles(backend, marks)  # the attempt is not one of the model's traces: the report counts those
            reason = f"the forward did not trace as one savable graph ({_first_line(exc)})"
            self.status = f"not used: {reason}"
            _write(refused, reason.encode())
            return
        self._ready(fn)
        took = time.perf_counter() - start
        try:
            self._save(fn, path)
            self.status = f"traced in {took:.2f} s and saved as {path.name}{stale}"
        except Exception as exc:
            self.status = f"traced in {took:.2f} s; not saved ({_first_line(exc)})"
            _write(refused, f"its trace could not be saved ({_first_line(exc)})".encode())
        log.info("transfuse: trace cache: %s", self.status)

    def _trace(self, args, kwargs):
        from transfuse import tracing_sdpa

        state, model = self.state, self.model
        module_filter = state.guard_filter

        def guard_filter(entries):
            keep = module_filter(entries) if module_filter is not None else [True] * len(entries)
            try:
                self._checks = _global_checks(entries)
            except StaleGlobals as exc:
                self._checks = str(exc)
            return [k and _serializable_guard(e) for k, e in zip(keep, entries)]

        # Dynamo keeps every backend alive for the whole process: this one holds the model weakly
        # and transfuse's Backend (whose graphs release() frees with the model), not the state
        owner, compiler = weakref.ref(model), state.backend

        def backend(gm, example_inputs):
            _tag_static(gm, example_inputs, owner())
            saved = _savable_copy(gm)
            return SavedGraph(saved, compiler, compiler(gm, example_inputs))

        dynamic = None if state.backend.options.get("dynamic", True) else False
        # torch 2.11 attaches .aot_compile only with this set (2.13's default)
        with torch._dynamo.config.patch(enable_aot_compile=True):
            compiled = torch.compile(_with_builtins(state.traced_forward), fullgraph=True, backend=backend,
                                     dynamic=dynamic, options={"guard_filter_fn": guard_filter})
        # The saved guards pickle the model object (its __dict__, tensors left out): optimize()'s
        # per-instance attributes (the forward wrapper, the refusal to pickle) stay out of it.
        ours = {name: model.__dict__.pop(name) for name in _INSTANCE_ATTRIBUTES if name in model.__dict__}
        tracing_sdpa.trace_starts()  # Dynamo's compile callbacks do not run for an AOT compile
        try:
            return compiled.aot_compile((args, kwargs))
        finally:
            tracing_sdpa.trace_ends()
            model.__dict__.update(ours)

    def _globals(self, refs: dict) -> dict:
        func = getattr(self.state.traced_forward, "__func__", self.state.traced_forward)
        f_globals = {**vars(builtins), **func.__globals__}
        for name, module in refs.items():  # Dynamo's aliases of modules, named by object ids of the saving process
            f_globals[name] = importlib.import_module(module)
        return f_globals

    def _closure(self) -> dict:
        func = getattr(self.state.traced_forward, "__func__", self.state.traced_forward)
        return {f"cell{i}": cell.cell_contents for i, cell in enumerate(func.__closure__ or ())}

    def _save(self, fn, path: Path) -> None:
        from torch._dynamo.aot_compile import AOTCompiledFunction

        env = fn._artifacts.runtime_env
        globals_now = fn.fn.__globals__
        refs = _module_refs(getattr(env, "external_refs", ()), self._checks, globals_now)
        if isinstance(self._checks, str):
            raise ValueError(self._checks)
        _check_globals(self._checks, self._globals(refs))  # what a load will check must hold here and now
        data = AOTCompiledFunction.serialize(fn, self._closure()).serialized_data
        header = json.dumps({"refs": refs, "globals": self._checks}).encode()
        _write(path, len(header).to_bytes(4, "little") + header + data)
        _evict(path.parent)

    def _load(self, path: Path, args: tuple, kwargs: dict):
        """AOTCompiledFunction.deserialize (torch 2.11-2.13), but for the guards: they are built with
        the model itself as the frame's `self`. The saved guards hold the model with only what the
        kept guards read (optimize() drops the module guards), while the size guards reach
        parameters and buffers through the modules: built on that copy they fail."""
        import dataclasses
        import io

        from torch._dynamo.aot_compile import AOTCompiledFunction, AOTCompileUnpickler, CompileArtifacts
        from torch._dynamo.package import SerializedCode, load_guard_manager, load_guards_state

        blob = path.read_bytes()
        with contextlib.suppress(OSError):  # the least recently loaded go first when the directory is full
            os.utime(path)
        size = int.from_bytes(blob[:4], "little")
        header = json.loads(blob[4:4 + size])
        f_globals = self._globals(header["refs"])
        _check_globals(header["globals"], f_globals)
        state = AOTCompileUnpickler(self._closure(), io.BytesIO(blob[4 + size:])).load()
        state["runtime_env"] = dataclasses.replace(
            state["runtime_env"], bytecode=SerializedCode.to_code_object(state["runtime_env"].bytecode))
        deserializer, compiled_state = state["compiled_fn"]
        _loading.backend = self.state.backend
        try:
            state["compiled_fn"] = deserializer(compiled_state)
        finally:
            _loading.backend = None
        state["original_code"] = SerializedCode.to_code_object(state["original_code"])
        guards = load_guards_state(state["guards_state"])
        scope = dict(guards.output_graph.local_scope)
        scope["self"] = self.model
        # Dynamo's marks of dynamic dimensions are tensor attributes, which the saved guards' copies
        # of the inputs lost: a guard checks that a tensor marked now was marked when traced.
        call_locals = state["signature"].bind(self.model, *args, **kwargs).arguments
        for name, value in call_locals.items():
            if name in scope:
                _copy_marks(value, scope[name])
        guards = dataclasses.replace(guards, output_graph=dataclasses.replace(guards.output_graph, local_scope=scope))
        runtime = state["runtime_env"].forward_callable(state["backend_id"], state["compiled_fn"], extra_globals=f_globals)
        state["guard_manager"] = load_guard_manager(guards, state["original_code"], runtime.__globals__)
        return AOTCompiledFunction(CompileArtifacts(**state), _extra_globals=f_globals)


def _with_builtins(forward):
    """The forward on a copy of its globals that also names the builtins: torch 2.11's AOT compile
    requires every global its bytecode loads, `type` too, to be in the function's globals (2.13
    looks in the builtins as well). A copy: the module's own globals stay as they are."""
    from transfuse.capture import _own_code  # capture imports this module

    func = getattr(forward, "__func__", forward)
    return _own_code(forward, {**vars(builtins), **func.__globals__})


def _copy_marks(value, saved) -> None:
    """Dynamo's dimension marks from the tensors of `value` onto those at the same place in `saved`."""
    if isinstance(value, torch.Tensor) and isinstance(saved, torch.Tensor):
        for attr, mark in vars(value).items():
            if attr.startswith("_dynamo_"):
                setattr(saved, attr, mark)
    elif isinstance(value, dict) and isinstance(saved, dict):
        for k in value.keys() & saved.keys():
            _copy_marks(value[k], saved[k])
    elif isinstance(value, (tuple, list)) and isinstance(saved, (tuple, list)) and len(value) == len(saved):
        for v, sv in zip(value, saved):
            _copy_marks(v, sv)


_BACKEND_LISTS = ("records", "graphs", "runners", "merged")


def _forget_compiles(backend, marks: list[int]) -> None:
    """Drops what a failed AOT attempt compiled in `backend` (its graph traced whole, and then its
    guards or bytecode could not be saved): its record, graph, runner and merged weights, and the
    slot that holds its CUDA graphs. Nothing calls that compile."""
    slots = backend._slots
    for i in range(marks[1], len(backend.graphs)):
        if i < len(slots):
            slots[i] = None
    for name, mark in zip(_BACKEND_LISTS, marks):
        del getattr(backend, name)[mark:]


MAX_BYTES = 1 << 30  # the traces kept, in all; the least recently saved or loaded are deleted past it


def _evict(folder: Path, limit: int | None = None) -> None:
    """Deletes the least recently used traces past `limit` bytes (on by default, the cache must not
    grow without end: one trace of bert-base is a few MB). A trace deleted is traced and saved again
    by the next process that needs it; a refusal file is a few bytes and stays."""
    limit = MAX_BYTES if limit is None else limit
    try:
        files = [(f.stat().st_mtime, f.stat().st_size, f) for f in folder.glob("*.trace")]
    except OSError:  # another process deleted one meanwhile: the next save looks again
        return
    total = sum(size for _, size, _ in files)
    for _, size, f in sorted(files, key=lambda t: t[0]):
        if total <= limit:
            break
        with contextlib.suppress(OSError):
            f.unlink()
        total -= size


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _write(path: Path, data: bytes) -> None:
    """Atomic replace; a read-only cache directory costs a trace in the next process, nothing else."""
    import tempfile
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass
