"""generate() on an optimized decoder gives eager's tokens, with one trace for the prompt and one for
every decode step (the KV cache's length is a dynamic dimension, not a trace per token). The fast
decode path (static cache, decode kernels, a graph per step) is issue 4's; this is correctness."""

import pytest
import torch
import transformers

import transfuse


def _lm(family):
    common = dict(vocab_size=97, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, **common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        max_position_embeddings=64, **common))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_greedy_generate_matches_eager(family):
    torch.manual_seed(0)
    model = _lm(family).eval()
    ids = torch.randint(3, 97, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        transfuse.optimize(model)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, ref)
    traces = sum(len(b.records) for b in model._transfuse_state.backends)
    assert traces == 2, f"{traces} traces: the decode steps should share one"
    text = transfuse.report(model)
    assert "TorchSDPA" in text and "key and value lengths differ" not in text


def test_static_cache_generate_matches_eager():
    """generate(cache_implementation="static"): the graph writes the cache in place (index_copy_); the
    mask summary must come after every size it reads, and the written cache is never padded."""
    torch.manual_seed(0)
    model = _lm("llama").eval()
    ids = torch.randint(3, 97, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        transfuse.optimize(model)
        out = model.generate(ids, **kwargs)
    assert torch.equal(out, ref)
    assert "writes into this input in place" in transfuse.report(model)


def test_default_static_cache_is_reused_and_user_caches_are_left_alone():
    """With no cache named, generate() runs on a static cache (one shape per step: one CUDA graph),
    the same tensors from call to call while batch and length fit; a DynamicCache the user passes,
    or static_cache=False, keeps Hugging Face's behaviour; restore() undoes it all."""
    torch.manual_seed(0)
    model = _lm("llama").eval()
    ids = torch.randint(3, 97, (2, 5))
    with torch.no_grad():
        ref6 = model.generate(ids, max_new_tokens=6, do_sample=False)
        ref9 = model.generate(ids, max_new_tokens=9, do_sample=False)
        transfuse.optimize(model)
        state = model._transfuse_state
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), ref6)
        (cache, length), = state.static_cache.caches.values()
        keys = cache.layers[0].keys
        assert torch.equal(model.generate(ids, max_new_tokens=9, do_sample=False), ref9)
        assert state.static_cache.reused == 1 and cache.layers[0].keys is keys  # same tensors: same graphs
        user = transformers.DynamicCache(config=model.config)
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=user), ref6)
        assert user.get_seq_length() > 0 and state.static_cache.reused == 1
    assert "static KV cache by default: 1 created, 1 reused" in transfuse.report(model)
    transfuse.restore(model)
    assert "generate" not in model.__dict__ and "_prepare_static_cache" not in model.__dict__


def test_static_cache_can_be_turned_off():
    model = _lm("gpt2").eval()
    transfuse.optimize(model, static_cache=False)
    assert "generate" not in model.__dict__
    ids = torch.randint(3, 97, (1, 4))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)
    assert "Hugging Face's default cache (optimize(static_cache=False))" in transfuse.report(model)
