"""The static cache transfuse gives generate() by default is allocated with the shapes each layer
really writes: where a layer's values are shaped unlike its keys, the cache is left to initialize
itself from the first forward instead of taking the config's one (heads, head dim) for both."""

import torch
import transformers

import transfuse


def _mimo_v2_flash():
    # MiMo-V2-Flash: query/key heads 24 wide, value heads 16 wide
    config = transformers.MiMoV2FlashConfig(
        vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, max_position_embeddings=64, head_dim=24, v_head_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, sliding_window=8)
    torch.manual_seed(0)
    return transformers.MiMoV2FlashForCausalLM(config).eval()


def _reuse(model):
    """The static-cache reuse that optimize() installs for the model's generate()."""
    return transfuse.optimize(model)._transfuse_state.static_cache


def test_values_narrower_than_keys_are_not_given_the_keys_head_dim():
    model = _mimo_v2_flash()
    reuse = _reuse(model)
    assert reuse.probe() is None  # the model's forward runs on a static cache
    assert reuse.values_differ
    assert reuse.kv_shape() is None  # not the config's (2, 24) for the values too
    cache = reuse("static", 2, 16, None, {})
    ids = torch.randint(3, 101, (2, 5))
    forward = getattr(model.forward, "__wrapped__", model.forward)  # the model as written, as the probe runs it
    with torch.no_grad():
        forward(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(5))
    layer = cache.layers[0]
    assert layer.keys.shape[-1] == 24 and layer.values.shape[-1] == 16


def test_keys_and_values_of_one_shape_are_allocated_before_the_first_forward():
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64)
    torch.manual_seed(0)
    reuse = _reuse(transformers.LlamaForCausalLM(config).eval())
    assert reuse.probe() is None and not reuse.values_differ
    assert reuse.kv_shape() == ([2, 2], [16, 16])
    cache = reuse("static", 2, 16, None, {})
    assert all(layer.is_initialized for layer in cache.layers)


def test_sparse_attention_over_the_whole_cache_keeps_hugging_faces_cache():
    # GLM-MoE-DSA's indexer keeps its index_topk best-scored cache slots, empty ones included: a
    # static cache of another length changes its tokens (Hugging Face's own too), so generate()
    # keeps Hugging Face's default cache, and says why.
    config = transformers.GlmMoeDsaConfig(
        vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=96, max_position_embeddings=64, moe_intermediate_size=32, num_experts_per_tok=2,
        n_routed_experts=4, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=2,
        mlp_layer_types=["dense", "sparse"])
    torch.manual_seed(0)
    model = transfuse.optimize(transformers.GlmMoeDsaForCausalLM(config).eval())
    assert model._transfuse_state.static_cache is None
    assert "index_topk=8" in model._transfuse_state.static_cache_reason
