"""End to end on the GPU at the benchmark shapes: bert-base geometry, fp16, CUDA graphs on."""

import copy

import pytest
import torch

import transfuse
from tests.helpers import rel_err

pytestmark = pytest.mark.gpu

SHAPES = [(1, 16), (1, 128), (8, 128), (8, 512), (32, 512), (3, 77)]


@pytest.fixture(scope="module")
def bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model32 = BertModel(BertConfig()).cuda().eval()
    model16 = copy.deepcopy(model32).half()
    opt = transfuse.optimize(copy.deepcopy(model16))
    return model32, model16, opt


def _inputs(batch, seq, pad=True):
    ids = torch.randint(0, 30522, (batch, seq), device="cuda")
    mask = torch.ones(batch, seq, dtype=torch.long, device="cuda")
    if pad and batch > 1:
        mask[-1, seq // 2 :] = 0
    return ids, mask


@pytest.mark.parametrize("batch,seq", SHAPES)
def test_bert_base_fp16_error_within_torch(bert, batch, seq):
    model32, model16, opt = bert
    ids, mask = _inputs(batch, seq)
    with torch.no_grad():
        ref = model32(input_ids=ids, attention_mask=mask).last_hidden_state
        eager = model16(input_ids=ids, attention_mask=mask).last_hidden_state
        out = opt(input_ids=ids, attention_mask=mask).last_hidden_state
        again = opt(input_ids=ids, attention_mask=mask).last_hidden_state  # CUDA-graph replay
    torch.testing.assert_close(out, again)
    assert rel_err(out, ref) <= 2 * rel_err(eager, ref) + 1e-3


def test_outputs_are_never_overwritten(bert):
    _, _, opt = bert
    ids, mask = _inputs(2, 32)
    ids2, _ = _inputs(2, 32)
    with torch.no_grad():
        first = opt(input_ids=ids, attention_mask=mask).last_hidden_state
        kept = first.clone()
        opt(input_ids=ids2, attention_mask=mask)
    torch.testing.assert_close(first, kept, rtol=0, atol=0)


def test_replaced_and_reloaded_parameters_recapture(bert):
    model32, model16, _ = bert
    opt = transfuse.optimize(copy.deepcopy(model16))
    ref_model = copy.deepcopy(model16)
    ids, mask = _inputs(2, 40)
    with torch.no_grad():
        opt(input_ids=ids, attention_mask=mask)
        for m in (opt, ref_model):
            torch.manual_seed(1)
            m.encoder.layer[3].output.dense.weight = torch.nn.Parameter(torch.randn(768, 3072, device="cuda", dtype=torch.half) * 0.02)
            m.encoder.layer[5].attention.self.value.weight.data.mul_(1.5)
        out = opt(input_ids=ids, attention_mask=mask).last_hidden_state
        ref = ref_model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert rel_err(out, ref) < 2e-3


def test_dtype_change_recompiles(bert):
    model32, model16, _ = bert
    opt = transfuse.optimize(copy.deepcopy(model16))
    ids, mask = _inputs(2, 24)
    with torch.no_grad():
        opt(input_ids=ids, attention_mask=mask)
        opt.to(torch.bfloat16)
        out = opt(input_ids=ids, attention_mask=mask).last_hidden_state
        ref = model32(input_ids=ids, attention_mask=mask).last_hidden_state
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 2e-2


def test_nan_input_embeddings_give_nan_like_eager(bert):
    _, model16, opt = bert
    ids, mask = _inputs(2, 16, pad=False)
    with torch.no_grad():
        emb = model16.embeddings.word_embeddings(ids)
        emb[0, 3, 5] = float("nan")
        ref = model16(inputs_embeds=emb, attention_mask=mask).last_hidden_state
        out = opt(inputs_embeds=emb, attention_mask=mask).last_hidden_state
    assert torch.equal(torch.isnan(out).any(-1), torch.isnan(ref).any(-1))
