"""Test set-up shared by every test.

TRITON_INTERPRET must be set before any @triton.jit function is defined, so it is set here, at import
time, whenever no CUDA GPU is present: kernels then run on CPU tensors through Triton's interpreter.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _speed_up_interpreter():
    """Three pieces of work that Triton's interpreter (triton/runtime/interpreter.py, 3.x) does and
    throws away, skipped; what a kernel computes, and every check that can fire, is unchanged.

    Every kernel launch, and every call of one @triton.jit function from another, walks
    triton.language with inspect.getmembers() to find the builtins it swaps for its own: the walk
    always finds the same names, so they are remembered and exactly the ones the walk would swap
    (those that still hold the builtin) are swapped. A call from one @triton.jit function to another
    also swaps again (and never restores) what its launch already swapped for the same modules:
    inside a launch that covered them, that call is skipped.

    Every integer +, - and * also redoes itself in int64 and compares the result with the int32
    range for an overflow assert, and then drops that assert: the interpreter's options have
    debug=False, and device asserts only exist in debug mode (semantic.device_assert returns first).
    With debug off, sanitize_overflow=False skips that dead arithmetic: a third of the time of a
    kernel's integer-heavy index math. (With debug on, as under a future TRITON_DEBUG, it is kept.)

    Every conversion and load looks its numpy dtype up in a table that it builds anew each time:
    the answers for scalar types are remembered.

    A Triton whose private helpers look different is left alone.
    """
    try:
        import dataclasses
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_attr, is_builtin = getattr(interpreter, "_patch_attr", None), getattr(tl.core, "is_builtin", None)
    original = getattr(interpreter, "_patch_builtin", None)
    if patch_attr and is_builtin and original and \
            list(inspect.signature(original).parameters) == ["pkg", "builder", "scope"]:
        found: dict = {}

        def _patch_builtin(pkg, builder, scope):
            members = found.get(pkg)
            if members is None:
                members = found[pkg] = [(name, m) for name, m in inspect.getmembers(pkg) if is_builtin(m)]
            for name, member in members:
                if getattr(pkg, name, None) is member:
                    patch_attr(pkg, name, member, builder, scope)

        interpreter._patch_builtin = _patch_builtin
    patch_lang, grid_call = getattr(interpreter, "_patch_lang", None), getattr(interpreter.GridExecutor, "__call__", None)
    scope_cls = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang and grid_call and scope_cls and list(inspect.signature(patch_lang).parameters) == ["fn"]:
        covered: list = []  # per running launch: ids of the language modules its swaps cover
        langs_of: dict = {}  # jit function -> (size of its globals, ids of tl / tl.core among them)

        def _patch_lang(fn):
            size = len(fn.__globals__)
            known = langs_of.get(fn)
            if known is None or known[0] != size:
                known = langs_of[fn] = (size, frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core))
            if covered and covered[-1] and known[1] <= covered[-1]:
                return scope_cls()  # nothing to undo
            scope = patch_lang(fn)
            if covered:
                covered[-1].update(known[1])
            return scope

        def _launch(self, *args, **kwargs):
            covered.append(set())
            try:
                return grid_call(self, *args, **kwargs)
            finally:
                covered.pop()

        interpreter._patch_lang = _patch_lang
        interpreter.GridExecutor.__call__ = _launch
    get_np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if get_np_dtype is not None and list(inspect.signature(get_np_dtype).parameters) == ["tt_dtype"]:
        scalar_types: dict = {}
        pointer, block = tl.pointer_type, tl.block_type

        def _get_np_dtype(tt_dtype):
            # the same answer as Triton's, which builds a 19-entry dict on every call (~46,000 calls
            # in a T5 generate() test: 3% of its time): the scalar answers are remembered
            element = tt_dtype.element_ty if isinstance(tt_dtype, block) else tt_dtype
            if isinstance(element, pointer):
                return get_np_dtype(element)
            found = scalar_types.get(element)
            if found is None:
                found = scalar_types[element] = get_np_dtype(element)
            return found

        interpreter._get_np_dtype = _get_np_dtype
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and getattr(options, "debug", True) is False and \
            getattr(options, "sanitize_overflow", False) is True:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


# TRANSFUSE_TESTS_STOCK_INTERPRETER=1 runs Triton's interpreter as shipped (to compare timings or rule it out).
if os.environ.get("TRITON_INTERPRET") == "1" and not os.environ.get("TRANSFUSE_TESTS_STOCK_INTERPRETER"):
    _speed_up_interpreter()


def _speed_up_tracing():
    """The tests trace tiny models (two layers, hidden 32). Dynamo's fake-tensor dispatch cache pays
    for itself when one layer's ops repeat in many more layers (bert-base traces 1.2x faster with it),
    but at two layers building the entries costs more than the hits save: with the cache off the
    model tests trace 20-30% faster (2026-11-27, torch 2.13 on the CI CPU). The cache only memoises
    output metadata that fake dispatch would compute anyway; transfuse itself leaves the setting
    alone, and the GPU tests keep it (TRANSFUSE_TESTS_FAKE_TENSOR_CACHE=1 keeps it here too)."""
    import torch._dynamo.config

    torch._dynamo.config.fake_tensor_cache_enabled = False


def _skip_guard_latency_profile():
    """Every Dynamo compile, after it has checked its new guards once against the frame (that check,
    and its error, stay), times them for a log line and a compile metric: profile_guard_manager()
    first evicts the CPU caches by writing a large buffer, ~40 ms a compile on the CI CPU, 4% of a
    model test's compile time (cProfile, ProphetNet's 32 compiles, 2026-12-02). Nothing reads the
    number (transfuse does not, and the tests log nothing): it is 0 here. A torch whose guards module
    does not have it is left alone."""
    import torch._dynamo.guards as guards

    if callable(getattr(guards, "profile_guard_manager", None)):
        guards.profile_guard_manager = lambda root, scope, n_iters: 0.0


if not torch.cuda.is_available():
    _skip_guard_latency_profile()


if not os.environ.get("TRANSFUSE_TESTS_FAKE_TENSOR_CACHE") and not torch.cuda.is_available():
    _speed_up_tracing()



def _own_cache_directory():
    """transfuse keeps Dynamo's traces on disk by default (trace_cache.py): a CPU run of the suite
    gets a directory of its own, shared by its xdist workers and the subprocesses its tests start,
    so that what an earlier run saved in ~/.cache/transfuse (another checkout's trace of the same
    tiny model) is never what a test loads. Inside the run, a model that two tests build alike is
    traced once and loaded after, as for a user. The GPU runs keep the default directory: its GEMM
    tuning choices spare the next run minutes of timing."""
    import tempfile
    import uuid

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or uuid.uuid4().hex
    path = os.path.join(tempfile.gettempdir(), f"transfuse-tests-{run}")
    os.environ["TRANSFUSE_CACHE_DIR"] = path
    return path


_OWN_CACHE = (_own_cache_directory() if not os.environ.get("TRANSFUSE_CACHE_DIR") and not torch.cuda.is_available()
              else None)


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None and not hasattr(session.config, "workerinput"):  # the controller, after its workers
        import shutil
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run with the device tool: make test-gpu)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
