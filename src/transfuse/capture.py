"""`optimize()` and `restore()`: the user-facing capture of a model with TorchDynamo."""

from __future__ import annotations

import collections
import copy
import itertools
import logging
import re
import traceback
import types
import weakref

import torch
import torch.utils._pytree as pytree

from transfuse import branchless as _branchless
from transfuse import trace_cache as _trace_cache
from transfuse import tracing_sdpa
from transfuse.backend import Backend, StaleGraph, TransfuseError, check_device
from transfuse.guards import ModuleWatch, module_guard_filter
from transfuse.report import format_report
from transfuse.runtime import encoder as _encoder
from transfuse.runtime import generation as _generation
from transfuse.runtime import output_hooks
from transfuse.runtime.buckets import BucketPolicy
from transfuse.runtime.call_lock import CallLock
from transfuse.runtime.warmup import run_warmup

log = logging.getLogger("transfuse")
try:
    import torch.fx.experimental._config as _SIZE_OBLIVIOUS

    if not hasattr(_SIZE_OBLIVIOUS, "backed_size_oblivious"):
        _SIZE_OBLIVIOUS = None
except ImportError:  # pragma: no cover - older torch
    _SIZE_OBLIVIOUS = None
_STATE = "_transfuse_state"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class _State:
    def __init__(self, backend: Backend, original_forward, compiled_forward, model: torch.nn.Module | None = None):
        self.backend = backend
        self.model = weakref.ref(model) if model is not None else (lambda: None)
        self.backends = [backend]
        self.original_forward = original_forward
        self.traced_forward = _own_code(original_forward)  # what Dynamo compiles (see _own_code)
        self.compiled = compiled_forward
        self.forward = None
        self.graph_breaks_at_start = _graph_breaks()
        self.eager_reason: str | None = None  # set when the model was handed back to eager (check_traces)
        # Calls that traced since the last deliberate re-compile: a call whose forward has graph
        # breaks makes several graphs, and counts once.
        self.tracing_calls = 0
        # generate()'s default static cache (runtime/generation.py), or why the model keeps HF's cache.
        self.static_cache = None
        self.static_cache_reason: str | None = None
        self.decode_loop = None  # generate()'s greedy/sampling loop (runtime/decode_loop.py)
        self.generation_config_memo = None  # generate()'s merged config kept (runtime/generation_config_memo.py)
        self.encoder_call = None  # an encoder-decoder's encoder, compiled for generate() (runtime/encoder.py)
        self.empty_calls = 0  # calls with an empty input tensor whose trace failed: they ran as written
        self.untraceable: collections.Counter = collections.Counter()  # Dynamo's trace error -> calls run as written
        self.guard_filter = None  # guards.module_guard_filter(model), set by optimize() before compile()
        self.branchless = None  # forwards whose data-dependent guards were made branchless (branchless.py)
        # the forward's and generate()'s calls, one at a time, each with the model's GPU current
        self.lock = CallLock(self.device_index)
        self.device_tensor = lambda: None  # weakref to the model's first parameter or buffer, set by compile()
        self.trace_settings = None  # tracing_sdpa.inside_forward with this model's Dynamo settings, set by compile()
        self.trace_cache = None  # trace_cache.TraceCache unless optimize(trace_cache=False) or TRANSFUSE_TRACE_CACHE=0

    def check_traces(self, original, max_traces: int) -> None:
        """Called after each call that traced: past max_traces such calls, the model runs as it was (see
        optimize()), with the reason on record."""
        self.tracing_calls += 1
        traces = self.tracing_calls
        if traces <= max_traces:
            return
        from torch._dynamo.utils import guard_failures

        code = getattr(original, "__code__", None)
        # One reason per cached trace checked ("0/2: <guard> ..."): the newest trace's is the guard
        # that keeps changing. Other models share the code object (Hugging Face's forward wrappers)
        # and so the list: only this model's traces count.
        ours = set().union(*(b.compile_ids for b in self.backends))
        firsts = [f.strip().splitlines()[0] for f in guard_failures.get(code, ()) if f.strip()]
        firsts = [ln for ln in firsts if re.match(r"\d+/\d+:", ln) and (not ours or ln.split(":")[0] in ours)]
        last = max(firsts, key=lambda ln: int(ln.split(":")[0].split("/")[1])) if firsts else "unknown"
        self.eager_reason = (f"traced {traces} times (more than max_traces={max_traces}; a call with graph breaks "
                             f"counts once); the last guard that "
                             f"failed: {last[:200]}; the model now runs as it was")
        log.warning("transfuse: %s", self.eager_reason)

    def device_index(self) -> int:
        """The CUDA device index of the model's tensors (-1: not on a GPU), for the call lock."""
        tensor = self.device_tensor()
        return tensor.get_device() if tensor is not None else -1

    def compile(self) -> None:
        self.tracing_calls = 0
        model = self.model()
        if model is not None:  # a model.to() moves the tensor in place; a replaced one recompiles
            first = next(itertools.chain(model.parameters(), model.buffers()), None)
            self.device_tensor = weakref.ref(first) if first is not None else (lambda: None)
            devices = _devices(model)
            if len(devices) > 1 and self.eager_reason is None:
                self.eager_reason = (f"its tensors are on {len(devices)} devices ({', '.join(devices)}): transfuse "
                                     "runs a model that is on one device (a CUDA graph, a kernel launch are one "
                                     "GPU's); it runs as it was")
                log.warning("transfuse: %s", self.eager_reason)
        if self.compiled is not None:
            if self.trace_cache is not None:
                self.trace_cache.drop("the model changed (a module, a parameter's dtype or device) and was traced again")
            self.backend = Backend(**self.backend.options)
            self.backend.pool = self.backends[-1].pool  # one memory pool per model
            self.backends.append(self.backend)
        dynamic = None if self.backend.options.get("dynamic", True) else False
        options = None if self.backend.options.get("module_guards") else {"guard_filter_fn": self.guard_filter}
        self.compiled = torch.compile(self.traced_forward, backend=self.backend, dynamic=dynamic, options=options)
        # Settings of every trace the forward makes, applied by tracing_sdpa's compile callbacks while
        # Dynamo traces (a call that does not trace pays nothing for them). Only the input dimensions
        # optimize() marks are dynamic: Dynamo's automatic dynamic would also make a head count
        # symbolic when a second model of the same class has another one.
        settings = [(torch._dynamo.config, {"automatic_dynamic_shapes": False})]
        if dynamic is None and _SIZE_OBLIVIOUS is not None:
            # A batch of 1 would otherwise get a trace of its own (Dynamo specialises sizes 0 and 1).
            settings.append((_SIZE_OBLIVIOUS, {"backed_size_oblivious": True}))
        self.trace_settings = tracing_sdpa.inside_forward(settings)


def _own_code(forward, f_globals: dict | None = None):
    """The forward with a code object of its own (an equal copy), bound to the same module; on
    `f_globals` instead of its module's globals when given (trace_cache.py's AOT compile).

    Dynamo keeps the graphs it compiled for a function on that function's code object, and caps
    their number per code object (accumulated_recompile_limit, 256). Hugging Face's forwards are
    wrapped by decorators whose one `wrapper` code object is every model's: the entries of each model
    optimized in a process stay on it (a model's death frees transfuse's graphs, not Dynamo's entries),
    and the 257th model was never compiled: it ran as written, silently (2026-11-29, 256 tiny BERTs
    optimized in a loop). A copy per model keeps each model's entries on its own code object, freed
    with it."""
    func = getattr(forward, "__func__", forward)
    if not isinstance(func, types.FunctionType):
        return forward
    twin = types.FunctionType(func.__code__.replace(), func.__globals__ if f_globals is None else f_globals,
                              func.__name__, func.__defaults__, func.__closure__)
    twin.__kwdefaults__ = func.__kwdefaults__
    twin.__dict__.update(func.__dict__)  # functools.wraps' __wrapped__, HF's markers
    twin.__qualname__, twin.__module__, twin.__doc__ = func.__qualname__, func.__module__, func.__doc__
    owner = getattr(forward, "__self__", None)
    return types.MethodType(twin, owner) if owner is not None and forward is not func else twin


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def _check_model(model: torch.nn.Module) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TransfuseError(f"transfuse.optimize expects a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        # Its forward is Dynamo's frame hook, not the model's: optimizing it would trace a trace.
        raise TransfuseError("transfuse.optimize: the model is already wrapped by torch.compile; pass the "
                             "model itself (model._orig_mod), or use torch.compile(model, backend=\"transfuse\")")
    check_device(list(model.parameters()) + list(model.buffers()))
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    unsupported = dtypes - set(SUPPORTED_DTYPES)
    if unsupported:
        raise TransfuseError(
            f"transfuse.optimize: parameters of dtype {sorted(map(str, unsupported))} are not supported; "
            "convert the model with model.half(), model.bfloat16() or model.float()"
        )


def _check_disable(disable) -> None:
    from transfuse.passes import recompute_activations
    from transfuse.passes.manager import backward_registry, registry

    if isinstance(disable, str):
        raise TransfuseError(f"transfuse.optimize: disable takes a list of pass names, got the string {disable!r}; "
                             f"write disable=({disable!r},)")
    known = {p.name for p in registry()} | {p.name for p in backward_registry()} | {recompute_activations.NAME,
                                                                                 _branchless.NAME}
    unknown = sorted(set(disable) - known)
    if unknown:
        raise TransfuseError(f"transfuse.optimize: no pass is named {', '.join(map(repr, unknown))}; "
                             f"the names are {', '.join(sorted(known))}")


def optimize(
    model: torch.nn.Module,
    *,
    cuda_graphs: bool = True,
    dynamic: bool = True,
    buckets: list[int] | bool | None = None,
    max_graphs: int = 32,
    warmup: list | None = None,
    disable: tuple[str, ...] = (),
    module_guards: bool = False,
    max_traces: int = 16,
    static_cache: bool = True,
    trace_cache: bool | None = None,
    **options,
) -> torch.nn.Module:
    """Optimize `model` in place and return it: its forward is captured by TorchDynamo on the first
    call and rewritten to transfuse kernels.

    cuda_graphs: replay the forward as CUDA graphs (GPU only).
    dynamic: trace batch and sequence dimensions symbolically (one trace for every shape); False
        traces each new shape anew.
    buckets: sizes that dynamic dimensions are padded up to, one CUDA graph per bucket; None means
        powers of two (capped at what the model allows, e.g. its position table); False disables
        padding (a graph per exact shape).
    max_graphs: how many bucket graphs are kept (least recently used ones are dropped).
    warmup: shapes to capture now, with a progress bar: (batch, seq) pairs for Hugging Face models,
        or dicts of keyword arguments / tuples of positional arguments for any model.
    disable: names of passes to skip (see transfuse.passes.manager.registry() and backward_registry():
        "backward_fp32_grads" keeps eager's 16-bit rounding of weight gradients under autocast).
    module_guards: keep Dynamo's guards on every submodule's state (slower calls; for models whose
        submodules get plain attributes assigned while optimized, see transfuse.guards).
    max_traces: with dynamic shapes a model needs a few traces: prompt and decode step, each for a
        batch of one and for larger ones (Dynamo keeps sizes of 1 static), an encoder-decoder's
        first prompt into a new cache, inputs made inside and outside inference mode. One traced
        more often than this changes something Dynamo specialises on at every call (a
        sliding-window cache's position counter): it then runs as it was, and the report says why.
    static_cache: generate() without a cache named by the user uses a static KV cache, reused across
        calls, so that each decode step replays one CUDA graph (runtime/generation.py).
    trace_cache: keep Dynamo's trace of the forward on disk, so that a later process with the same
        model, inputs and versions loads it instead of tracing (trace_cache.py); None reads
        TRANSFUSE_TRACE_CACHE (1 or 0, default 1).
    training_graphs (in **options): a training graph runs as AOTAutograd's forward and backward
        graphs, replayed as CUDA graphs (runtime/training_graphs.py). On by default on a GPU, off on
        the CPU (see backend._training_graphs). As under torch.compile(mode="reduce-overhead"), a
        step's outputs live in the graphs' memory pool until the next step starts: a tensor kept
        across steps (a list of unreduced losses) raises on access after the next step; .item() or
        .clone() it first, or pass training_graphs=False (eager autograd through the same kernels).
    """
    _check_model(model)
    if hasattr(model, _STATE):
        return model
    if max_traces < 1:
        raise TransfuseError(f"transfuse.optimize: max_traces must be at least 1, got {max_traces}")
    if max_graphs < 1:
        raise TransfuseError(f"transfuse.optimize: max_graphs must be at least 1, got {max_graphs}")
    if buckets not in (None, False):
        BucketPolicy(buckets)  # validates now, with a clear message
    _check_disable(disable)
    try:
        keep_traces = _trace_cache.requested(trace_cache)
    except _trace_cache.TraceCacheError as exc:
        raise TransfuseError(f"transfuse.optimize: {exc}") from None
    tracing_sdpa.enabled()  # a bad TRANSFUSE_TRACE_SDPA fails here, naming its values
    # Without dynamic shapes each new shape recompiles: raise Dynamo's limit so that a model seeing
    # many shapes never drops to eager silently.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name) and getattr(torch._dynamo.config, name) < 256:
            setattr(torch._dynamo.config, name, 256)
    backend = Backend(cuda_graphs=cuda_graphs, dynamic=dynamic, buckets=buckets, max_graphs=max_graphs,
                      disable=tuple(disable), module_guards=module_guards, **options)
    # before model.forward is read: the model's own forward may have a guard too
    rewritten = _branchless.install(model) if _branchless.NAME not in disable else _branchless.Rewritten()
    original = model.forward
    state = _State(backend, original, None, model)
    state.branchless = rewritten
    state.guard_filter = module_guard_filter(model)
    state.compile()
    if keep_traces and not module_guards:
        state.trace_cache = _trace_cache.TraceCache(model, state, extra=f"dynamic={dynamic}|sdpa={tracing_sdpa._mode()}")
    watch = None if module_guards else ModuleWatch(model)

    def forward(*args, **kwargs):
        if state.eager_reason is not None:
            return original(*args, **kwargs)
        # One call at a time: the graphs' buffers are the model's (runtime/call_lock.py); a trace that
        # starts inside sees math-only SDPA and this model's Dynamo settings (tracing_sdpa.py).
        with state.lock, state.trace_settings:
            return locked_forward(*args, **kwargs)

    def locked_forward(*args, **kwargs):
        if dynamic:
            _mark_dynamic(args, kwargs)
        if kwargs:
            output_hooks.install_before_call(model, kwargs)  # a module change the watch below sees
        if watch is not None and watch.changed():
            # A module of the model changed (guards.py): a fresh backend is a new Dynamo cache entry.
            state.compile()
            watch.snapshot()
            if state.eager_reason is not None:  # now split across devices
                return original(*args, **kwargs)
        traced = len(state.backend.records)
        backend, graph_calls = state.backend, state.backend.graph_calls
        try:
            if watch is not None:
                watch.in_call = True  # registrations the forward itself makes are Dynamo's to see
            try:
                if state.trace_cache is not None:
                    out = state.trace_cache(args, kwargs)
                    if out is not _trace_cache.TraceCache.MISS:
                        return out
                return state.compiled(*args, **kwargs)
            except StaleGraph:
                # model.half() / model.to(): a fresh backend is a new Dynamo cache entry for the new dtype.
                state.compile()
                if state.eager_reason is not None:  # moved onto several devices
                    return original(*args, **kwargs)
                return state.compiled(*args, **kwargs)
            except Exception as exc:
                if not module_guards and _guard_filter_failure(exc):
                    raise TransfuseError(
                        "Dynamo failed to build its guards through transfuse's guard filter (a PyTorch bug; "
                        "wav2vec2's SpecAugment in training meets it): call transfuse.optimize(model, "
                        "module_guards=True)") from exc
                # An empty input (a decoder prompt of length 0, a batch of 0) can fail Dynamo's trace
                # with a fake-tensor error that says nothing to the user: such a call runs as written,
                # which gives the model's own result or raises the model's own error; the report counts it.
                if _has_empty_tensor(args, kwargs):
                    state.empty_calls += 1
                    return original(*args, **kwargs)
                glue = _dynamo_glue_failure(exc)
                if glue is not None and state.backend is backend:
                    # Dynamo's own code around the graph (inputs in, side effects and outputs back) failed:
                    # every call of this frame would. The model runs as written from now on; this call
                    # too, unless the graph already ran (its writes are done: running it again could
                    # apply them twice), which the error says.
                    state.eager_reason = (f"Dynamo's code around the graph failed ({glue}; torch.compile fails "
                                          f"the same way, a PyTorch bug): runs as written")
                    log.warning("transfuse: %s", state.eager_reason)
                    if backend.graph_calls == graph_calls:
                        return original(*args, **kwargs)
                    raise TransfuseError(
                        f"transfuse: Dynamo's code around this model's graph failed after the graph ran ({glue}; "
                        "torch.compile fails the same way, a PyTorch bug); the call is not run again, its writes "
                        "may be partial; the model runs as written from the next call") from exc
                untraceable = _untraceable(exc)
                if untraceable is None or state.backend is not backend or backend.graph_calls != graph_calls:
                    raise
                # Dynamo could not trace the model's code for this call (the same error as
                # torch.compile's), and no compiled graph of it ran: nothing of it was written yet, so
                # the call runs as written, and the report and a warning say so.
                state.untraceable[untraceable] += 1
                if state.untraceable[untraceable] == 1:
                    log.warning("transfuse: a call ran as written: Dynamo cannot trace it: %s", untraceable)
                return original(*args, **kwargs)
        finally:
            if watch is not None:
                watch.in_call = False
                if len(state.backend.records) != traced:
                    watch.snapshot()  # a trace may set attributes (a config default) once
            if dynamic and len(state.backend.records) != traced:
                state.check_traces(original, max_traces)

    # Inside somebody else's torch.compile (Hugging Face compiles the forward itself for a static
    # cache), the outer trace must call this forward, not trace through it: it would swallow the
    # transfuse graph into its own.
    forward = torch._dynamo.disable(forward)
    forward.__wrapped__ = original
    model.forward = forward
    state.forward = forward
    setattr(model, _STATE, state)
    state.optimize_options = dict(cuda_graphs=cuda_graphs, dynamic=dynamic, buckets=buckets, max_graphs=max_graphs,
                                  disable=disable, module_guards=module_guards, max_traces=max_traces,
                                  static_cache=static_cache, trace_cache=trace_cache, **options)
    model.__dict__["__deepcopy__"] = _DeepCopy(model)
    model.__dict__["__reduce_ex__"] = _refuse_pickling
    # generate() would compile the forward again for a static cache: transfuse is the compiler here.
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(generation, "disable_compile") and state.eager_reason is None:
        state.disable_compile_was = generation.disable_compile
        generation.disable_compile = True
    if state.eager_reason is not None:
        state.static_cache_reason = "the model runs as it was (see 'left to eager')"
    elif static_cache:
        _generation.install(model, state)
    else:
        state.static_cache_reason = "optimize(static_cache=False)"
    if state.eager_reason is None:
        _encoder.install(model, state, dict(cuda_graphs=cuda_graphs, dynamic=dynamic, buckets=buckets,
                                            max_graphs=max_graphs, disable=disable, module_guards=module_guards,
                                            max_traces=max_traces, **options))
    # Dynamo never frees a backend; free what ours hold (CUDA graphs, merged weights) with the model.
    weakref.finalize(model, _release, state.backends)
    if warmup:
        run_warmup(model, warmup)
    return model


def _devices(model: torch.nn.Module) -> list[str]:
    """The devices the model's parameters are on, with every GPU its buffers are on: more than one is
    a model split across devices (device_map="auto", offloading). A buffer left on the CPU beside GPU
    parameters is a host tensor the graph moves (passes/host_tensors.py), not a second device."""
    devices = {str(p.device) for p in model.parameters()}
    devices |= {str(b.device) for b in model.buffers() if b.is_cuda}
    return sorted(devices)


def _mark_dynamic(args, kwargs) -> None:
    """Every dimension of every input tensor may vary; Dynamo keeps static what the model fixes
    (a hidden size that meets a weight) and makes the rest symbolic. Dimensions of size 1 stay
    static: they are how a mask broadcasts, and a symbol there would hide the broadcast."""
    leaves = [*args, *kwargs.values()]
    if not all(isinstance(v, torch.Tensor) or v is None for v in leaves):  # nested inputs, cache objects
        leaves = pytree.tree_leaves((args, kwargs))
    for t in leaves:
        for tensor, dims in _cache_tensors(t) if not isinstance(t, torch.Tensor) else ((t, None),):
            # (a plain tensor's type first: Parameter's isinstance is a Python metaclass check)
            if ((type(tensor) is not torch.Tensor and isinstance(tensor, torch.nn.Parameter))
                    or getattr(tensor, "_dynamo_weak_dynamic_indices", None)):
                continue  # already marked (a static cache's tensors come back every decode step)
            for d, size in enumerate(tensor.shape):
                if size > 1 and (dims is None or d in dims):
                    torch._dynamo.maybe_mark_dynamic(tensor, d)


def _cache_tensors(obj) -> list:
    """The key/value tensors of a Hugging Face cache object (`.layers[i].keys/.values`) with the
    dimensions that may vary. A dynamic cache grows every generated token: its batch and length
    (every dimension) are dynamic, or each token would cost a trace. A static cache keeps one shape
    for all the steps of a generate() call; its batch and length (dims 0 and 2) are dynamic so that
    another batch size or cache length is not another trace, its heads and head dim are not."""
    out = []
    for name in ("self_attention_cache", "cross_attention_cache"):  # an encoder-decoder's pair (T5, BART)
        inner = getattr(obj, name, None)
        if inner is not None and inner is not obj:
            out += _cache_tensors(inner)
    for layer in getattr(obj, "layers", None) or ():
        dims = (0, 2) if getattr(layer, "is_compileable", False) else None
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.dim() == 4:
                out.append((t, dims))
    return out


def restore(model: torch.nn.Module) -> torch.nn.Module:
    """Undo optimize(): the original forward, every parameter in its own storage again."""
    state = getattr(model, _STATE, None)
    if state is None:
        return model
    merged = set().union(*(m.storages() for b in state.backends for m in b.merged))
    for p in model.parameters():
        if p.untyped_storage().data_ptr() in merged:
            p.data = p.data.clone()
    if model.__dict__.get("forward") is state.forward:
        del model.__dict__["forward"]
    if isinstance(model.__dict__.get("__deepcopy__"), _DeepCopy):
        del model.__dict__["__deepcopy__"]
    if model.__dict__.get("__reduce_ex__") is _refuse_pickling:
        del model.__dict__["__reduce_ex__"]
    if hasattr(state, "disable_compile_was"):
        model.generation_config.disable_compile = state.disable_compile_was
    _generation.uninstall(model, state)
    _encoder.uninstall(model, state)
    state.branchless.undo()
    delattr(model, _STATE)
    _release(state.backends)
    return model


class _DeepCopy:
    """`copy.deepcopy(model)` of an optimized model: what optimize() set on the model is made of
    closures over the original (its forward, generate(), the encoder's call), which a deep copy would
    share, so the copy would run the original's weights (an EMA copy, say). Instead the model is
    copied without them and the copy optimized afresh with the same options. Held by the model
    through a weak reference (no cycle keeps a model and its graphs alive)."""

    def __init__(self, model: torch.nn.Module):
        self.model = weakref.ref(model)

    def __call__(self, memo: dict) -> torch.nn.Module:
        model = self.model()
        state = model.__dict__[_STATE]
        hook = model.__dict__.pop("__deepcopy__")
        refuse = model.__dict__.pop("__reduce_ex__", None)
        # transfuse's own objects are not copied: the copy gets None in their place, then loses them
        for owned in (state, state.static_cache, state.encoder_call):
            if owned is not None:
                memo[id(owned)] = None
        try:
            clone = copy.deepcopy(model, memo)
        finally:
            model.__dict__["__deepcopy__"] = hook
            if refuse is not None:
                model.__dict__["__reduce_ex__"] = refuse
        _strip_copy(clone, state)
        return optimize(clone, **state.optimize_options)


def _refuse_pickling(protocol: int):
    """pickle / torch.save(model) of an optimized model (copy.copy reduces the same way): its forward
    and generate() are transfuse's closures over this model, which no file or shallow copy can hold."""
    raise TransfuseError("transfuse: an optimized model cannot be pickled (nor copy.copy'd): save model.state_dict() "
                         "(or save_pretrained()), pickle transfuse.restore(model), or take copy.deepcopy(model)")


def _strip_copy(clone: torch.nn.Module, state: _State) -> None:
    """Undoes on a deep copy what optimize() set on the model it copies, as restore() undoes it on
    the model (parameters stay views of the copied merged weights: the same values)."""
    d = clone.__dict__
    d.pop(_STATE, None)
    if d.get("forward") is state.forward:
        del d["forward"]
    _generation.unpatch(clone, state)
    _encoder.unpatch(clone, state)
    if hasattr(state, "disable_compile_was"):
        clone.generation_config.disable_compile = state.disable_compile_was
    _branchless.undo_on(clone)


def _release(backends: list) -> None:
    for backend in backends:
        backend.release()


def _untraceable(exc: BaseException) -> str | None:
    """The first line of a Dynamo error raised while tracing the model's own code (its fake-tensor
    run of an op failed: code that only works eagerly), or None for any other error."""
    if not isinstance(exc, torch._dynamo.exc.TorchRuntimeError):
        return None
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    detail = next((line for line in lines if "got " in line and "Error" in line), lines[0] if lines else "")
    op = re.search(r"call_\w+ <?(built-in (?:method|function) \w+|function \w+|[\w.]+)", detail)
    cause = detail[detail.index("got ") + 4:] if "got " in detail else detail
    return ((f"{op.group(1)}: " if op else "") + cause)[:200]


def _dynamo_glue_failure(exc: BaseException) -> str | None:
    """The first line of an error raised by the bytecode Dynamo wrote for a frame, not by the model's
    code nor by a graph (both run in frames of their own): the innermost frame is a transformed code
    object. torch 2.11-2.13 meet one in a forward that binds a function to an object it was given
    (`cache.get_mask_sizes = fn.__get__(cache)`, RecurrentGemma): the side effect is written back as
    an attribute read of the function's name on the object, an AttributeError."""
    transformed = getattr(torch._dynamo.utils, "orig_code_map", None)
    tb = exc.__traceback__
    if transformed is None or tb is None or isinstance(exc, torch._dynamo.exc.TorchDynamoException):
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    if tb.tb_frame.f_code not in transformed:
        return None
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def _nested_tensor_encoders(model: torch.nn.Module) -> bool:
    """Whether the model holds an nn.TransformerEncoder that eager may run as nested tensors (the
    padded positions of its output zeros), which no traced graph does."""
    return any(isinstance(m, torch.nn.TransformerEncoder) and getattr(m, "use_nested_tensor", False)
               for m in model.modules())


def _guard_filter_failure(exc: BaseException) -> bool:
    """Whether Dynamo raised while building a frame's guards: with a guard_filter_fn (transfuse's,
    or any) torch 2.11-2.13 records a tensor guard's export info twice and compares two weakrefs to
    tensors, "Boolean value of Tensor ... is ambiguous" (wav2vec2 in training: SpecAugment's masks).
    Without the filter (optimize(module_guards=True)) the same frame compiles."""
    if not isinstance(exc, torch._dynamo.exc.InternalTorchDynamoError):
        return False
    frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
    return "build_guards" in frames or "set_export_info" in frames


def _has_empty_tensor(args, kwargs) -> bool:
    return any(isinstance(v, torch.Tensor) and v.numel() == 0 for v in (*args, *kwargs.values()))


def report(model: torch.nn.Module) -> str:
    """What transfuse rewrote in `model`, what it left alone and why."""
    state = getattr(model, _STATE, None)
    if state is None:
        return "transfuse: this model was not optimized (call transfuse.optimize(model))"
    records = [r for b in state.backends for r in b.records]
    runners = [r for b in state.backends for r in b.runners]
    if not records and state.eager_reason:
        text = "transfuse: nothing compiled"
    else:
        text = format_report(records, state.backend.pool, _graph_breaks() - state.graph_breaks_at_start, runners)
    if state.eager_reason:
        text += f"\n  left to eager: {state.eager_reason}"
    if state.trace_cache is not None:
        text += f"\n  {state.trace_cache.describe()}"
    if branchless := state.branchless.describe():
        text += f"\n  {branchless}"
    if state.static_cache is not None:
        text += f"\n  generate(): {state.static_cache.describe()}"
        if state.decode_loop is not None and state.decode_loop.describe():
            text += f"\n  generate(): {state.decode_loop.describe()}"
    elif state.static_cache_reason and hasattr(model, "generate"):
        text += f"\n  generate(): Hugging Face's default cache ({state.static_cache_reason})"
    for error, calls in state.untraceable.items():
        text += f"\n  left to eager: {calls} call(s) that Dynamo cannot trace, run as written: {error}"
    if state.empty_calls:
        text += (f"\n  left to eager: {state.empty_calls} call(s) with an empty input tensor, whose trace failed, "
                 "ran as written")
    encoder = _encoder.describe(state)
    if encoder:
        text += f"\n  generate(): {encoder}"
    if _nested_tensor_encoders(model):
        text += ("\n  nn.TransformerEncoder(enable_nested_tensor=True): PyTorch skips its nested-tensor fast path "
                 "under Dynamo (torch.compile too), so positions masked by src_key_padding_mask hold computed "
                 "values where eager returns zeros; the other positions are eager's")
    log.info(text)
    return text
