"""The CPU tests' golden match counts, on the GPU machine's torch. CI runs the CPU tests on one torch
(2.13) and the GPU image has another (2.11), whose Dynamo may spell the same model differently
(2.11 records `mask == 0` as the method __eq__, 2.13 as operator.eq): a pattern that matches on one
and not the other is a silent slowdown, so every family's counts are checked here too. fp32 on the
GPU, the same tiny configs and inputs as the CPU tests."""

from __future__ import annotations

import collections

import pytest
import torch
import transformers

import transfuse
from tests.helpers import optimize_and_run
from tests.models import test_decoder_families as decoders
from tests.models import test_encoder_decoder_families as seq2seq
from tests.models.registry import REGISTRY

pytestmark = pytest.mark.gpu


def _counts(model) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for record in model._transfuse_state.backend.records:
        counts.update(record.rewrites)
    return counts


def _ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(3, 97, (batch, seq), device="cuda")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("tiny", REGISTRY, ids=lambda t: t.name)
def test_encoder_counts(tiny, attn):
    model = tiny.build(attn).cuda()
    ids = torch.randint(3, model.config.vocab_size, (2, 9), device="cuda")
    mask = torch.ones_like(ids)
    mask[-1, 6:] = 0
    _, rewrites, _ = optimize_and_run(model, input_ids=ids, attention_mask=mask)
    assert dict(rewrites) == tiny.golden[attn]


@pytest.mark.parametrize("family", sorted(decoders.FAMILIES))
def test_decoder_prompt_counts(family):
    model = decoders._build(family).cuda()
    ids = _ids(2, 9)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    transfuse.optimize(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert dict(model._transfuse_state.backend.records[0].rewrites) == decoders.FAMILIES[family][3]


# On the GPU the encoder is a graph of its own (compiled once for generate()), so its last norm can
# no longer go into the decoder's cross-attention K/V linear that reads it (and returns it as the
# encoder's output: store_normed): the CPU trace, one graph for both, fuses that pair. BART's and
# T5 v1.1's decoder graphs on the GPU have one LayerNormLinear / RMSNormLinear fewer again than the
# CPU trace (measured on an H200, 2026-11-27: BART 10 in all, T5 v1.1 10, T5 10).
_ACROSS_THE_ENCODER_OUTPUT = {"bart": ("LayerNormLinear", 2), "t5": ("RMSNormLinear", 1), "t5-v1.1": ("RMSNormLinear", 2)}


@pytest.mark.parametrize("family", sorted(seq2seq.FAMILIES))
def test_encoder_decoder_counts(family):
    config_cls, model_cls, config, golden = seq2seq.FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config)).cuda().eval()
    ids = _ids(2, 9)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    transfuse.optimize(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=_ids(2, 5))
    expected = dict(golden)
    if family in _ACROSS_THE_ENCODER_OUTPUT:
        pattern, fewer = _ACROSS_THE_ENCODER_OUTPUT[family]
        expected[pattern] -= fewer
    assert dict(_counts(model)) == {k: v for k, v in expected.items() if v}


def test_nanogpt_training_counts():
    from tests.training.test_training import _nanogpt

    model = _nanogpt().cuda()
    transfuse.optimize(model)
    ids = _ids(2, 21)
    _, loss = model(ids, ids)
    loss.backward()
    counts = _counts(model)
    for pattern, count in {"ManualAttention": 2, "CausalMaskBuffer": 2, "CrossEntropy": 1, "VocabPadding": 1,
                           "ResidualLayerNorm": 4, "LinearEpilogue": 2}.items():
        assert counts[pattern] == count, (pattern, counts)
