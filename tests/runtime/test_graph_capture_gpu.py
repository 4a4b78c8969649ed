"""CUDA-graph capture on the GPU where a graph's inputs or ops are unusual: an input broadcast with
expand (stride 0) is captured with its strides, and a graph whose capture CUDA refuses (an op that
syncs with the host) runs eagerly with the same answer, and the report says so."""

import copy

import pytest
import torch

import transfuse
from tests.helpers import rel_err

pytestmark = pytest.mark.gpu


@torch.library.custom_op("transfuse_test::segment_sums", mutates_args=())
def segment_sums(x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Row sums of x's segments, the way Hugging Face's grouped-GEMM fallback loops over experts:
    with .tolist() on a GPU tensor, a host sync that CUDA graph capture refuses."""
    out, start = [], 0
    for end in ends.tolist():
        out.append(x[start:end].sum(0))
        start = end
    return torch.stack(out)


@segment_sums.register_fake
def _(x, ends):
    return x.new_empty(ends.shape[0], x.shape[1])


class _Segments(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x, ends):
        return segment_sums(self.proj(x), ends) * 2


def test_a_graph_whose_capture_is_refused_runs_eagerly_and_says_so():
    torch.manual_seed(0)
    model = _Segments().cuda().half().eval()
    opt = transfuse.optimize(copy.deepcopy(model))
    ends = torch.tensor([3, 5, 9], device="cuda")
    for step in range(4):  # exact shapes are captured the second time they come
        x = torch.randn(9, 16, device="cuda", dtype=torch.half)
        with torch.no_grad():
            want, got = model(x, ends), opt(x, ends)
        assert rel_err(got, want) < 1e-2, step
    text = transfuse.report(opt)
    assert "capture was refused" in text


class _Biased(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, bias):
        return torch.softmax(self.proj(x) + bias, dim=-1)


def test_an_input_broadcast_with_expand_is_captured_with_its_strides():
    torch.manual_seed(0)
    model = _Biased().cuda().half().eval()
    opt = transfuse.optimize(copy.deepcopy(model))
    for step in range(4):
        x = torch.randn(3, 4, 5, 8, device="cuda", dtype=torch.half)
        bias = torch.randn(1, 4, 5, 8, device="cuda", dtype=torch.half).expand(3, 4, 5, 8)
        with torch.no_grad():
            want, got = model(x, bias), opt(x, bias)
        assert rel_err(got, want) < 1e-2, step
    assert "capture was refused" not in transfuse.report(opt)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_t5_returns_its_attention_probabilities(attention):
    """output_attentions=True breaks T5's graph (SDPA: at a warning) where its position bias is
    broadcast over the batch: the next graph's input has stride 0 (it raised in the static input
    copy before). Eager attention returns the probabilities, which must match too."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=101,
                   decoder_start_token_id=0)
    cfg._attn_implementation = attention
    ref = T5ForConditionalGeneration(cfg).cuda().eval()
    eager = copy.deepcopy(ref).half()
    opt = transfuse.optimize(copy.deepcopy(eager))
    ids = torch.randint(3, 101, (3, 13), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    dec = torch.randint(3, 101, (3, 5), device="cuda")
    kw = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, output_attentions=True)
    with torch.no_grad():
        outs = [m(**kw) for m in (ref, eager)] + [opt(**kw) for _ in range(3)]
    want, base = outs[0], outs[1]
    for got in outs[2:]:
        assert rel_err(got.logits, want.logits) <= 2 * rel_err(base.logits, want.logits) + 1e-3
        for key in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
            assert len(got[key]) == len(want[key]) == (2 if attention == "eager" else 0), key  # SDPA returns none
            for g, w, b in zip(got[key], want[key], base[key]):
                assert rel_err(g, w) <= 2 * rel_err(b, w) + 1e-3, key
