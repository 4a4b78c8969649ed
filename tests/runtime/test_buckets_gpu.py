"""Bucketed CUDA graphs on the GPU: random shapes and masks give eager's answer within fp16's own
error, one Dynamo trace serves them all, each bucket is captured once, and the LRU cap holds."""

import copy
import random

import pytest
import torch

import transfuse
from tests.helpers import rel_err

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def models():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=4)
    model32 = BertModel(cfg).cuda().eval()
    model16 = copy.deepcopy(model32).half()
    return model32, model16


def _inputs(batch, seq, rng):
    ids = torch.randint(0, 30522, (batch, seq), device="cuda")
    mask = torch.ones(batch, seq, dtype=torch.long, device="cuda")
    for row in range(batch):
        if rng.random() < 0.5:
            mask[row, rng.randint(1, seq):] = 0
    return ids, mask


def test_random_shapes_with_graphs(models):
    model32, model16 = models
    opt = transfuse.optimize(copy.deepcopy(model16))
    rng = random.Random(0)
    shapes = [(rng.randint(2, 24), rng.randint(5, 300)) for _ in range(12)] + [(1, 37), (1, 200)]
    for batch, seq in shapes:
        ids, mask = _inputs(batch, seq, rng)
        with torch.no_grad():
            ref = model32(input_ids=ids, attention_mask=mask).last_hidden_state
            eager = model16(input_ids=ids, attention_mask=mask).last_hidden_state
            out = opt(input_ids=ids, attention_mask=mask).last_hidden_state
        keep = mask.bool()
        err, torch_err = rel_err(out[keep], ref[keep]), rel_err(eager[keep], ref[keep])
        assert out.shape == (batch, seq, 768)
        assert err <= 2 * torch_err + 1e-4, f"{batch}x{seq}: {err:.2e} vs torch {torch_err:.2e}"
    state = opt._transfuse_state
    # One symbolic trace for every shape, the batch-1 calls at the end included (on CUDA, torch's
    # SDPA kernel choice would guard on batch != 1 if it ran while Dynamo traces: tracing_sdpa.py)
    assert sum(len(b.records) for b in state.backends) == 1
    used = sum(len(r.stats) for b in state.backends for r in b.runners)
    assert state.backend.pool.graphs_captured == used  # each bucket captured once


def test_outputs_not_overwritten_and_lru_cap(models):
    _, model16 = models
    opt = transfuse.optimize(copy.deepcopy(model16), max_graphs=2)
    rng = random.Random(1)
    ids, mask = _inputs(4, 40, rng)
    with torch.no_grad():
        first = opt(input_ids=ids, attention_mask=mask).last_hidden_state
        kept = first.clone()
        for batch, seq in [(4, 100), (8, 200), (4, 40), (2, 20)]:
            opt(input_ids=_inputs(batch, seq, rng)[0], attention_mask=_inputs(batch, seq, rng)[1])
    assert torch.equal(first, kept)
    runner = opt._transfuse_state.backend.runners[0]
    assert len(runner.graphs) <= 2 and runner.evicted >= 2
