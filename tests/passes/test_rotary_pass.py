"""The rotary pass matches rotate-half RoPE by meaning, partial rotary included, and gives eager's
logits; bf16 x with fp32 tables (autocast) gives eager's fp32 result; other mixes of dtypes are
left alone with the reason."""

import torch
import transformers

import transfuse
from tests.helpers import rel_err
from transfuse.reference.rotary import rotate_half


def test_partial_rotary_phi3_matches_eager():
    config = transformers.Phi3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=96, max_position_embeddings=64, vocab_size=97,
                                     partial_rotary_factor=0.5, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config).eval()
    ids = torch.randint(3, 97, (2, 7))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        transfuse.optimize(model)
        out = model(input_ids=ids).logits
    assert rel_err(out, ref) < 1e-5
    assert model._transfuse_state.backend.records[0].rewrites["RotaryEmbedding"] == 2


class _Rope(torch.nn.Module):
    def forward(self, x, cos, sin):
        return x * cos + rotate_half(x) * sin


def _eager_then_optimized(model, table_dtype=torch.float32):
    """(eager's output, ours) for bf16 x and tables of table_dtype."""
    torch.manual_seed(0)
    x = torch.randn(1, 2, 5, 16).to(torch.bfloat16)
    cos, sin = torch.randn(1, 1, 5, 16).to(table_dtype), torch.randn(1, 1, 5, 16).to(table_dtype)
    ref = model(x, cos, sin)
    transfuse.optimize(model, dynamic=False)  # a static head dim, as a model's weights make it
    return ref, model(x, cos, sin)


def test_rotary_promoted_by_fp32_tables_is_fused_in_fp32():
    """bf16 x, fp32 cos/sin (Hugging Face's tables under autocast): eager's result is fp32, and so is ours."""
    model = _Rope().eval()
    ref, out = _eager_then_optimized(model)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert model._transfuse_state.backend.records[0].rewrites["RotaryEmbedding"] == 1


class _RopeCastBack(torch.nn.Module):
    def forward(self, x, cos, sin):
        return (x * cos + rotate_half(x) * sin).to(x.dtype) * 2.0


def test_promoted_rotary_read_only_by_a_cast_back_writes_x_dtype():
    model = _RopeCastBack().eval()
    ref, out = _eager_then_optimized(model)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=8e-3, atol=1e-5)
    graph = model._transfuse_state.backend.graphs[0].graph
    rotary = [n for n in graph.nodes if n.target is torch.ops.transfuse.rotary.default]
    assert len(rotary) == 1 and rotary[0].args[3] == torch.bfloat16
    assert not [n for n in graph.nodes if n.op == "call_method" and n.target == "to"]  # the cast is gone


def test_rotary_with_other_dtype_mixes_is_left_alone():
    model = _Rope().eval()
    ref, out = _eager_then_optimized(model, torch.float16)
    assert torch.equal(out, ref)
    assert "RotaryEmbedding" in transfuse.report(model) and "dtypes differ" in transfuse.report(model)
