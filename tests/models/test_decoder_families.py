"""Decoder families through optimize() on the CPU (interpreter): logits equal to eager, generate()
equal to eager with a left-padded batch in one trace for the prompt and one for every decode step,
and the golden number of matches each pass makes on the prompt's trace. Tiny configs: 2 layers, hidden 32, 2 heads of 16 (1 KV head where the family has
GQA): every kernel under the interpreter costs in proportion to its programs and block steps, so
the models are as small as the families' code paths allow (the head dim stays 16)."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
import transformers

import transfuse
from tests.helpers import rel_err

COMMON = dict(vocab_size=97, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA_LIKE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  intermediate_size=48, max_position_embeddings=64, **COMMON)

# family -> (config class, model class, config, golden rewrites of the prompt's trace). EmptyCat: the
# DynamicCache's first append of each layer's keys and values (torch.cat with an empty tensor)
FAMILIES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=2, n_positions=64, **COMMON),
             {"EmptyCat": 4, "Conv1D": 8, "TorchSDPA": 2, "LinearEpilogue": 9, "ResidualLayerNorm": 4, "LayerNorm": 1, "EvalDropout": 5,
              "LayerNormLinear": 4}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA_LIKE,
              {"EmptyCat": 4, "TorchSDPA": 2, "GroupedKV": 2, "RotaryTable": 1, "RotaryEmbedding": 4, "RotaryPair": 2, "SiblingLinears": 4, "SwiGLU": 2, "LinearEpilogue": 7, "RMSNorm": 1, "ResidualRMSNorm": 4, "RMSNormLinear": 4}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(LLAMA_LIKE, sliding_window=4),
                {"EmptyCat": 4, "TorchSDPA": 2, "GroupedKV": 2, "RotaryTable": 1, "RotaryEmbedding": 4, "RotaryPair": 2, "SiblingLinears": 4, "SwiGLU": 2, "LinearEpilogue": 7, "RMSNorm": 1, "ResidualRMSNorm": 4, "RMSNormLinear": 4}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", LLAMA_LIKE,  # bias on Q, K, V
              {"EmptyCat": 4, "TorchSDPA": 2, "GroupedKV": 2, "RotaryTable": 1, "RotaryEmbedding": 4, "RotaryPair": 2, "SiblingLinears": 4, "SwiGLU": 2, "LinearEpilogue": 7, "RMSNorm": 1, "ResidualRMSNorm": 4, "RMSNormLinear": 4}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(LLAMA_LIKE, head_dim=16),  # GeGLU (tanh GELU)
              {"EmptyCat": 4, "TorchSDPA": 2, "GroupedKV": 2, "RotaryTable": 1, "RotaryEmbedding": 4, "RotaryPair": 2, "SiblingLinears": 4, "GeGLU": 2, "LinearEpilogue": 7, "RMSNorm": 1, "ResidualRMSNorm": 4, "RMSNormLinear": 4}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", LLAMA_LIKE,  # fused qkv_proj and gate_up_proj, chunked
             {"EmptyCat": 4, "TorchSDPA": 2, "GroupedKV": 2, "RotaryTable": 1, "RotaryEmbedding": 4, "RotaryPair": 2, "SwiGLU": 2, "LinearEpilogue": 7, "RMSNorm": 1, "ResidualRMSNorm": 4, "EvalDropout": 4, "RMSNormLinear": 4}),
}
# family -> the cache and rotary matches of a decode step's trace (generate() on the default static
# cache). Mistral's sliding-window layers get a full-length static layer (runtime/generation.py), so
# its step writes the cache as Llama's does; Phi-3 concatenates its (here empty) pass-through half
# onto the rotated keys, so no rotary_pair output reaches the write. QKVRotaryCache: the norm + QKV
# GEMV that feeds the rotary write takes it into its epilogue. RotaryCacheAttention / KVCacheAttention:
# that write (or a plain one) and the attention reading the cache are one op (the decode attention
# kernel writes the cache; with a rotary write, from 3 rows up).
_CACHE = ("RotaryPair", "KVCacheWrite", "RotaryCacheWrite", "QKVRotaryCache", "CacheLengths", "RotaryCacheAttention",
          "KVCacheAttention")
DECODE_GOLDEN = {
    "gpt2": (0, 2, 0, 0, 2, 0, 2), "llama": (2, 2, 2, 2, 2, 2, 0), "mistral": (2, 2, 2, 2, 2, 2, 0),
    "qwen2": (2, 2, 2, 2, 2, 2, 0), "gemma": (2, 2, 2, 2, 2, 2, 0), "phi3": (2, 2, 0, 0, 2, 0, 2),
}


def _build(family):
    config_cls, model_cls, config, _ = FAMILIES[family]
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config)).eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_logits_generate_and_matches(family):
    model = _build(family)
    ids = torch.randint(3, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
    with torch.no_grad():
        ref_logits = model(input_ids=ids, attention_mask=mask).logits
        ref = model.generate(ids, **kwargs)
        transfuse.optimize(model)
        logits = model(input_ids=ids, attention_mask=mask).logits
        out = model.generate(ids, **kwargs)
    keep = mask.bool()
    assert rel_err(logits[keep], ref_logits[keep]) < 1e-5
    assert torch.equal(out, ref)
    first = model._transfuse_state.backend.records[0].rewrites
    assert dict(first) == FAMILIES[family][3]
    step = model._transfuse_state.backend.records[-1].rewrites
    assert tuple(step.get(name, 0) for name in _CACHE) == DECODE_GOLDEN[family]
    # the KV cache's length is a dynamic dimension: the two decode steps share one trace
    traces = sum(len(b.records) for b in model._transfuse_state.backends)
    assert traces == 3, f"{traces} traces: the forward's, the prompt's and one for every decode step"
    text = transfuse.report(model)
    assert "TorchSDPA" in text and "key and value lengths differ" not in text


class NanoGPTBlock(torch.nn.Module):
    """Attention as nanoGPT writes it by hand: one c_attn, split, masked_fill(-inf), softmax."""

    def __init__(self, n=32, heads=2, seq=32):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(n), torch.nn.LayerNorm(n)
        self.c_attn, self.c_proj = torch.nn.Linear(n, 3 * n), torch.nn.Linear(n, n)
        self.fc, self.proj = torch.nn.Linear(n, 4 * n), torch.nn.Linear(4 * n, n)
        self.register_buffer("bias", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.c_proj(y)
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


def test_nanogpt_hand_written_attention():
    torch.manual_seed(0)
    model = torch.nn.Sequential(NanoGPTBlock(), NanoGPTBlock()).eval()
    x = torch.randn(2, 13, 32)
    with torch.no_grad():
        ref = model(x)
        transfuse.optimize(model)
        out = model(x)
    assert rel_err(out, ref) < 1e-5
    rewrites = model._transfuse_state.backend.records[0].rewrites
    assert rewrites["ManualAttention"] == 2 and rewrites["LinearEpilogue"] == 8


def test_retrace_every_step_hands_the_model_back_to_eager():
    """Hugging Face's own sliding-window static cache (one the user passes) keeps a Python int
    position counter that Dynamo specialises on, so every decode step is a new trace: past max_traces
    the model runs as it was, still right, and the report names the guard. One layer: the counter is
    the cache's, not a layer's."""
    config_cls, model_cls, config, _ = FAMILIES["mistral"]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**dict(config, num_hidden_layers=1))).eval()
    ids = torch.randint(3, 97, (2, 9))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    cache = lambda: transformers.StaticCache(config=model.config, max_cache_len=32)  # noqa: E731
    with torch.no_grad():
        ref = model.generate(ids, past_key_values=cache(), **kwargs)
        transfuse.optimize(model, max_traces=3)
        out = model.generate(ids, past_key_values=cache(), **kwargs)
    assert torch.equal(out, ref)
    assert sum(len(b.records) for b in model._transfuse_state.backends) == 4
    text = transfuse.report(model)
    assert "left to eager: traced 4 times" in text and "cumulative_length" in text


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_window_default_cache_traces_once(family):
    """A sliding window shorter than prompt + new tokens, on generate()'s default static cache: eager's
    tokens (left padding, two calls of other lengths), one trace for the prompt and one for every
    decode step (Hugging Face's windowed static layer made a trace per step), the window kept by the
    mask. Gemma2 alternates sliding and full layers."""
    if family == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**dict(LLAMA_LIKE, head_dim=16, sliding_window=4)))
    else:
        model = _build("mistral")
    torch.manual_seed(0)
    for p in model.parameters():  # spread logits: no near-ties between the first two candidates
        torch.nn.init.normal_(p, std=0.3)
    model.eval()
    ids = torch.randint(3, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cases = [dict(max_new_tokens=4), dict(max_new_tokens=3)]
    with torch.no_grad():
        refs = [model.generate(ids, attention_mask=mask, do_sample=False, **c) for c in cases]
        transfuse.optimize(model)
        outs = [model.generate(ids, attention_mask=mask, do_sample=False, **c) for c in cases]
    for out, ref in zip(outs, refs):
        assert torch.equal(out, ref)
    assert sum(len(b.records) for b in model._transfuse_state.backends) == 2
    assert "sliding-window layer(s) keep every position" in transfuse.report(model)


def test_bloom_generate_when_the_cache_is_shorter_than_the_rounded_length(monkeypatch):
    """BLOOM pads the step's 2-D mask to exactly the static cache's length, so the decode loop's
    mask may not be longer than the cache. Caches grow in LENGTH_BUCKET steps and the loop's
    buffers in powers of two: with a small bucket a 15-token call gets a 16-position cache, and a
    64-position mask once made BLOOM's padding negative (seen at a 1030-token prompt on the GPU)."""
    from transfuse.runtime import generation

    monkeypatch.setattr(generation, "LENGTH_BUCKET", 8)
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=2, **COMMON)
    model = transformers.BloomForCausalLM(cfg).eval()
    opt = transfuse.optimize(copy.deepcopy(model))
    ids = torch.randint(3, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    gen = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = model.generate(ids, **gen)
        got = opt.generate(ids, **gen)
    assert torch.equal(got, want)
    loop = opt._transfuse_state.decode_loop
    assert loop.calls == 1 and not loop.left_to_hf, transfuse.report(opt)
    (entry,) = loop.entries.values()
    assert entry.buffers.mask.shape[1] == 16, entry.buffers.mask.shape
