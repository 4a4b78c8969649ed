"""generate() on an optimized decoder gives eager's tokens, with one trace for the prompt and one for
every decode step (the KV cache's length is a dynamic dimension, not a trace per token). The fast
decode path (static cache, decode kernels, a graph per step) is issue 4's; this is correctness."""

import pytest
import torch
import transformers

import transfuse
from tests.helpers import rewrite_counts


def _lm(family, positions=64, layers=2, **config):
    """Tiny GPT-2 or Llama. Some tests of what generate() does around the model (the position check,
    a processor left to Hugging Face, inference mode) use one layer: the interpreted kernels cost in
    proportion to the layers. What spans layers (one cache per layer, reordered by beam search; one
    mask summary per forward) keeps two here and in test_decoder_families.py."""
    common = dict(vocab_size=97, bos_token_id=1, eos_token_id=2, pad_token_id=0, **config)
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=layers, n_head=2,
                                                                    n_positions=positions, **common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, intermediate_size=48,
        max_position_embeddings=positions, **common))


# Greedy generate() with a left-padded batch, one trace for the prompt and one shared by every decode
# step, for GPT-2 and Llama (and the other decoder families): test_decoder_families.py.


def test_static_cache_generate_matches_eager():
    """generate(cache_implementation="static"): the graph writes the cache in place (index_copy_); the
    mask summary must come after every size it reads, and the written cache is never padded."""
    torch.manual_seed(0)
    model = _lm("llama").eval()
    ids = torch.randint(3, 97, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        transfuse.optimize(model)
        out = model.generate(ids, **kwargs)
    assert torch.equal(out, ref)
    text = transfuse.report(model)
    assert "writes into this input in place" in text and "KVCacheWrite" in text
    assert "RotaryCacheWrite" in text  # rotary_pair + the write: one launch


@pytest.mark.parametrize("cache", [None, "static"])
def test_batch_of_three_decodes_with_the_cache_written_by_the_attention(cache):
    """From three rows a decode step's rotary + cache write runs inside the decode attention
    (RotaryCacheAttention); with one or two the norm + Q/K/V GEMV does it. Tokens equal eager's on
    transfuse's default cache (key_len) and on Hugging Face's StaticCache (its mask), left-padded."""
    torch.manual_seed(0)
    model = _lm("llama").eval()
    ids = torch.randint(3, 97, (3, 6))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, cache_implementation=cache)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        transfuse.optimize(model)
        out = model.generate(ids, **kwargs)
    assert torch.equal(out, ref)
    assert model._transfuse_state.backend.records[-1].rewrites["RotaryCacheAttention"] == 2


def test_default_static_cache_is_reused_and_user_caches_are_left_alone():
    """With no cache named, generate() runs on a static cache (one shape per step: one CUDA graph),
    the same tensors from call to call while batch and length fit; a DynamicCache the user passes,
    or static_cache=False, keeps Hugging Face's behaviour; restore() undoes it all. One layer: the
    cache is created and reused whole (one per model, not per layer)."""
    torch.manual_seed(0)
    model = _lm("llama", layers=1).eval()
    ids = torch.randint(3, 97, (2, 5))
    with torch.no_grad():
        ref3 = model.generate(ids, max_new_tokens=3, do_sample=False)
        ref5 = model.generate(ids, max_new_tokens=5, do_sample=False)
        transfuse.optimize(model)
        state = model._transfuse_state
        assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), ref3)
        (cache, length), = state.static_cache.caches.values()
        keys = cache.layers[0].keys
        assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False), ref5)
        assert state.static_cache.reused == 1 and cache.layers[0].keys is keys  # same tensors: same graphs
        user = transformers.DynamicCache(config=model.config)
        assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False, past_key_values=user), ref3)
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


# -------------------------------------------------------------------------------------------------
# The decode loop (runtime/decode_loop.py): Hugging Face's greedy/sampling algorithm on fixed buffers.


def _eos_mid_generation(model, ids, mask) -> list[int]:
    """EOS ids that greedy decoding emits in every row, first at different steps: the rows finish at
    different steps (finished rows are padded; the loop stops when all are)."""
    with torch.no_grad():
        free = model.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False, eos_token_id=None)
    rows = [row.tolist() for row in free[:, ids.shape[1]:]]
    eos = sorted({rows[0][3], rows[1][1], rows[2][5]})
    stops = [min(row.index(t) for t in eos if t in row) for row in rows]
    assert len(set(stops)) > 1 and max(stops) < 8, f"{rows}: choose other EOS ids for this seed"
    return eos


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_decode_loop_matches_hf_loop(family):
    """Greedy (with left padding, min_new_tokens, an EOS that stops rows at different steps, forced
    BOS/EOS) and sampling (temperature, top-k, top-p, one seed): the tokens of Hugging Face's own loop.
    One layer: the loop's algorithm around the forward is under test."""
    torch.manual_seed(0)
    model = _lm(family, layers=1, initializer_range=0.5).eval()  # not one token repeated: rows finish apart
    ids = torch.randint(3, 97, (3, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    eos = _eos_mid_generation(model, ids, mask)
    cases = [
        dict(max_new_tokens=10, do_sample=False, eos_token_id=eos),
        # held back: the EOS ids that rows 1 and 0 meet at steps 1 and 3
        dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, eos_token_id=eos),
        dict(max_new_tokens=4, do_sample=True, temperature=0.7, top_k=20, top_p=0.9),
        # BART's forced EOS at the last position, mBART's forced BOS at the first
        dict(max_new_tokens=3, do_sample=False, forced_bos_token_id=11, forced_eos_token_id=eos[0]),
    ]
    refs = []
    with torch.no_grad():
        for case in cases:
            torch.manual_seed(1)
            refs.append(model.generate(ids, attention_mask=mask, **case))
        transfuse.optimize(model)
        for case, ref in zip(cases, refs):
            torch.manual_seed(1)
            out = model.generate(ids, attention_mask=mask, **case)
            assert torch.equal(out, ref), case
    assert refs[0].shape[1] < ids.shape[1] + 10, "EOS should have stopped every row early"
    loop = model._transfuse_state.decode_loop
    assert loop.calls == len(cases) and not loop.left_to_hf
    assert "decode loop: 4 call(s)" in transfuse.report(model)
    assert (refs[3][:, -1] == eos[0]).all()  # forced EOS took effect (forced BOS acts at length 1: seq2seq only)


def test_decode_loop_leaves_what_it_does_not_implement_to_hf():
    """A processor that reads the generated ids (repetition penalty) runs Hugging Face's loop, named
    in the report; return_dict_in_generate runs the loop and returns the cache."""
    torch.manual_seed(0)
    model = _lm("llama", layers=1).eval()
    ids = torch.randint(3, 97, (2, 5))
    kwargs = dict(max_new_tokens=3, do_sample=False, repetition_penalty=1.3)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        ref_dict = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        transfuse.optimize(model)
        assert torch.equal(model.generate(ids, **kwargs), ref)
        out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref_dict.sequences)
    assert out.past_key_values.get_seq_length() == ref_dict.past_key_values.get_seq_length()
    text = transfuse.report(model)
    assert "left to Hugging Face's loop x1: logits processor RepetitionPenaltyLogitsProcessor" in text
    cls = type(model)
    transfuse.restore(model)
    assert type(model) is cls.__mro__[1] and type(model).__name__ == cls.__name__


def test_static_cache_decode_shares_one_mask_summary():
    """The static cache's length is a symbolic expression: the mask's block summary must still be
    computed once per forward, not once per layer."""
    torch.manual_seed(0)
    model = _lm("llama").eval()
    transfuse.optimize(model)
    with torch.no_grad():
        model.generate(torch.randint(3, 97, (1, 5)), max_new_tokens=3, do_sample=False)
    graphs = [gm for b in model._transfuse_state.backends for gm in b.graphs]
    counts = [sum(n.target is torch.ops.transfuse.attention_mask_summary.default for n in gm.graph.nodes)
              for gm in graphs]
    assert len(graphs) == 2 and counts == [1, 1], counts


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generate_past_the_model_positions_is_a_clear_error(family):
    model = _lm(family, positions=16, layers=1).eval()
    transfuse.optimize(model)
    ids = torch.randint(3, 97, (1, 12))
    with torch.no_grad(), pytest.raises(ValueError, match="max_new_tokens to at most 4"):
        model.generate(ids, max_new_tokens=10, do_sample=False)
    with torch.no_grad():
        assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 16)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_beam_search_matches_eager(family):
    """Beam search is Hugging Face's loop over transfuse's forward (batch x beams rows in the
    default static cache): the same sequences as eager."""
    torch.manual_seed(0)
    model = _lm(family, initializer_range=0.5).eval()
    ids = torch.randint(3, 97, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=3, num_beams=3, do_sample=False, early_stopping=True)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        transfuse.optimize(model)
        out = model.generate(ids, **kwargs)
    assert torch.equal(out, ref)


def _seq2seq(family, layers=2):
    """Tiny T5 or BART. The CPU tests of what generate() does around the model (traces, caches, the
    decode loop) use one layer each side: a Dynamo trace and the interpreted kernels cost in
    proportion to the layers, and what spans layers (T5's position bias handed from the first to
    the next, one cache per layer) is covered by test_encoder_decoder_families.py at two."""
    common = dict(vocab_size=97, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    if family == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            d_model=32, d_kv=16, d_ff=48, num_layers=layers, num_decoder_layers=layers, num_heads=2, **common))
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        d_model=32, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64, bos_token_id=2, forced_eos_token_id=None,
        **common))


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_encoder_decoder_generate_matches_eager_with_few_traces(family):
    """T5 and BART on the default static cache (one per batch and encoder length) and the decode
    loop: greedy across encoder lengths and lengths of output, sampling under a seed, and beam search
    (Hugging Face's loop) equal eager's, with padding in the encoder input, in a few traces."""
    torch.manual_seed(0)
    model = _seq2seq(family, layers=1).eval()
    calls = []
    for seq, new in [(9, 4), (6, 3)]:
        ids = torch.randint(3, 97, (2, seq))
        mask = torch.ones_like(ids)
        mask[1, seq - 3:] = 0
        calls.append((ids, mask, dict(max_new_tokens=new, do_sample=False)))
    ids, mask, _ = calls[0]
    calls += [(ids, mask, dict(max_new_tokens=5, do_sample=True, top_k=10)),  # another output length too
              (ids, mask, dict(max_new_tokens=3, num_beams=3, do_sample=False))]
    refs = []
    with torch.no_grad():
        for ids, mask, kwargs in calls:
            torch.manual_seed(3)
            refs.append(model.generate(ids, attention_mask=mask, **kwargs))
        transfuse.optimize(model)
        for (ids, mask, kwargs), ref in zip(calls, refs):
            torch.manual_seed(3)
            assert torch.equal(model.generate(ids, attention_mask=mask, **kwargs), ref), kwargs
    state = model._transfuse_state
    assert state.eager_reason is None, state.eager_reason
    assert state.decode_loop.calls == 3 and not state.decode_loop.left_to_hf
    traces = sum(len(b.records) for b in state.backends)
    assert traces <= 4, f"{traces} traces"


def test_generate_inside_then_outside_inference_mode():
    """The reused cache and the decode loop's buffers are written in place by every call: created
    under torch.inference_mode(), they must still take a call made outside it."""
    torch.manual_seed(0)
    model = _lm("llama", layers=1).eval()
    ids = torch.randint(3, 97, (1, 5))
    ref = model.generate(ids, max_new_tokens=3, do_sample=False)  # the prompt and two in-place steps
    transfuse.optimize(model)
    with torch.inference_mode():
        first = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(first, ref) and torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), ref)


def test_encoder_decoder_traces_under_inference_mode():
    """Under torch.inference_mode() Hugging Face's inputs are inference tensors and the decode loop's
    buffers are not; Dynamo guards on that. The loop's first (eager) step feeds its buffers as every
    later step does, and a new batch size's cache is initialized like the reused ones, so each batch
    class costs a prompt and a step trace (plus, once, the first cache's reuse) and repeats cost none."""
    torch.manual_seed(0)
    model = _seq2seq("t5", layers=1).eval()
    transfuse.optimize(model)
    state = model._transfuse_state
    added = []
    with torch.inference_mode():
        for batch in (1, 3):
            ids = torch.randint(3, 97, (batch, 8))
            for _ in range(3):
                before = sum(len(b.records) for b in state.backends)
                model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
                added.append(sum(len(b.records) for b in state.backends) - before)
    assert state.eager_reason is None, state.eager_reason
    assert added == [2, 1, 0, 2, 0, 0], added


def test_encoder_decoder_new_cache_after_a_dtype_change():
    """A new batch size's cache is allocated like a kept one (its heads and head dims) but in the
    model's dtype now: after model.bfloat16() the kept fp32 cache must not set the new one's dtype."""
    import copy

    torch.manual_seed(0)
    model = _seq2seq("t5", layers=1).eval()
    ref = copy.deepcopy(model).bfloat16()
    kwargs = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)
    with torch.no_grad():
        transfuse.optimize(model)
        model.generate(torch.randint(3, 97, (1, 8)), **kwargs)  # a kept fp32 cache
        model.bfloat16()
        ids = torch.randint(3, 97, (3, 8))
        out = model.generate(ids, **kwargs)
        expected = ref.generate(ids, **kwargs)
    caches = model._transfuse_state.static_cache.caches
    assert all(layer.keys.dtype == torch.bfloat16 for (batch, *_), (cache, _) in caches.items() if batch == 3
               for part in (cache.self_attention_cache, cache.cross_attention_cache) for layer in part.layers)
    assert torch.equal(out, expected)


def test_latent_attention_cache_keeps_two_head_dims():
    """DeepSeek-V3's latent attention caches keys (head dim 24 here, 192 in the model) and values (16;
    128) of different head dims: generate()'s default static cache is written by the fused cache
    write and read by transfuse's attention in the prompt and the decode graph, and the tokens are
    eager's (left padding). One dense layer: the cache, not the experts, is under test."""
    config = transformers.DeepseekV3Config(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, max_position_embeddings=64, vocab_size=97, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    ids = torch.randint(3, 97, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        transfuse.optimize(model)
        out = model.generate(ids, **kwargs)
    assert torch.equal(out, ref)
    rewrites = rewrite_counts(model)
    assert rewrites["KVCacheWrite"] == 2 and rewrites["TorchSDPA"] == 2, rewrites


def test_a_batch_of_one_after_larger_batches_traces_nothing_more():
    """Llama's rotary embedding multiplies an expanded (batch, dim / 2, 1) by the position ids:
    matmul's decomposition, run on fake tensors while Dynamo traces, asked whether the batch is 1, and
    a model traced at batch 3 traced its prompt and its decode step again at batch 1 (tracing_matmul.py).
    Tokens equal eager's at every batch; the two traces serve them all."""
    torch.manual_seed(0)
    model = _lm("llama", layers=1).eval()
    batches = [torch.randint(3, 97, (b, 5)) for b in (3, 1, 2)]
    with torch.no_grad():
        refs = [model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
                for ids in batches]
        transfuse.optimize(model)
        for ids, ref in zip(batches, refs):
            assert torch.equal(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                                              do_sample=False), ref)
    traces = sum(len(b.records) for b in model._transfuse_state.backends)
    assert traces == 2, f"{traces} traces: the prompt's and the decode step's, whatever the batch"
