"""While Dynamo traces a transfuse forward: SDPA that makes no kernel choice (a stand-in op, or only
torch's math SDPA), and the model's own Dynamo settings (`inside_forward`'s settings: optimize()'s
automatic_dynamic_shapes off and backed_size_oblivious on, read by a trace alone, so a call that does
not trace pays nothing for them).

Dynamo runs each `F.scaled_dot_product_attention` on fake tensors to learn its output's shape. On
CUDA that call first picks a kernel (cuDNN, flash, memory-efficient), and the tests it makes on
the sizes become guards on the symbolic sizes: bert-base traced again for its first batch of one,
on `input_ids.size()[0] != 1` (H200, torch 2.11, bench/recompile_probe.py), although transfuse
replaces the attention and never runs the kernel chosen. The test that guards is the mask's:
`mask.size(0) == 1 || mask.size(0) == batch` (check_attn_mask_shape,
aten/src/ATen/native/transformers/sdp_utils_cpp.h), which evaluates the symbolic batch against 1
first. Torch 2.13 rewrote it to compare symbolically and never guard (its shipped header).

In a trace without gradients `F.scaled_dot_product_attention` itself is `torch.ops.transfuse.traced_sdpa`
while the trace runs: an op of SDPA's schema whose fake implementation states the output's shape and
the size equalities SDPA's checks give (no kernel choice, so no guard, and no decomposition to run on
fake tensors), with SDPA's autocast rule; transfuse's backend turns each such node back into the
SDPA call it was (`untrace`) before anything reads the graph. bert-base's SDPA calls took 1.37 s of
fake-tensor work on the math path, 0.15 s as they are and 0.10 s this way (development CPU, torch
2.13, 2026-12-01, bench/trace_sdpa_cost.py); its warm first call on an H200 4.1-6.4 s against
5.3-8.2 s with math-only SDPA (alternating processes, bench/results/*-first-call-ab-session39.log).
The op is visible to every thread while a trace runs, so it computes what SDPA computes, autograd
included (it calls SDPA).

Elsewhere (traces with gradients, code that bound the function at import: `from
torch.nn.functional import scaled_dot_product_attention`) only the math backend is enabled on CUDA
under torch < 2.13, so the choice makes no test. Its price is more fake-tensor work (get_fake_value
+0.65-1.05 s on the H200, 2026-11-29) against a whole second trace (4-5 s there) when the first
batch of one comes. The user's flags and function are restored as soon as the trace reaches
transfuse's backend, so that the passes, and any SDPA transfuse leaves in the graph, see the user's
choice; nothing changes for other torch.compile users in the process (the switch is made only inside
a transfuse forward). Through `torch.compile(model, backend="transfuse")` Dynamo traces before
transfuse is called: there SDPA runs as it is.

The same traces give torch.matmul a fake-tensor rule that makes no batch guard either
(tracing_matmul.py: Llama-style rotary embeddings traced twice, at batch 1 and at larger batches).

TRANSFUSE_TRACE_SDPA=auto (the default): the stand-ins in traces without gradients, and math-only
SDPA on a machine with CUDA under torch < 2.13; =math: math-only SDPA in every trace and no
stand-in (the behaviour before the stand-in); =as-is: neither.
"""

import os
import threading

import torch
import torch.fx as fx
import torch.nn.functional as F

from transfuse import tracing_matmul

ENV = "TRANSFUSE_TRACE_SDPA"
# torch before 2.13 guards on the batch in check_attn_mask_shape (see above)
CHOICE_GUARDS_BATCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)
_FLAGS = ("flash_sdp", "mem_efficient_sdp", "cudnn_sdp", "math_sdp")
_local = threading.local()


def _mode() -> str:
    mode = os.environ.get(ENV, "auto")
    if mode not in ("auto", "math", "as-is"):
        raise ValueError(f"{ENV}={mode!r}: use auto (the stand-in without gradients, math with CUDA under "
                         "torch < 2.13), math or as-is")
    return mode


def enabled() -> bool:
    """Whether traces run with math-only SDPA (see the module docstring)."""
    mode = _mode()
    return mode == "math" or (mode == "auto" and CHOICE_GUARDS_BATCH and torch.cuda.is_available())


def stand_in_enabled() -> bool:
    """Whether a trace without gradients calls the stand-in op for F.scaled_dot_product_attention."""
    return _mode() == "auto"


# ----------------------------------------------------------------------------------------------------
# The stand-in: torch.ops.transfuse.traced_sdpa, SDPA's own schema under another name
# ----------------------------------------------------------------------------------------------------

_SDPA = F.scaled_dot_product_attention  # what Dynamo records for an SDPA call, and what untrace() puts back
_ATEN = torch.ops.aten.scaled_dot_product_attention.default
_LIB = torch.library.Library("transfuse", "FRAGMENT")
_LIB.define(str(_ATEN._schema).split("::", 1)[1].replace("scaled_dot_product_attention", "traced_sdpa", 1))


def _eager(*args, **kwargs):
    return _SDPA(*args, **kwargs)


def _fake(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False,
          **_later):
    """The output's shape, and the size facts SDPA's own checks give a trace: without them a cache's
    symbolic head count or a mask's symbolic length would stay apart from the query's (T5's
    cross-attention: "query and key head counts differ"). Each is an equality, as SDPA's math path
    states it under backed_size_oblivious (a size of 1 broadcasts only where it is a constant 1); the
    kernel choice's `mask.size(0) == 1` test is the one left out (see the module docstring)."""
    torch._check(key.size(-1) == query.size(-1), lambda: "SDPA: query and key head dims differ")
    torch._check(value.size(-2) == key.size(-2), lambda: "SDPA: key and value lengths differ")
    lead = query.dim() - 2
    for i in range(lead):  # batch and heads: equal, or one of them a constant 1 (Falcon's one KV head)
        if enable_gqa and i == lead - 1:  # heads: each KV head serves a group of query heads
            if not _broadcasts(query.size(i), key.size(i)):
                torch._check(query.size(i) % key.size(i) == 0, lambda: "SDPA: query heads not a multiple of key heads")
        else:
            _check_equal(query.size(i), key.size(i), "query and key")
        _check_equal(value.size(i), key.size(i), "key and value")
    if attn_mask is not None:
        scores = (*query.shape[:-1], key.shape[-2])
        for size, full in zip(reversed(attn_mask.shape), reversed(scores)):
            _check_equal(size, full, "the mask and the scores")
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


def _broadcasts(a, b) -> bool:
    return any(isinstance(n, int) and n == 1 for n in (a, b))


def _check_equal(a, b, what: str) -> None:
    if not _broadcasts(a, b):
        torch._check(a == b, lambda: f"SDPA: {what} differ in a dimension that does not broadcast")


def _autograd(*args, **kwargs):
    # Another thread that calls SDPA while a trace runs here gets SDPA's own autograd (its dropout
    # mask saved, not drawn again); without gradients, or on the trace's fake tensors under
    # no_grad, the call goes on below autograd to the fake or eager kernel.
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                       for a in (*args, *kwargs.values())):
        return _SDPA(*args, **kwargs)
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.transfuse.traced_sdpa.default(*args, **kwargs)


def _autocast_kernel(device_type: str, key):
    """SDPA's autocast rule (lower_precision_fp): under torch.autocast its floating tensors, the mask
    too, run in the autocast dtype, so the output has that dtype; the stand-in states the same (Llama's
    rotary leaves q and k in fp32 on an autocast model, and SDPA still gives bf16)."""
    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype(device_type)

        def cast(a):
            if (isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != torch.float64
                    and a.device.type == device_type):
                return a.to(dtype)
            return a

        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return torch.ops.transfuse.traced_sdpa.default(*map(cast, args), **{k: cast(v) for k, v in kwargs.items()})

    return kernel


_LIB.impl("traced_sdpa", _eager, "CompositeExplicitAutograd")
_LIB.impl("traced_sdpa", _autograd, "Autograd")
for _device_type, _key in (("cuda", "AutocastCUDA"), ("cpu", "AutocastCPU")):
    if hasattr(torch._C.DispatchKey, _key):
        _LIB.impl("traced_sdpa", _autocast_kernel(_device_type, getattr(torch._C.DispatchKey, _key)), _key)
torch.library.register_fake("transfuse::traced_sdpa", _fake, lib=_LIB)
_TRACED = torch.ops.transfuse.traced_sdpa
_DEFAULTS = {a.name: a.default_value for a in _ATEN._schema.arguments if a.has_default_value()}
_POSITIONAL = [a.name for a in _ATEN._schema.arguments if not a.kwarg_only]


def untrace(gm: fx.GraphModule) -> int:
    """Turns every stand-in node of gm, and of the subgraphs it holds (a higher-order op's), back
    into the F.scaled_dot_product_attention call it was (arguments as SDPA's signature names them,
    defaults left out); returns how many."""
    count = 0
    for graph_module in [m for m in gm.modules() if isinstance(m, fx.GraphModule)]:
        found = 0
        for node in graph_module.graph.nodes:
            if node.op != "call_function" or node.target not in (_TRACED, _TRACED.default):
                continue
            named = dict(zip(_POSITIONAL, node.args))
            named.update(node.kwargs)
            args = tuple(named.pop(name) for name in _POSITIONAL[:3])
            kwargs = {name: v for name, v in named.items()
                      if isinstance(v, fx.Node) or name not in _DEFAULTS or v != _DEFAULTS[name]}
            node.target, node.args, node.kwargs = _SDPA, args, kwargs
            found += 1
        if found:
            graph_module.recompile()
        count += found
    return count


class inside_forward:
    """Marks a transfuse forward on this thread: a Dynamo compile that starts inside traces with math
    SDPA and with `settings` applied, ((config module, {name: value}), ...): optimize()'s Dynamo
    settings (automatic_dynamic_shapes off, backed_size_oblivious on), which only a trace reads.
    They used to be torch's config.patch decorators around the compiled forward, entered and left
    on every call: 37 us of a bert-base call's host time on the development CPU (torch 2.13), for
    values that a call which does not trace never reads. One object per model, entered per call."""

    def __init__(self, settings=()):
        self.settings = tuple(settings)

    def __enter__(self):
        install()
        _local.depth = getattr(_local, "depth", 0) + 1
        if self.settings:
            _local.settings = (*getattr(_local, "settings", ()), self.settings)

    def __exit__(self, *exc):
        _local.depth -= 1
        if self.settings:
            _local.settings = _local.settings[:-1]
        restore()
        if _local.depth == 0:
            _restore_settings()  # a compile whose end callback did not run (never expected)


def _flags() -> dict[str, bool]:
    return {name: getattr(torch.backends.cuda, f"{name}_enabled")() for name in _FLAGS
            if hasattr(torch.backends.cuda, f"{name}_enabled")}


def _set(flags: dict[str, bool]) -> None:
    for name, on in flags.items():
        getattr(torch.backends.cuda, f"enable_{name}")(on)


def _on_compile_start(*_args) -> None:
    if getattr(_local, "depth", 0) == 0:
        return
    taken = _local.__dict__.setdefault("sdpa_taken", [])
    if not taken:
        if enabled():
            flags = _flags()
            taken.append(_take("flags", _flags, _set, {name: name == "math_sdp" for name in flags}))
        if not torch.is_grad_enabled() and stand_in_enabled():
            taken.append(_take("sdpa", _sdpa_function, _set_sdpa_function, _TRACED))
            if tracing_matmul.available():  # no batch guard from matmul's decomposition either
                taken.append(_take("matmul", tracing_matmul.current, tracing_matmul.install,
                                   tracing_matmul.guard_free))
    stack = getattr(_local, "settings", ())
    settings_taken = _local.__dict__.setdefault("settings_taken", [])
    if stack and not settings_taken:
        for module, changes in stack[-1]:  # the innermost forward's
            for name, value in changes.items():
                settings_taken.append(_take((id(module), name), lambda m=module, n=name: getattr(m, n),
                                            lambda v, m=module, n=name: setattr(m, n, v), value))


def _on_compile_end(*_args) -> None:
    """Dynamo's compile end (after transfuse's backend): the SDPA flags and the settings back."""
    restore()
    _restore_settings()


def trace_starts() -> None:
    """What Dynamo's compile start does (a trace that runs no compile callbacks: an AOT compile,
    trace_cache.py); a second call before trace_ends() changes nothing."""
    _on_compile_start()


def trace_ends() -> None:
    _on_compile_end()


def _restore_settings() -> None:
    _give_back_all(getattr(_local, "settings_taken", None))


def restore(*_args) -> None:
    """The user's SDPA flags and function back (transfuse's backend calls it first; Dynamo's compile
    end does too)."""
    _give_back_all(getattr(_local, "sdpa_taken", None))


# Process-wide state (torch's SDPA flags, F.scaled_dot_product_attention, Dynamo's config) that
# traces on several threads may change at once: the first to take a key saves the value there, the
# last to give it back puts that value back. Saving per thread, a second trace would save the first
# one's change as the user's and restore it for good.
_SHARED_LOCK = threading.Lock()
_SHARED: dict = {}  # key -> [holders, the value before the first, write]


def _take(key, read, write, value):
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is None:
            entry = _SHARED[key] = [0, read(), write]
        entry[0] += 1
        write(value)
    return key


def _give_back_all(taken: list | None) -> None:
    if not taken:
        return
    with _SHARED_LOCK:
        for key in reversed(taken):
            entry = _SHARED[key]
            entry[0] -= 1
            if entry[0] == 0:
                del _SHARED[key]
                entry[2](entry[1])
    taken.clear()


def _sdpa_function():
    return F.scaled_dot_product_attention


def _set_sdpa_function(function) -> None:
    F.scaled_dot_product_attention = function


def install() -> None:
    """Registers the callbacks, again after torch._dynamo.reset(), which clears them."""
    handler = torch._dynamo.callback.callback_handler
    if _on_compile_start not in handler.start_callbacks:
        handler.register_start_callback(_on_compile_start)
    if _on_compile_end not in handler.end_callbacks:
        handler.register_end_callback(_on_compile_end)
