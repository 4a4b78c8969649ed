"""Gated MLPs: act(x @ W_gate^T) * (x @ W_up^T) -> one transfuse.linear with the "<act>_mul" epilogue
(SiblingLinears merges the two projections first) for SiLU (SwiGLU), exact and tanh GELU (GeGLU) and
ReLU (ReGLU), recognised by value, however written; other gates are left alone with a reason."""

import math

import pytest
import torch
import torch.nn.functional as F
import transformers

from tests.helpers import eager_then_optimized, optimize_and_run, rel_err


class GatedMLP(torch.nn.Module):
    def __init__(self, style: str, n: int = 24, hidden: int = 40, bias: bool = False):
        super().__init__()
        self.style = style
        self.gate = torch.nn.Linear(n, hidden, bias=bias)
        self.up = torch.nn.Linear(n, hidden, bias=bias)
        self.down = torch.nn.Linear(hidden, n, bias=bias)

    def forward(self, x):
        s = self.style
        if s == "silu":  # Llama / Mistral / Qwen2 MLP
            h = F.silu(self.gate(x)) * self.up(x)
        elif s == "sigmoid_written":  # nanoGPT-style hand-written SiLU, product the other way round
            g = self.gate(x)
            h = self.up(x) * (g * torch.sigmoid(g))
        elif s == "up_first":  # the up projection is computed first: merged as [up; gate]
            u = self.up(x)
            h = u * F.silu(self.gate(x))
        elif s == "gelu_tanh":  # Gemma's GeGLU
            h = F.gelu(self.gate(x), approximate="tanh") * self.up(x)
        elif s == "gelu_tanh_written":  # T5 v1.1's NewGELUActivation on wi_0, times wi_1
            g = self.gate(x)
            h = 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * torch.pow(g, 3.0)))) * self.up(x)
        elif s == "gelu":  # GeGLU with exact GELU
            h = F.gelu(self.gate(x)) * self.up(x)
        elif s == "relu":  # ReGLU
            h = torch.relu(self.gate(x)) * self.up(x)
        elif s == "tanh":  # not a gate the kernels fuse
            h = torch.tanh(self.gate(x)) * self.up(x)
        return self.down(h)


def _run(style, bias=False):
    torch.manual_seed(0)
    model = GatedMLP(style, bias=bias).eval()
    x = torch.randn(3, 5, 24)
    ref, out, rewrites, rejections = eager_then_optimized(model, x)
    return out, ref, rewrites, rejections


@pytest.mark.parametrize("style", ["silu", "sigmoid_written"])
@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_fused(style, bias):
    out, ref, rewrites, _ = _run(style, bias)
    assert rewrites["SwiGLU"] == 1 and rewrites["SiblingLinears"] == 1
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("style, name", [("gelu_tanh", "GeGLU"), ("gelu_tanh_written", "GeGLU"), ("gelu", "GeGLU"),
                                         ("relu", "ReGLU")])
@pytest.mark.parametrize("bias", [False, True])
def test_other_gated_units_fused(style, name, bias):
    out, ref, rewrites, _ = _run(style, bias)
    assert rewrites[name] == 1 and rewrites["SiblingLinears"] == 1 and rewrites["SwiGLU"] == 0
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("style, reason", [
    ("tanh", "activation is tanh"),
    ("up_first", "gate projection comes after the up projection"),
])
def test_other_gates_left_alone_with_reason(style, reason):
    out, ref, rewrites, rejections = _run(style)
    assert rewrites["SwiGLU"] == 0 and rewrites["GeGLU"] == 0
    assert any(r.pattern == "GatedLinearUnit" and reason in r.reason for r in rejections), rejections
    assert rel_err(out, ref) < 1e-5


def test_llama_mlp_fused_and_equal_to_eager():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96, max_position_embeddings=64, vocab_size=97)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 97, (2, 7))
    with torch.no_grad():
        ref = model(ids).logits
    out, rewrites, _ = optimize_and_run(model, ids)
    assert rewrites["SwiGLU"] == 2 and rewrites["LinearEpilogue"] == 7  # per layer: QKV, o, down; lm_head
    assert rel_err(out.logits, ref) < 1e-5


@pytest.mark.parametrize("family", ["gemma", "t5"])
def test_geglu_models_fused_and_equal_to_eager(family):
    # Gemma's MLP (gelu_pytorch_tanh) and T5 v1.1's gated-gelu (NewGELUActivation on wi_0, times wi_1)
    torch.manual_seed(0)
    if family == "gemma":
        cfg = transformers.GemmaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=16, intermediate_size=96, max_position_embeddings=64, vocab_size=97)
        model = transformers.GemmaForCausalLM(cfg).eval()
        args = dict(input_ids=torch.randint(3, 97, (2, 7)))
    else:
        cfg = transformers.T5Config(vocab_size=97, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4,
                                    feed_forward_proj="gated-gelu", decoder_start_token_id=0)
        model = transformers.T5ForConditionalGeneration(cfg).eval()
        args = dict(input_ids=torch.randint(3, 97, (2, 7)), decoder_input_ids=torch.randint(3, 97, (2, 5)))
    with torch.no_grad():
        ref = model(**args).logits
    out, rewrites, _ = optimize_and_run(model, **args)
    assert rewrites["GeGLU"] == (2 if family == "gemma" else 4)  # T5: 2 encoder + 2 decoder blocks
    assert rel_err(out.logits, ref) < 1e-5
