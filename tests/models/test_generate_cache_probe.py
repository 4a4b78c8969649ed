"""generate()'s default static cache is sized from what the model's attention really writes, and is
not used where the model's own forward refuses a static cache (runtime/generation.py, probe)."""

import torch
import transformers

import transfuse


def _falcon(**config):
    """One layer: the cache's heads and the probe are the attention's, the same in every layer."""
    return transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **config)).eval()


def _generate_both(model):
    torch.manual_seed(0)
    ids = torch.randint(3, 97, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)  # prompt + 2 steps
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        transfuse.optimize(model)
        out = model.generate(ids, **kwargs)
    return out, ref


def test_multi_query_cache_has_one_kv_head():
    """Falcon's multi-query attention writes one KV head; the config's num_kv_heads says 2 (the
    early-initialized cache had 2 heads and the prompt's cache write failed)."""
    torch.manual_seed(0)
    model = _falcon(multi_query=True)
    assert model._get_static_cache_init_shape()[0] == 2
    out, ref = _generate_both(model)
    assert torch.equal(out, ref)
    assert "static KV cache by default: 1 created" in transfuse.report(model)
    (cache, _), = model._transfuse_state.static_cache.caches.values()
    assert {layer.keys.shape[1] for layer in cache.layers} == {1}


def test_model_that_refuses_a_static_cache_keeps_hf_cache():
    """Falcon with ALiBi reads the 4-D mask a static cache brings as a 2-D one: Hugging Face's own
    static cache fails there too, so generate() keeps the dynamic cache, and the report says why."""
    torch.manual_seed(0)
    out, ref = _generate_both(model := _falcon(alibi=True, multi_query=False))
    assert torch.equal(out, ref)
    assert "Hugging Face's default cache (its forward fails with a static cache" in transfuse.report(model)
