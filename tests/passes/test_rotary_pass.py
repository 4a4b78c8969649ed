"""The rotary pass matches rotate-half RoPE by meaning, partial rotary included, and gives eager's
logits; a cos/sin in another dtype than x (eager promotes) is left alone with the reason."""

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


def test_rotary_with_promoting_dtypes_is_left_alone():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 5, 16).to(torch.bfloat16)
    cos, sin = torch.randn(1, 1, 5, 16), torch.randn(1, 1, 5, 16)
    model = _Rope().eval()
    ref = model(x, cos, sin)
    transfuse.optimize(model, dynamic=False)  # a static head dim, as a model's weights make it
    assert torch.equal(model(x, cos, sin), ref)
    assert "RotaryEmbedding" in transfuse.report(model) and "eager promotes" in transfuse.report(model)
