"""While Dynamo traces a transfuse forward: only torch's math SDPA is enabled, and the model's own
Dynamo settings apply (`inside_forward`'s settings: optimize()'s automatic_dynamic_shapes off and
backed_size_oblivious on, read by a trace alone, so a call that does not trace pays nothing for them).

Dynamo runs each `F.scaled_dot_product_attention` on fake tensors to learn its output's shape. On
CUDA that call first picks a kernel (cuDNN, flash, memory-efficient), and the tests it makes on
the sizes become guards on the symbolic sizes: bert-base traced again for its first batch of one,
on `input_ids.size()[0] != 1` (H200, torch 2.11, bench/recompile_probe.py), although transfuse
replaces the attention and never runs the kernel chosen. With only the math backend enabled the
choice makes no test. The user's flags are restored as soon as the
trace reaches transfuse's backend, so that the passes, and any SDPA transfuse leaves in the graph,
see the user's choice; nothing changes for other torch.compile users in the process (the switch
is made only inside a transfuse forward, on its own thread). Through `torch.compile(model,
backend="transfuse")` Dynamo traces before transfuse is called: there the choice runs as it is.

The test that guards is the mask's: `mask.size(0) == 1 || mask.size(0) == batch`
(check_attn_mask_shape, aten/src/ATen/native/transformers/sdp_utils_cpp.h), which evaluates the
symbolic batch against 1 first. Torch 2.13 rewrote it to compare symbolically and never guard
(its shipped header), so the switch is only needed before 2.13. It has a price: the math path
gives the trace more fake-tensor work (bert-base's Dynamo compile 2.4 -> 3.0 s on the development
CPU; get_fake_value +0.65-1.05 s on the H200, 2026-11-29) against a whole second trace (4-5 s there)
when the first batch of one comes. TRANSFUSE_TRACE_SDPA=auto (the default) switches on a machine
with CUDA under torch < 2.13; =math always; =as-is never.
"""

import os
import threading

import torch

ENV = "TRANSFUSE_TRACE_SDPA"
# torch before 2.13 guards on the batch in check_attn_mask_shape (see above)
CHOICE_GUARDS_BATCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)
_FLAGS = ("flash_sdp", "mem_efficient_sdp", "cudnn_sdp", "math_sdp")
_local = threading.local()


def enabled() -> bool:
    mode = os.environ.get(ENV, "auto")
    if mode not in ("auto", "math", "as-is"):
        raise ValueError(f"{ENV}={mode!r}: use auto (math with CUDA under torch < 2.13), math or as-is")
    return mode == "math" or (mode == "auto" and CHOICE_GUARDS_BATCH and torch.cuda.is_available())


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
    if getattr(_local, "saved", None) is None and enabled():
        _local.saved = _flags()
        _set({name: name == "math_sdp" for name in _local.saved})
    stack = getattr(_local, "settings", ())
    if stack and getattr(_local, "settings_saved", None) is None:
        saved = []
        for module, changes in stack[-1]:  # the innermost forward's
            for name, value in changes.items():
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, value)
        _local.settings_saved = saved


def _on_compile_end(*_args) -> None:
    """Dynamo's compile end (after transfuse's backend): the SDPA flags and the settings back."""
    restore()
    _restore_settings()


def _restore_settings() -> None:
    saved = getattr(_local, "settings_saved", None)
    if saved is not None:
        _local.settings_saved = None
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def restore(*_args) -> None:
    """The user's SDPA flags back (transfuse's backend calls it first; Dynamo's compile end does too)."""
    saved = getattr(_local, "saved", None)
    if saved is not None:
        _local.saved = None
        _set(saved)


def install() -> None:
    """Registers the callbacks, again after torch._dynamo.reset(), which clears them."""
    handler = torch._dynamo.callback.callback_handler
    if _on_compile_start not in handler.start_callbacks:
        handler.register_start_callback(_on_compile_start)
    if _on_compile_end not in handler.end_callbacks:
        handler.register_end_callback(_on_compile_end)
