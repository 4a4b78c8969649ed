"""What transfuse checks itself so that Dynamo need not guard every module on every call.

Dynamo guards the attributes, hooks, types and parameters of every submodule it traced through:
about 3,000 checks for bert-base, 0.15-0.35 ms per call on the GPU machines' hosts (measured
2026-11-22), more than the whole CUDA-graph replay at batch 1. `optimize()` drops those guards
(`module_guard_filter`; a frame after a graph break whose `self` is one of several layers keeps
them, since another layer may run it) and keeps the rest (input shapes and dtypes,
globals, grad mode); in their place:

* `ModuleWatch` (here, per call, a few microseconds): a parameter, buffer or submodule registered on
  any module of the model (an assignment `module.weight = ...`, `register_buffer`, a swapped layer),
  a changed `training` flag, an added or removed forward hook, or a changed Hugging Face config
  attribute marks the model changed, and `optimize()` traces it afresh.
* the backend (backend.py, per call, one C call): the addresses of the parameters it was compiled
  with; a moved parameter is re-checked for dtype, device and shape (`StaleGraph`: traced afresh), and
  CUDA graphs re-capture when only the storage moved.

Not seen: a plain Python attribute of a submodule assigned after `optimize()` (say
`layer.attention.scaling = 0.1`). `optimize(model, module_guards=True)` keeps Dynamo's guards for
models that are changed that way while optimized.
"""

from __future__ import annotations

import collections
import weakref
from operator import attrgetter, itemgetter

import torch
import torch.nn.modules.module as _module

_training = attrgetter("training")
_training_item = itemgetter("training")
_forward_hooks = attrgetter("_forward_hooks")
_forward_pre_hooks = attrgetter("_forward_pre_hooks")


def module_guard_filter(model: torch.nn.Module):
    """Dynamo guard filter for `optimize(model)`: drops the guards on module state in the frames
    that only one module runs, where ModuleWatch and the backend check that state instead.

    A graph break inside a submodule (ProphetNet's position check, BART's fp16 guard) makes that
    submodule's forward a frame of its own, and Dynamo reuses a frame's trace for every object its
    guards accept: the same trace serves every layer. A layer's plain Python attributes are what
    tell it from the others: a trace of layers[0] baked in `self.layer_idx == 0`, and without that
    guard layers[1] ran it and wrote its keys into layer 0's cache (ProphetNet's generate(): layer
    0's cache grew twice per step, layer 1's never). So a frame whose module has siblings of its
    class in the model (or is no module of the model, or is not known) keeps the guards as Dynamo
    wrote them, but for the hook dicts, which ModuleWatch checks on every module: layers that agree
    on them share one trace (runtime/instances.py gives each its own weights), layers that differ
    get a trace each. The model's own frames, and those of a module that is the only one of its
    class (an encoder, a decoder), drop them as before, all but the one on the module's type."""
    watched = weakref.ref(model)

    def keep(entries) -> list[bool]:
        model = watched()
        modules = list(model.modules()) if model is not None else []
        ids = {id(m) for m in modules}
        classes = collections.Counter(map(type, modules))

        def alone(root) -> bool:  # the only object that can be `root` in a later call of the frame
            return root is model or (isinstance(root, torch.nn.Module) and id(root) in ids and classes[type(root)] == 1)

        # The object at each guard's root (the frame's `self`, or another local or global) comes
        # with the guard on the root itself (Dynamo's TYPE_MATCH on `self`, whose source wraps the
        # local's and has its name).
        values = {}
        for entry in entries:
            if entry.has_value:
                values.setdefault(_name(entry.orig_guard.originating_source), entry.value)
        result = []
        for entry in entries:
            if not entry.orig_guard.source.is_unspecialized_nn_module():
                result.append(True)
                continue
            source = entry.orig_guard.originating_source
            root_name = _name(_root(source))
            root = values.get(root_name, _UNKNOWN)
            if root is _UNKNOWN or not alone(root):
                result.append(entry.guard_type != "EMPTY_NN_MODULE_HOOKS_DICT")
            else:  # but its type: a method two classes inherit is one frame for both
                result.append(entry.guard_type == "TYPE_MATCH" and _name(source) == root_name)
        return result

    return keep


_UNKNOWN = object()


def _root(source):
    """The local or global a guard's source starts from (`self` for `self.layers[0].layer_idx`)."""
    while getattr(source, "base", None) is not None:
        source = source.base
    return source


def _name(source) -> str:
    name = source.name  # a property in torch 2.13, a method in earlier releases
    return name() if callable(name) else name


class ModuleWatch:
    """Tells whether any module of `model` changed since `snapshot()` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.model = weakref.ref(model)
        self.dirty = False
        self.in_call = False
        self.snapshot()
        _WATCHES.add(self)
        _install_registration_hooks()

    def snapshot(self) -> None:
        model = self.model()
        self.modules = list(model.modules())
        self.ids = {id(m) for m in self.modules}
        self.training = tuple(map(_training, self.modules))
        self.hooks = self._hook_counts()
        # The usual state (every module in eval mode, no hooks) has a check that stops at the first
        # change, a few microseconds for bert-base's 228 modules.
        # Each module keeps its hook dicts for life: holding them makes the check one pass over lists.
        self.dicts = [m.__dict__ for m in self.modules]
        self.forward_hooks = list(map(_forward_hooks, self.modules))
        self.forward_pre_hooks = list(map(_forward_pre_hooks, self.modules))
        self.clean = not any(self.training) and not any(map(any, self.hooks[:2])) and not any(self.hooks[2:])
        config = getattr(model, "config", None)
        # The config's own attribute dict, held (an object keeps it for life): vars(config) goes
        # through Hugging Face's config __getattribute__, 2.9 us a call on the development CPU
        # against 0.9 us for the comparison itself.
        self.config_dict = vars(config) if config is not None and hasattr(config, "__dict__") else None
        self.config_items = dict(self.config_dict) if self.config_dict is not None else None
        self.dirty = False

    def _hook_counts(self) -> tuple:
        return (tuple(map(len, map(_forward_hooks, self.modules))),
                tuple(map(len, map(_forward_pre_hooks, self.modules))),
                len(_module._global_forward_hooks), len(_module._global_forward_pre_hooks))

    def changed(self) -> bool:
        """True when the model must be traced afresh; call snapshot() once it is."""
        if self.dirty:
            return True
        if self.clean:
            if (any(map(_training_item, self.dicts)) or any(self.forward_hooks) or any(self.forward_pre_hooks)
                    or _module._global_forward_hooks or _module._global_forward_pre_hooks):
                return True
        elif tuple(map(_training, self.modules)) != self.training or self._hook_counts() != self.hooks:
            return True
        try:
            return self.config_items is not None and self.config_dict != self.config_items
        except Exception:  # a value whose == does not give a bool (a tensor): count it changed
            return True

    def registered(self, module: torch.nn.Module) -> None:
        if not self.in_call and id(module) in self.ids:
            self.dirty = True


_WATCHES: "weakref.WeakSet[ModuleWatch]" = weakref.WeakSet()
_INSTALLED = False


def _on_registration(module, name, value):
    if torch.compiler.is_compiling():
        # A registration inside a forward Dynamo is tracing (a lazily built buffer): Dynamo sees it
        # itself, and reading _WATCHES here would add a guard on how many models are alive.
        return None
    for watch in list(_WATCHES):
        watch.registered(module)
    return None  # keep the value as registered


def _install_registration_hooks() -> None:
    global _INSTALLED
    if not _INSTALLED:
        _module.register_module_parameter_registration_hook(_on_registration)
        _module.register_module_buffer_registration_hook(_on_registration)
        _module.register_module_module_registration_hook(_on_registration)
        _INSTALLED = True
