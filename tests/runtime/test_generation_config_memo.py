"""runtime/generation_config_memo.py: generate()'s prepared config, its kwargs-independent merge kept,
equals Hugging Face's own for every call, and is made again when model.generation_config changes."""

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.utils import GenerationMixin

from transfuse.runtime.generation_config_memo import GenerationConfigMemo, _fingerprint

HF = GenerationMixin._prepare_generation_config


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _same(ours, theirs):
    (c1, k1), (c2, k2) = ours, theirs
    assert c1.to_dict() == c2.to_dict()
    assert k1.keys() == k2.keys() and all(k1[k] is k2[k] for k in k1)


def test_applies_to_this_transformers():
    assert GenerationConfigMemo(HF).applies


@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=8, do_sample=False),
    dict(max_new_tokens=5, min_new_tokens=5, do_sample=True, top_k=4, temperature=0.7),
    dict(num_beams=2, max_length=12, output_attentions=True, output_hidden_states=True, return_dict_in_generate=True),
    dict(cache_implementation="hybrid", max_new_tokens=3),
])
def test_equals_hugging_face_every_call(model, kwargs):
    memo = GenerationConfigMemo(HF)
    mask = torch.ones(1, 4, dtype=torch.long)
    for _ in range(3):
        _same(memo(model, dict(kwargs, attention_mask=mask)), HF(model, None, **dict(kwargs, attention_mask=mask)))
    assert memo.misses == 1 and memo.hits == 2


def test_a_changed_model_config_is_merged_again(model):
    memo = GenerationConfigMemo(HF)
    config, _ = memo(model, dict(max_new_tokens=4))
    config.top_k = 3  # the caller's copy: the kept merge must not see it
    saved = model.generation_config
    try:
        model.generation_config = GenerationConfig(**saved.to_dict())
        model.generation_config.repetition_penalty = 1.3
        model.generation_config.eos_token_id = [5, 7]
        ours = memo(model, dict(max_new_tokens=4))
        assert memo.misses == 2
        _same(ours, HF(model, None, max_new_tokens=4))
        assert ours[0].repetition_penalty == 1.3 and ours[0].top_k != 3
        model.generation_config.eos_token_id.append(9)  # edited in place
        _same(memo(model, dict(max_new_tokens=4)), HF(model, None, max_new_tokens=4))
        assert memo.misses == 3
    finally:
        model.generation_config = saved


def test_bad_options_fail_as_in_hugging_face(model):
    memo = GenerationConfigMemo(HF)
    with pytest.raises(ValueError, match="max_new_tokens"):
        HF(model, None, max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        memo(model, dict(max_new_tokens=0))


def test_fingerprint_sees_nested_edits():
    a = {"x": [1, {"y": 2}]}
    before = _fingerprint(a)
    a["x"][1]["y"] = 3
    assert _fingerprint(a) != before
