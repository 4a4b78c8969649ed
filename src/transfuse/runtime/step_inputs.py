"""A decode step's model inputs at fixed addresses, instead of prepare_inputs_for_generation's.

Hugging Face's `prepare_inputs_for_generation` runs every token and makes tensors anew: a contiguous
clone of the token ids, and for a static cache the 4-D mask (`create_masks_for_generate`: aranges,
comparisons, an index, the padding mask; 13 launches in a Llama decode step, as many as the rest of
the loop's bookkeeping, bench/decode_step_census.py). Inside the decode loop's CUDA graph those are
kernels replayed every token for values the loop already holds:

    input ids       the loop's `tokens` buffer itself (it is already (B, 1) and contiguous)
    4-D mask        a bool buffer (B, 1, 1, cache length) the loop keeps: a step makes the next
                    token's column True, as it does in its 2-D mask (decode_step kernel)

That mask is Hugging Face's only while it is "padding and causal": on a static cache the query is
the newest token, every column after it is still 0 in the 2-D mask, so mask[b, 0, 0, j] is just
2-D mask[b, j] != 0. Sliding windows (columns leave the window), chunked attention, a model's own
mask or input preparation (which may compute anything from the step) break that: those keep Hugging
Face's preparation every step, and the report says why (`reason`).
The first step of every key still runs Hugging Face's preparation, and its inputs are compared with
the fixed ones, value for value: any difference (a float mask from eager attention, a tensor input
made anew) keeps Hugging Face's too.
"""

from __future__ import annotations

import torch

from transfuse.runtime.generate_masks import masks_for_generate

# What create_masks_for_generate returns per layer type when the model declares them (Qwen2, ...).
_FULL = "full_attention"


def preparation_reason(model) -> str | None:
    """None when the model's inputs are prepared by Hugging Face's generic code, which makes nothing
    per step but the ids' clone and the mask (a model's own may compute anything from the step)."""
    from transformers.generation.utils import GenerationMixin

    if type(model).prepare_inputs_for_generation is not GenerationMixin.prepare_inputs_for_generation:
        return f"{type(model).__name__} prepares its inputs itself"
    if getattr(type(model), "is_remote_code", lambda: False)():
        return "a model from remote code"
    return None


def mask_reason(model) -> str | None:
    """None when a step's 4-D mask is the 2-D padding mask (see the module docstring), else why not."""
    own = getattr(model, "create_masks_for_generate", None)
    if own is not None and own is not masks_for_generate:  # transfuse's builder makes Hugging Face's masks
        return f"{type(model).__name__} makes its masks itself"
    config = model.config.get_text_config()
    types = getattr(config, "layer_types", None)
    if types is not None:
        if set(types) - {_FULL}:
            return f"layer types {sorted(set(types) - {_FULL})}"
    elif getattr(config, "sliding_window", None) is not None:
        return "sliding-window attention"
    elif getattr(config, "attention_chunk_size", None) is not None:
        return "chunked attention"
    return None


class StepInputs:
    """The fixed inputs of one decode-loop key, or the reason the step keeps Hugging Face's."""

    def __init__(self, inputs: dict | None, mask: torch.Tensor | None, reason: str | None):
        self.inputs = inputs  # the model's keyword arguments, every tensor one of the loop's
        self.mask = mask      # the 4-D bool mask buffer (decoder-only), else None
        self.reason = reason

    def reset(self, mask_2d: torch.Tensor) -> None:
        """A new call: the 4-D mask is this call's 2-D mask again."""
        if self.mask is not None:
            self.mask.view(self.mask.shape[0], -1).copy_(mask_2d[:, :self.mask.shape[-1]])


def fixed_inputs(model, hf: dict, tokens: torch.Tensor, passed: list, mask_2d: torch.Tensor | None) -> StepInputs:
    """From Hugging Face's inputs for this step (`hf`), the same inputs on fixed buffers: `tokens`
    for the ids, a new bool buffer for the 4-D mask (when mask_2d, the loop's 2-D mask, is given),
    the objects passed in (`passed`: cache, position ids, encoder states) as they are."""
    reason = preparation_reason(model)
    if reason is not None:
        return StepInputs(None, None, reason)
    seq2seq = bool(model.config.is_encoder_decoder)
    ids_key = "decoder_input_ids" if seq2seq else "input_ids"
    fixed, mask = {}, None
    for key, value in hf.items():
        if key == "attention_mask" and mask_2d is not None and value is not mask_2d:
            reason = mask_reason(model)
            if reason is not None:
                return StepInputs(None, None, reason)
            mask, differs = _mask_buffer(value, mask_2d)
            if mask is None:
                return StepInputs(None, None, f"the 4-D mask is not the padding mask ({differs})")
            fixed[key] = {_FULL: mask} if isinstance(value, dict) else mask
        elif any(value is p for p in passed) or value is None or isinstance(value, (bool, int, float, str)):
            fixed[key] = value  # the loop's 2-D mask itself (flash attention) is advanced by the loop
        elif key == ids_key:
            if not _same_tensor(value, tokens):
                return StepInputs(None, None, f"{key} is not the token fed")
            fixed[key] = tokens
        else:
            return StepInputs(None, None, f"prepare_inputs_for_generation makes {key} anew every step")
    return StepInputs(fixed, mask, None)


def _same_tensor(value, like: torch.Tensor) -> bool:
    return (isinstance(value, torch.Tensor) and value.shape == like.shape and value.stride() == like.stride()
            and value.dtype == like.dtype and value.device == like.device and torch.equal(value, like))


def _mask_buffer(value, mask_2d: torch.Tensor) -> tuple[torch.Tensor | None, str]:
    """A new buffer equal to Hugging Face's 4-D mask `value`, or (None, what differs)."""
    if isinstance(value, dict):
        if set(value) != {_FULL}:
            return None, f"masks {sorted(value)}"
        value = value[_FULL]
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bool:
        return None, f"a {getattr(value, 'dtype', type(value).__name__)} mask"
    batch = mask_2d.shape[0]
    if value.dim() != 4 or value.shape[:3] != (batch, 1, 1) or value.shape[3] > mask_2d.shape[1] \
            or not value.is_contiguous():
        return None, f"shape {tuple(value.shape)}"
    with torch.inference_mode(False):  # written in place by later calls, inside inference mode or not
        mask = torch.empty_like(value)
    mask.view(batch, -1).copy_(mask_2d[:, :value.shape[3]])
    if not torch.equal(mask, value):
        return None, "other values"
    return mask, ""
