"""Hugging Face's per-call check on the model config, with its default config built once per class.

Every generate() without an explicit generation_config asks `model.config._get_generation_parameters()`
whether the user set generation options on the model config (a legacy use it refuses). The check
builds a whole default config of the model's class to compare against: ~0.6 ms of host time per
call on the H100 machines' host (bench/results/2026-11-26-*-generate-host-session14-before.log), in
which the GPU has nothing to do. The default config depends on the class alone, so it is built once
per class here; the comparison still runs on every call, on the config as it is then.

The shortcut is taken only where the config's class does not override the check, and only once it
has given Hugging Face's own answer on this config (checked on the first call per class): another
transformers version that changes the check keeps its own.
"""

from __future__ import annotations

import contextlib
import functools

_NAME = "_get_generation_parameters"
_DEFAULTS: dict[type, dict | None] = {}  # class -> its default config as a dict (None: not taken)


def _stock_check():
    try:
        from transformers.configuration_utils import PreTrainedConfig
    except ImportError:  # an older transformers spells it PretrainedConfig
        from transformers.configuration_utils import PretrainedConfig as PreTrainedConfig
    return getattr(PreTrainedConfig, _NAME, None)


def _generation_parameters(config, defaults: dict) -> dict:
    """PreTrainedConfig._get_generation_parameters with `defaults`, the class's default config dict:
    the generation options set on `config` that the class does not set by default."""
    from transformers import GenerationConfig

    found = {}
    for key in GenerationConfig._get_default_generation_params():
        if key == "use_cache":
            continue
        if hasattr(config, key) and getattr(config, key) is not None and key not in defaults:
            found[key] = getattr(config, key)
    return found


def _defaults_for(config) -> dict | None:
    cls = type(config)
    if cls not in _DEFAULTS:
        stock = _stock_check()
        defaults = None
        if stock is not None and getattr(cls, _NAME, None) is stock:
            try:
                candidate = {} if getattr(config, "has_no_defaults_at_init", False) else cls().to_dict()
                if _generation_parameters(config, candidate) == stock(config):
                    defaults = candidate
            except Exception:  # noqa: BLE001 - any surprise: Hugging Face's check runs as it is
                defaults = None
        _DEFAULTS[cls] = defaults
    return _DEFAULTS[cls]


@contextlib.contextmanager
def cached_generation_check(config):
    """Within the block, `config._get_generation_parameters()` answers from the class's default
    config built once (see the module docstring); outside it the config is as it was."""
    defaults = _defaults_for(config) if config is not None else None
    if defaults is None or _NAME in vars(config):
        yield
        return
    # An instance attribute, set in __dict__ directly (the config class's strict __setattr__ would
    # validate it as a field). It lives for the one call that reads it: to_dict copies __dict__, and
    # _prepare_generation_config serializes the generation config, never the model's.
    vars(config)[_NAME] = functools.partial(_generation_parameters, config, defaults)
    try:
        yield
    finally:
        vars(config).pop(_NAME, None)
