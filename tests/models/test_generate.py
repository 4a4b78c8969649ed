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
