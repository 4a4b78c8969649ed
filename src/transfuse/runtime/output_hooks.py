"""Hugging Face's output-capturing hooks, installed before the call that first asks for them.

Transformers 5 collects hidden states and attention probabilities (`output_hidden_states=True`,
`output_attentions=True`) with forward hooks on the layers, registered by the `capture_outputs`
decorator the first time a call asks for them: inside that call, in the middle of the forward.
Dynamo does not guard on module hooks (`skip_nnmodule_hook_guards`), so layers whose frames were
compiled by earlier calls replay code without the hooks: on torch 2.11, MBart's decoder returned no
decoder_hidden_states after plain calls (Dynamo alone does the same; bench/output_structure.py).

Installed here, before the call and outside Dynamo, the hooks are a module change that the
per-call check (guards.ModuleWatch) sees, and the model is traced afresh with them. Installing
them is what Hugging Face would do in that call anyway; it only happens a moment earlier.
"""

from __future__ import annotations

import torch

_ASKS = ("output_hidden_states", "output_attentions")
_FLAG = "_output_capturing_hooks_installed"


def _installer():
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # a transformers without hook-based capture: nothing to install early
        return None
    return maybe_install_capturing_hooks


def install_before_call(model: torch.nn.Module, kwargs: dict) -> None:
    """If this call asks for hidden states or attentions, install the hooks on every outermost
    Hugging Face model in `model` (itself, or the encoder inside the module that generate()'s
    encoder is compiled as) that lacks them; each recurses into its own submodels."""
    if not any(kwargs.get(k) for k in _ASKS):
        return
    install = _installer()
    if install is None:
        return
    for hf_model in _outermost_hf_models(model):
        if not getattr(hf_model, _FLAG, False):
            install(hf_model)


def _outermost_hf_models(module: torch.nn.Module) -> list:
    from transformers import PreTrainedModel

    if isinstance(module, PreTrainedModel):
        return [module]
    return [m for child in module.children() for m in _outermost_hf_models(child)]
