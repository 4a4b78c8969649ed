"""runtime/step_inputs.py: the decode loop feeds its fixed buffers instead of calling
prepare_inputs_for_generation every step; every step's inputs must still be Hugging Face's own
(the same ids, positions and 4-D mask, up to the static cache's longer length), and models whose
mask is not the padding mask keep Hugging Face's preparation, named in the report."""

import functools

import pytest
import torch
import transformers

import transfuse
from tests.models.test_decoder_families import FAMILIES


def _build(family):
    """The family's tiny model at one layer: the step inputs (ids, positions, mask) are made outside
    the layers and are the same for every layer (the family tests run two)."""
    config_cls, model_cls, config, _ = FAMILIES[family]
    one_layer = dict(n_layer=1) if family == "gpt2" else dict(num_hidden_layers=1)
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**config, **one_layer})).eval()


# Host-side logic on tiny fp32 CPU models through the interpreter (exact token equality); on a GPU
# the same paths run in tests/models/test_decoders_gpu.py::test_generate_equals_eager.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/interpreter test; see tests/models/test_decoders_gpu.py")


def _record_decode_inputs(model, seen: list):
    """Wraps model.forward: the ids, positions and 4-D mask of every one-token (decode) call."""
    forward = model.forward

    @functools.wraps(forward)
    def recording(*args, **kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] == 1:
            mask = kwargs.get("attention_mask")
            if isinstance(mask, dict):
                (mask,) = mask.values()
            seen.append((ids.clone(), kwargs["position_ids"].clone(), mask.clone()))
        return forward(*args, **kwargs)

    model.forward = recording


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])  # qwen2: masks keyed by layer type
def test_fixed_step_inputs_are_hugging_faces(family):
    model = _build(family)
    ids = torch.randint(3, 97, (3, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[2, :1] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, eos_token_id=None)  # two decode steps
    ref_seen, seen = [], []
    with torch.no_grad():
        _record_decode_inputs(model, ref_seen)
        ref = model.generate(ids, cache_implementation="static", **kwargs)  # Hugging Face's loop
        del model.forward
        transfuse.optimize(model)
        _record_decode_inputs(model, seen)
        out = model.generate(ids, **kwargs)
        again = model.generate(ids, **kwargs)  # a second call: the fixed mask is reset, not grown
    assert torch.equal(out, ref) and torch.equal(again, ref)
    (entry,) = model._transfuse_state.decode_loop.entries.values()
    assert entry.step_inputs.reason is None and entry.step_inputs.mask is not None
    assert len(seen) == 2 * len(ref_seen) == 2 * 2
    for (ids_, pos, m), (ref_ids, ref_pos, ref_m) in zip(seen, ref_seen + ref_seen):
        n = ref_m.shape[-1]
        assert torch.equal(ids_, ref_ids) and torch.equal(pos, ref_pos)
        assert m.dtype == ref_m.dtype == torch.bool and m.shape[:3] == ref_m.shape[:3]
        assert torch.equal(m[..., :n], ref_m) and not m[..., n:].any()


def test_sliding_window_keeps_hugging_faces_preparation():
    """Mistral's window drops old columns: the 2-D mask is not the 4-D one, HF prepares each step
    (here Mistral also retraces every step, so a low max_traces hands it to eager first: use 8)."""
    model = _build("mistral")
    ids = torch.randint(3, 97, (2, 5))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        transfuse.optimize(model)
        assert torch.equal(model.generate(ids, **kwargs), ref)
    (entry,) = model._transfuse_state.decode_loop.entries.values()
    assert entry.step_inputs.inputs is None and entry.step_inputs.reason == "sliding-window attention"
    assert "inputs prepared by Hugging Face every step: sliding-window attention" in transfuse.report(model)


def test_an_unexpected_mask_keeps_hugging_faces_preparation():
    """A mask that is not the 2-D padding mask's copy (here: a float mask) is refused, with why."""
    from transfuse.runtime.step_inputs import fixed_inputs

    model = _build("llama")
    tokens = torch.zeros(2, 1, dtype=torch.long)
    mask_2d = torch.ones(2, 8, dtype=torch.long)
    float_mask = torch.zeros(2, 1, 1, 8)
    got = fixed_inputs(model, dict(input_ids=tokens.clone(), attention_mask=float_mask), tokens, [mask_2d], mask_2d)
    assert got.inputs is None and "torch.float32 mask" in got.reason
    other = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    other[0, 0, 0, 3] = False
    got = fixed_inputs(model, dict(input_ids=tokens.clone(), attention_mask=other), tokens, [mask_2d], mask_2d)
    assert got.inputs is None and "other values" in got.reason
    got = fixed_inputs(model, dict(input_ids=tokens.clone(), extra=torch.ones(2)), tokens, [mask_2d], mask_2d)
    assert got.inputs is None and "makes extra anew" in got.reason
    same = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    got = fixed_inputs(model, dict(input_ids=tokens.clone(), attention_mask=same, use_cache=True), tokens,
                       [mask_2d], mask_2d)
    assert got.reason is None and got.inputs["input_ids"] is tokens and got.inputs["attention_mask"] is got.mask
    got = fixed_inputs(_build("phi3"), dict(input_ids=tokens.clone(), attention_mask=same), tokens, [mask_2d], mask_2d)
    assert got.inputs is None and got.reason == "Phi3ForCausalLM prepares its inputs itself"
