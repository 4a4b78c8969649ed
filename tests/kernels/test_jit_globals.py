"""Every global a @triton.jit function reads must be something the GPU compiler accepts: a
tl.constexpr, another jit function, or a module. Triton's interpreter (our CPU tests) accepts a plain
Python number too, so a kernel that reads one passes every CPU test and fails to compile on a GPU.
This scans the code of every kernel module instead."""

import importlib
import pkgutil
import types

import triton

import transfuse.kernels

_PLAIN = (int, float, bool, str)


def _python_function(value):
    """The Python function behind a jit function (a JITFunction on a GPU, an InterpretedFunction
    under the interpreter, possibly wrapped by an Autotuner / Heuristics), else None."""
    seen = 0
    while not isinstance(value, types.FunctionType) and hasattr(value, "fn") and seen < 4:
        value, seen = value.fn, seen + 1
    return value if seen and isinstance(value, types.FunctionType) else None


def _jit_functions():
    for info in pkgutil.iter_modules(transfuse.kernels.__path__):
        module = importlib.import_module(f"transfuse.kernels.{info.name}")
        for name, value in vars(module).items():
            fn = _python_function(value)
            if fn is not None and fn.__module__ == module.__name__:
                yield f"{info.name}.{name}", fn


def _names(code: types.CodeType):
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def test_jit_functions_read_only_constexpr_globals():
    found = list(_jit_functions())
    assert len(found) > 20  # the scan sees the kernels
    bad = []
    for qualname, fn in found:
        for name in set(_names(fn.__code__)):
            value = fn.__globals__.get(name)
            if isinstance(value, _PLAIN) and not isinstance(value, triton.language.constexpr):
                bad.append(f"{qualname} reads the plain global {name} = {value!r}: make it tl.constexpr(...)")
    assert not bad, "\n".join(bad)
