"""Decoder families on the GPU: Llama prefill through optimize() within fp16's own error, RMSNorm
rewritten; generate() equal to eager, with the dynamic and the static cache, through the decode
loop's CUDA graphs, for sliding windows and for families whose graphs once broke capture."""

import copy

import pytest
import torch
import transformers

import transfuse
from tests.helpers import graph_records, rel_err

pytestmark = pytest.mark.gpu


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                   intermediate_size=688, vocab_size=1000, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).cuda().eval()


@pytest.mark.parametrize("batch,seq", [(2, 37), (1, 100), (4, 128)])
def test_llama_prefill_fp16_within_torch_error(batch, seq):
    model32 = _llama()
    model16 = copy.deepcopy(model32).half()
    opt = transfuse.optimize(copy.deepcopy(model16))
    ids = torch.randint(0, 1000, (batch, seq), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        ref = model32(input_ids=ids, attention_mask=mask, use_cache=False).logits
        eager = model16(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out = opt(input_ids=ids, attention_mask=mask, use_cache=False).logits
    keep = mask.bool()
    err, torch_err = rel_err(out[keep], ref[keep]), rel_err(eager[keep], ref[keep])
    assert err <= 2 * torch_err + 1e-4, f"{err:.2e} vs torch {torch_err:.2e}"
    assert "RMSNorm" in transfuse.report(opt)


@pytest.mark.parametrize("cache", [None, "static"])
def test_generate_equals_eager(cache):
    """With a static cache the decode step writes the cache in place inside a CUDA graph (the
    runner reads it at its own address); twice in a row, so the second generate reuses graphs."""
    model = _llama().float()
    ids = torch.randint(0, 1000, (2, 9), device="cuda")
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, cache_implementation=cache)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        opt = transfuse.optimize(copy.deepcopy(model))
        for _ in range(2):
            out = opt.generate(ids, **kwargs)
            assert torch.equal(out, ref)


def test_decode_loop_graphs_match_hf_loop():
    """transfuse's decode loop with each step replayed as a CUDA graph: Hugging Face's tokens for
    greedy (left padding, EOS ending rows at different steps) across calls that change batch size
    and length (new buffers, a longer cache), and sampling reproducible under one seed."""
    model = _llama().float()
    for p in model.parameters():  # a less flat model: rows hit EOS at different steps
        p.data.mul_(3.0)
    opt = transfuse.optimize(copy.deepcopy(model))
    torch.manual_seed(0)
    calls = [(2, 9, 16), (3, 5, 40), (2, 9, 16), (2, 7, 300)]
    with torch.no_grad():
        for batch, seq, new in calls:
            ids = torch.randint(0, 1000, (batch, seq), device="cuda")
            mask = torch.ones_like(ids)
            mask[0, :2] = 0
            free = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None)
            eos = sorted({int(free[0, seq + new // 2]), int(free[-1, seq + new // 3])})
            kwargs = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=0)
            ref = model.generate(ids, **kwargs)
            out = opt.generate(ids, **kwargs)
            assert torch.equal(out, ref), (batch, seq, new)
        ids = torch.randint(0, 1000, (2, 9), device="cuda")
        sample = dict(max_new_tokens=24, do_sample=True, top_k=50, top_p=0.95, temperature=0.8, pad_token_id=0)
        runs = []
        for _ in range(3):
            torch.manual_seed(5)
            runs.append(opt.generate(ids, **sample))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[1], runs[2])
    loop = opt._transfuse_state.decode_loop
    assert loop.steps_replayed > 100 and loop.captures >= 3 and not loop.left_to_hf, transfuse.report(opt)
    assert all(e.no_graph_reason is None for e in loop.entries.values()), transfuse.report(opt)


def test_sampling_that_stops_early_leaves_eager_generator_state():
    """Rows that all choose EOS long before max_new_tokens: the loop runs a few steps past the end
    (it looks at "all finished" every few steps), and those steps draw random numbers Hugging Face's
    loop never draws. The generator must end where eager's does, and the tokens equal eager's."""
    model = _llama().float()
    opt = transfuse.optimize(copy.deepcopy(model))
    ids = torch.randint(0, 1000, (2, 9), device="cuda")
    # Half the vocabulary ends a row: every row is done within a few sampled tokens.
    gen = dict(attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=True, top_k=50,
               eos_token_id=list(range(0, 1000, 2)), pad_token_id=1)
    with torch.no_grad():
        for seed in range(4):  # the first call of a key runs its step eagerly, later ones replay
            torch.manual_seed(seed)
            ref = model.generate(ids, **gen)
            ref_state = torch.cuda.get_rng_state()
            torch.manual_seed(seed)
            out = opt.generate(ids, **gen)
            assert torch.equal(out, ref), seed
            assert ref.shape[1] < 9 + 40, "no row stopped early: the test checks nothing"
            assert torch.equal(torch.cuda.get_rng_state(), ref_state), seed
    loop = opt._transfuse_state.decode_loop
    assert loop.steps_discarded > 0 and loop.steps_replayed > 0, transfuse.report(opt)


def _generate_equals_eager(model, batch: int, seq: int, left_pad: tuple[int, int], new_tokens, **gen):
    """Greedy generate() of an fp32 copy through optimize() equals eager's, for each count of new
    tokens in turn (later calls reuse the graphs and cache of earlier ones); row left_pad[0] is
    left-padded by left_pad[1] positions. Returns the optimized model."""
    model = model.cuda().float().eval()
    opt = transfuse.optimize(copy.deepcopy(model))
    ids = torch.randint(3, model.config.vocab_size, (batch, seq), device="cuda")
    mask = torch.ones_like(ids)
    mask[left_pad[0], :left_pad[1]] = 0
    with torch.no_grad():
        for new in new_tokens:
            ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **gen)
            out = opt.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **gen)
            assert torch.equal(out, ref), (new, transfuse.report(opt))
    return opt


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_window_generate_equals_eager(family):
    """A sliding window shorter than the generation, on generate()'s default static cache (its
    windowed layers given the full length, the window kept by Hugging Face's mask): eager's tokens
    over two calls with left padding, and no trace per decode step."""
    torch.manual_seed(0)
    common = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                  intermediate_size=688, vocab_size=1000, max_position_embeddings=512, sliding_window=16)
    if family == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(head_dim=32, **common))
    else:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    opt = _generate_equals_eager(model, batch=2, seq=21, left_pad=(0, 4), new_tokens=(40, 24))
    assert sum(len(b.records) for b in opt._transfuse_state.backends) <= 3, transfuse.report(opt)


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_encoder_decoder_decode_loop_graphs_match_eager(family):
    """T5/BART on the GPU: the decode loop's steps replayed as CUDA graphs (cross-attention K/V read
    from the static cache), greedy equal to eager across two encoder lengths, twice each."""
    from tests.models.test_generate import _seq2seq

    torch.manual_seed(0)
    model = _seq2seq(family).cuda().eval()
    opt = transfuse.optimize(copy.deepcopy(model))
    with torch.no_grad():
        for seq in (9, 13, 9, 13):
            ids = torch.randint(3, 97, (2, seq), device="cuda")
            mask = torch.ones_like(ids)
            mask[1, seq - 3:] = 0
            kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
            assert torch.equal(opt.generate(ids, **kwargs), model.generate(ids, **kwargs)), seq
    loop = opt._transfuse_state.decode_loop
    assert loop.captures == 2 and loop.steps_replayed > 30, transfuse.report(opt)
    assert all(e.no_graph_reason is None for e in loop.entries.values()), transfuse.report(opt)


@pytest.mark.parametrize("family", ["falcon", "falcon_mq", "gpt_neo"])
def test_generate_with_graphs_equals_eager(family):
    """Families whose graphs once broke capture or compilation on the GPU (found by
    bench/family_sweep.py): Falcon indexes its key/value heads with a Python list (a host copy per
    call, refused by CUDA graph capture); GPT-Neo's generate() raised in the backend on a
    data-dependent size. Eager's tokens, with the decode step replayed from a graph where the loop runs."""
    torch.manual_seed(0)
    if family.startswith("falcon"):
        extra = (dict(new_decoder_architecture=True, num_kv_heads=2, num_attention_heads=4) if family == "falcon"
                 else dict(multi_query=True, parallel_attn=True, num_attention_heads=4))
        cfg = transformers.FalconConfig(hidden_size=128, num_hidden_layers=2, alibi=False, vocab_size=1000,
                                        max_position_embeddings=512, **extra)
        model = transformers.FalconForCausalLM(cfg)
    else:
        cfg = transformers.GPTNeoConfig(hidden_size=128, num_layers=2, num_heads=4, vocab_size=1000,
                                        max_position_embeddings=512, attention_types=[[["global", "local"], 1]],
                                        window_size=8)
        model = transformers.GPTNeoForCausalLM(cfg)
    opt = _generate_equals_eager(model, batch=3, seq=13, left_pad=(1, 3), new_tokens=(12, 20), pad_token_id=0)
    loop = opt._transfuse_state.decode_loop
    if loop is not None and loop.calls:
        assert all(e.no_graph_reason is None for e in loop.entries.values()), transfuse.report(opt)


def test_prophetnet_generate_with_graphs_equals_eager():
    """ProphetNet builds its relative positions on the CPU and copies them to the GPU in every
    decoder layer (found by bench/family_sweep.py: CUDA graph capture refused the copy and
    generate() raised). The passes build them on the GPU: eager's tokens, and no graph left out of
    CUDA graphs for a host copy."""
    torch.manual_seed(0)
    config = transformers.ProphetNetConfig(
        vocab_size=1000, hidden_size=64, encoder_ffn_dim=128, decoder_ffn_dim=128, num_encoder_layers=2,
        num_decoder_layers=2, num_encoder_attention_heads=4, num_decoder_attention_heads=4, ngram=2,
        max_position_embeddings=128, num_buckets=8, relative_max_distance=16,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, decoder_start_token_id=0)
    model = transformers.ProphetNetForConditionalGeneration(config)
    opt = _generate_equals_eager(model, batch=3, seq=13, left_pad=(1, 3), new_tokens=(6, 10))
    records = graph_records(opt)
    assert records and not any(j.pattern == "CudaGraphs" for r in records for j in r.rejections), \
        transfuse.report(opt)
    assert sum(r.cuda_graphs for r in records) >= len(records) // 2, transfuse.report(opt)


def test_llama4_chunked_attention_generates_on_the_static_cache_with_graphs():
    """Llama 4's chunked attention on the default static cache (transfuse builds generate()'s masks,
    runtime/generate_masks.py): eager's tokens past several chunk borders, the decode steps replayed
    from CUDA graphs, and no graph left out of CUDA graphs for a host copy (the H200 sweep's report
    showed four such graphs on 61675c6)."""
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, intermediate_size_mlp=96, vocab_size=1000, num_local_experts=2, num_experts_per_tok=1,
        attention_chunk_size=8, no_rope_layers=[1, 0], use_qk_norm=True, interleave_moe_layer_step=2,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.Llama4ForCausalLM(config)
    opt = _generate_equals_eager(model, batch=3, seq=13, left_pad=(1, 3), new_tokens=(6, 20))
    loop = opt._transfuse_state.decode_loop
    assert loop.steps_replayed > 0 and not loop.left_to_hf, transfuse.report(opt)
    records = graph_records(opt)
    assert not any(j.pattern == "CudaGraphs" for r in records for j in r.rejections), transfuse.report(opt)


def _phimoe():
    return transformers.PhimoeForCausalLM(transformers.PhimoeConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        vocab_size=1000, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256, sliding_window=8))


def _gemma2():
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, vocab_size=1000, max_position_embeddings=256, sliding_window=8))


@pytest.mark.parametrize("build", [_gemma2, _phimoe], ids=["gemma2", "phimoe"])
def test_forwards_that_build_host_tensors_keep_cuda_graphs(build):
    """Plain forwards (a dynamic cache made in the graph) of a sliding-window family, whose cache
    layer makes torch.tensor(window) on the CPU, and of Phi-MoE, whose rotary embedding computes its
    frequencies on the CPU at every call: the host chains are folded (passes/host_tensors.py), every
    graph runs as a CUDA graph, and the logits equal eager's within fp32's error (the H200 sweep of
    0aac72a showed 4 and 13 graphs left without CUDA graphs)."""
    torch.manual_seed(0)
    model = build().cuda().eval()
    opt = transfuse.optimize(copy.deepcopy(model))
    for seq in (13, 37, 37):
        ids = torch.randint(3, 1000, (2, seq), device="cuda")
        with torch.no_grad():
            want, got = model(input_ids=ids).logits, opt(input_ids=ids).logits
        assert rel_err(got, want) < 1e-4, seq
    records = graph_records(opt)
    assert records and not any(j.pattern == "CudaGraphs" for r in records for j in r.rejections), transfuse.report(opt)
