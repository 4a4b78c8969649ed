"""Gated MLPs: silu(x @ W_gate^T) * (x @ W_up^T) -> one transfuse.linear with the silu_mul epilogue
(SiblingLinears merges the two projections first); other gates are left alone with a reason."""

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
        elif s == "gelu_tanh":  # Gemma's GeGLU: no fused kernel
            h = F.gelu(self.gate(x), approximate="tanh") * self.up(x)
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


@pytest.mark.parametrize("style, reason", [
    ("gelu_tanh", "not SiLU"),
    ("up_first", "gate projection comes after the up projection"),
])
def test_other_gates_left_alone_with_reason(style, reason):
    out, ref, rewrites, rejections = _run(style)
    assert rewrites["SwiGLU"] == 0
    assert any(r.pattern == "SwiGLU" and reason in r.reason for r in rejections), rejections
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
