"""generate()'s masks for a static cache where Hugging Face's own builder cannot make them.

With a static cache, generate() builds each step's 4-D masks ahead of the forward through
`create_masks_for_generate`, which hands one set of arguments to the mask function of every layer
type. In transformers 5.17 that set includes `block_sequence_ids`, which `create_chunked_causal_mask`
does not take: generate() with any static cache raises a TypeError on a chunked-attention model
(Llama 4), Hugging Face's own `cache_implementation="static"` included. Such a model kept Hugging
Face's dynamic cache, whose chunked layers count their tokens in a Python int: every decode step was
a Dynamo trace of its own, until max_traces handed the model back to eager.

`masks_for_generate` builds the same masks (one per layer type, or one for all), giving each
function only the arguments it takes. optimize() installs it on a model only where a function of the
model's layer types lacks an argument Hugging Face's builder passes, and only if the model has no
builder of its own; a `block_sequence_ids` that a function cannot honour is refused, as Hugging Face
refuses it.
"""

from __future__ import annotations

import functools
import inspect

# What Hugging Face's builder passes to every mask function (transformers 5.17).
_PASSED = ("config", "inputs_embeds", "attention_mask", "past_key_values", "position_ids", "or_mask_function",
           "and_mask_function", "block_sequence_ids")


def _mask_functions(config) -> dict | None:
    """{layer type: mask function} for a model with layer types, {None: function} for one mask for
    every layer; None where Hugging Face's builder returns the 2-D mask as it is (a layer type with
    no registered function)."""
    from transformers import masking_utils

    text = config.get_text_config()
    if hasattr(text, "layer_types"):
        mapping = masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING
        if any(t not in mapping for t in text.layer_types):
            return None
        functions = {}
        for layer_type in dict.fromkeys(text.layer_types):
            entry = mapping[layer_type]  # a dict where one layer type needs several masks ("hybrid")
            for name, fn in (entry.items() if isinstance(entry, dict) else [(layer_type, entry)]):
                functions.setdefault(name, fn)
        return functions
    if getattr(text, "sliding_window", None) is not None:
        return {None: masking_utils.create_sliding_window_causal_mask}
    if getattr(text, "attention_chunk_size", None) is not None:
        return {None: masking_utils.create_chunked_causal_mask}
    return {None: masking_utils.create_causal_mask}


@functools.cache  # read for every argument at every mask build (each prefill and eager step)
def _takes(fn, name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def needs_own_masks(model) -> str | None:
    """Why `masks_for_generate` must build this model's masks (the function that refuses an
    argument), or None where Hugging Face's builder works or the model has its own."""
    if getattr(type(model), "create_masks_for_generate", None) is not None:
        return None
    try:
        from transformers import masking_utils
        builder = masking_utils.create_masks_for_generate
        functions = _mask_functions(model.config)
    except (ImportError, AttributeError):
        return None
    passed = [n for n in _PASSED if n in inspect.signature(builder).parameters]
    for fn in (functions or {}).values():
        missing = [n for n in passed if not _takes(fn, n)]
        if missing:
            return (f"Hugging Face's create_masks_for_generate passes {missing[0]} to {fn.__name__}, which takes "
                    f"none: transfuse builds the masks")
    return None


def masks_for_generate(config, inputs_embeds, attention_mask, past_key_values, position_ids=None,
                       or_mask_function=None, and_mask_function=None, block_sequence_ids=None, **_ignored):
    """Hugging Face's `create_masks_for_generate`, each mask function given only what it takes.
    (`_ignored`: the arguments Hugging Face passes for models with a builder of their own.)"""
    functions = _mask_functions(config)
    if functions is None:
        return attention_mask
    given = dict(config=config.get_text_config(), inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                 past_key_values=past_key_values, position_ids=position_ids, or_mask_function=or_mask_function,
                 and_mask_function=and_mask_function, block_sequence_ids=block_sequence_ids)
    masks = {}
    for name, fn in functions.items():
        if block_sequence_ids is not None and not _takes(fn, "block_sequence_ids"):
            raise TypeError(f"{fn.__name__}() takes no block_sequence_ids: this model's {name or 'attention'} "
                            f"layers cannot use blocks; leave block_sequence_ids out")
        masks[name] = fn(**{k: v for k, v in given.items() if _takes(fn, k)})
    return masks[None] if None in masks else masks
