"""The rotary_table pass turns Hugging Face's cos/sin table computation into one transfuse.rotary_table
per graph (prompt and decode step), with eager's logits and tokens, for the default RoPE, YaRN's
attention scaling, dynamic RoPE (which breaks the graph to update inv_freq), Gemma's head dim and a
bf16 model; and leaves alone, with the reason, tables written some other way."""

import pytest
import torch
import transformers

import transfuse
from tests.helpers import rel_err
from tests.models.test_decoder_families import LLAMA_LIKE

PATTERN = "RotaryTable"
ONE_LAYER = dict(LLAMA_LIKE, num_hidden_layers=1)  # the table is computed once per forward, not per layer


def _records(model):
    return model._transfuse_state.backend.records


def _rejections(model):
    return [r for record in _records(model) for r in record.rejections if r.pattern == PATTERN]


def _table_nodes(model) -> int:
    return sum(str(n.target) == "transfuse.rotary_table.default"
               for gm in model._transfuse_state.backend.graphs for n in gm.graph.nodes)


def test_llama_prompt_and_decode_step():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**ONE_LAYER)).eval()
    ids = torch.randint(3, 97, (2, 7))
    with torch.no_grad():
        ref_logits = model(input_ids=ids).logits
        ref_tokens = model.generate(ids, max_new_tokens=3, do_sample=False)
        transfuse.optimize(model)
        logits = model(input_ids=ids).logits
        tokens = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert rel_err(logits, ref_logits) < 1e-5
    assert torch.equal(tokens, ref_tokens)
    records = _records(model)
    assert len(records) >= 2  # the prompt's trace and a decode step's
    assert all(r.rewrites.get(PATTERN) == 1 for r in records)
    assert _table_nodes(model) == len(records) and not _rejections(model)


@pytest.mark.parametrize("variant", ["yarn", "dynamic", "gemma", "bf16"])
def test_variants_match_and_equal_eager(variant):
    """YaRN: attention_scaling = 0.1 ln(4) + 1 multiplies the tables. Dynamic RoPE: inv_freq updated
    in Python before the table (a graph break; the table is matched in the graph after it). Gemma with
    head dim 24: a half of 12. bf16: the buffer is bf16 too, widened by HF's .float(); the tables
    are bf16 and the same bits as the pass left out."""
    torch.manual_seed(0)
    if variant == "gemma":
        config = transformers.GemmaConfig(**dict(ONE_LAYER, head_dim=24))
        model = transformers.GemmaForCausalLM(config)
    else:
        extra = {}
        if variant in ("yarn", "dynamic"):
            extra["rope_parameters"] = {"rope_type": variant, "factor": 4.0, "rope_theta": 10000.0,
                                        "original_max_position_embeddings": 16}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(ONE_LAYER, **extra)))
    model = model.eval().to(torch.bfloat16 if variant == "bf16" else torch.float32)
    if variant == "yarn":
        assert model.model.rotary_emb.attention_scaling != 1.0
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        transfuse.optimize(model)
        out = model(input_ids=ids).logits
    if variant == "bf16":
        # against the same transfuse graph without this pass: the tables it feeds are bit for bit eager's
        twin = transformers.LlamaForCausalLM(model.config).eval().to(torch.bfloat16)
        twin.load_state_dict(model.state_dict())
        transfuse.optimize(twin, disable=("rotary_table",))
        with torch.no_grad():
            assert torch.equal(out, twin(input_ids=ids).logits)
        assert rel_err(out, ref) < 2e-2
    else:
        assert rel_err(out, ref) < 1e-5
    assert sum(r.rewrites.get(PATTERN, 0) for r in _records(model)) == 1 and not _rejections(model)


class _Table(torch.nn.Module):
    """A rotary table written by hand, the HF way or with one thing changed."""

    def __init__(self, variant, half=8):
        super().__init__()
        self.variant = variant
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 2 * half, 2).float() / (2 * half))),
                             persistent=False)

    def forward(self, x, position_ids):
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        pos = position_ids[:, None, :].float()
        if self.variant == "positions_first":  # the same table, the other dim order: not this pattern
            freqs = position_ids[:, :, None].float() @ self.inv_freq[None, None, :].float()
        else:
            freqs = (inv @ pos).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.variant == "two_cats":  # cos and sin of two different concatenations
            cos, sin = emb.cos(), torch.cat((freqs, freqs), dim=-1).sin()
        else:
            cos, sin = emb.cos() * 0.5, emb.sin() * (0.5 if self.variant != "other_scale" else 0.25)
        out = x * cos.to(x.dtype)[:, None] + x * sin.to(x.dtype)[:, None]
        if self.variant == "freqs_read":  # an intermediate read elsewhere stays; the table still fuses
            out = out + freqs.sum()
        return out


@pytest.mark.parametrize("variant, reason", [
    ("hf", None), ("freqs_read", None),
    ("two_cats", "read by 1 cos and 0 sin"),
    ("positions_first", "not a transpose of the last two dims"),
    ("other_scale", "scaled or cast differently"),
])
def test_hand_written_tables(variant, reason):
    torch.manual_seed(0)
    model = _Table(variant).eval()
    x, positions = torch.randn(2, 3, 5, 16), torch.randint(0, 3000, (2, 5))
    with torch.no_grad():
        ref = model(x, positions)
        transfuse.optimize(model, dynamic=False)
        out = model(x, positions)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    (record,) = _records(model)
    if reason is None:
        assert record.rewrites.get(PATTERN) == 1 and not _rejections(model)
    else:
        assert record.rewrites.get(PATTERN, 0) == 0
        assert any(reason in r.reason for r in _rejections(model)), _rejections(model)
        assert PATTERN in transfuse.report(model)
