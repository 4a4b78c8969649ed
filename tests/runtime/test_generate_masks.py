"""generate()'s masks for a static cache built by transfuse where Hugging Face's builder refuses
the model (runtime/generate_masks.py): Llama 4's chunked attention on transformers 5.17."""

import copy

import pytest
import torch
import transformers
from transformers import masking_utils

import transfuse
from transfuse.runtime.generate_masks import masks_for_generate, needs_own_masks


def _llama4(chunk=8):
    cfg = transformers.Llama4TextConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=48, intermediate_size_mlp=48, vocab_size=97, num_local_experts=2, num_experts_per_tok=1,
        attention_chunk_size=chunk, no_rope_layers=[1, 0], use_qk_norm=True, interleave_moe_layer_step=2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM(cfg).eval()


def test_chunked_attention_generates_on_a_static_cache_in_few_traces():
    """Chunked layers once kept Hugging Face's dynamic cache (its static one raised a TypeError)
    and traced every decode step until the model was handed back to eager; now generate() equals
    eager's with one trace for the prompt and one for the steps, across calls and chunk borders."""
    # chunks of 4: a 7-token prompt spans two chunks, the steps cross the borders at 8 and 12 (the
    # decode inputs sit at positions 7-8, then 7-12) in 8 decode steps (chunks of 8 took 18 steps)
    model = _llama4(chunk=4)
    opt = transfuse.optimize(copy.deepcopy(model))
    ids = torch.randint(3, 97, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        for new in (3, 7):  # past one, then two chunk borders (positions 8 and 12)
            want = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
            got = opt.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
            assert torch.equal(got, want), new
    state = opt._transfuse_state
    report = transfuse.report(opt)
    assert state.eager_reason is None and state.tracing_calls <= 2, report
    assert "static KV cache by default" in report and "transfuse builds the masks" in report, report
    transfuse.restore(opt)
    assert "create_masks_for_generate" not in vars(opt)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_same_masks_as_hugging_faces_builder_where_it_works(family):
    """Full, sliding-window and mixed layer types: the masks equal Hugging Face's own, for a prompt
    with left padding and for a decode step; models whose functions take every argument keep
    Hugging Face's builder."""
    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "mistral": ("MistralConfig", "MistralForCausalLM"),
                             "gemma2": ("Gemma2Config", "Gemma2ForCausalLM")}[family]
    cfg = getattr(transformers, config_cls)(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                            num_key_value_heads=1, head_dim=16, intermediate_size=48,
                                            vocab_size=97, sliding_window=5)
    model = getattr(transformers, model_cls)(cfg).eval()
    assert needs_own_masks(model) is None
    cache = transformers.StaticCache(config=cfg, max_cache_len=24)
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :3] = 0
    for q, pos in ((9, torch.arange(9)), (1, torch.tensor([15]))):
        kw = dict(config=cfg, inputs_embeds=torch.empty(2, q, 0), attention_mask=mask, past_key_values=cache,
                  position_ids=pos.expand(2, -1))
        want, got = masking_utils.create_masks_for_generate(**kw), masks_for_generate(**kw)
        if isinstance(want, dict):
            assert want.keys() == got.keys()
            pairs = [(want[k], got[k]) for k in want]
        else:
            pairs = [(want, got)]
        for w, g in pairs:
            assert (w is None and g is None) or torch.equal(w, g)


def test_block_sequence_ids_a_function_cannot_take_is_refused():
    model = _llama4()
    assert "create_chunked_causal_mask" in needs_own_masks(model)
    with pytest.raises(TypeError, match="block_sequence_ids"):
        masks_for_generate(config=model.config, inputs_embeds=torch.empty(1, 4, 0),
                           attention_mask=torch.ones(1, 4, dtype=torch.long), past_key_values=None,
                           block_sequence_ids=torch.zeros(1, 4, dtype=torch.long))
