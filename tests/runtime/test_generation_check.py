"""runtime/generation_check.py: Hugging Face's check for generation options set on the model config,
answered from a default config built once per class, gives Hugging Face's answers; generate() on an
optimized model still refuses such a config, as eager does."""

import pytest
import torch
import transformers

import transfuse
from transfuse.runtime.generation_check import _DEFAULTS, _stock_check, cached_generation_check


def _config(**options):
    sizes = dict(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=48, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.LlamaConfig(**{**sizes, **options})


@pytest.mark.parametrize("options", [{}, {"temperature": 0.3}, {"num_beams": 3, "top_k": 7}])
def test_same_answer_as_hugging_face(options):
    config = _config()
    for key, value in options.items():
        setattr(config, key, value)
    expected = _stock_check()(config)
    assert expected == options  # the options set are what Hugging Face reports
    with cached_generation_check(config):
        assert "_get_generation_parameters" in vars(config)
        assert config._get_generation_parameters() == expected
        config.top_p = 0.5  # a change inside the block is seen: the comparison runs on every call
        assert config._get_generation_parameters() == {**expected, "top_p": 0.5}
    assert "_get_generation_parameters" not in vars(config)  # the config is left as it was
    assert "_get_generation_parameters" not in config.to_dict()


def test_generate_still_refuses_options_on_the_model_config():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config()).eval()
    ids = torch.randint(3, 97, (1, 5))
    with torch.no_grad():
        transfuse.optimize(model)
        model.generate(ids, max_new_tokens=2, do_sample=False)
        assert _DEFAULTS.get(type(model.config)) is not None  # the shortcut was taken
        model.config.temperature = 0.7
        with pytest.raises(ValueError, match="modified the pretrained model configuration"):
            model.generate(ids, max_new_tokens=2, do_sample=False)
        del model.config.temperature
    assert "_get_generation_parameters" not in vars(model.config)


def test_cache_reset_in_one_launch_equals_hugging_faces():
    """runtime/generation.py's _reset: the same zeroed state as StaticCache.reset()."""
    from transformers import StaticCache

    from transfuse.runtime.generation import _reset

    config = _config(num_hidden_layers=3)
    caches = [StaticCache(config=config, max_cache_len=16) for _ in range(2)]
    for cache in caches:
        cache.early_initialization(batch_size=2, num_heads=1, head_dim=16, dtype=torch.float32, device="cpu")
        for layer in cache.layers:
            layer.keys.normal_()
            layer.values.normal_()
            if hasattr(layer, "cumulative_length") and isinstance(layer.cumulative_length, torch.Tensor):
                layer.cumulative_length.fill_(5)
    caches[0].reset()
    _reset(caches[1])
    for ours, theirs in zip(caches[1].layers, caches[0].layers):
        assert torch.equal(ours.keys, theirs.keys) and ours.keys.abs().sum() == 0
        assert torch.equal(ours.values, theirs.values)
        if hasattr(theirs, "cumulative_length"):
            assert torch.equal(torch.as_tensor(ours.cumulative_length), torch.as_tensor(theirs.cumulative_length))
