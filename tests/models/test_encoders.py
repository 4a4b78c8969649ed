"""optimize() end to end on tiny Hugging Face encoders: golden match counts per pass, outputs equal
to eager, restore() undoes everything."""

import pytest
import torch

import transfuse
from tests.helpers import optimize_and_run, rel_err
from tests.models.registry import REGISTRY


def _inputs(vocab: int, batch: int = 2, seq: int = 9):
    ids = torch.randint(3, vocab, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - 3 :] = 0  # padding in the last sequence
    return ids, mask


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("tiny", REGISTRY, ids=lambda t: t.name)
def test_encoder_matches_eager_with_golden_counts(tiny, attn):
    model = tiny.build(attn)
    vocab = model.config.vocab_size
    ids, mask = _inputs(vocab)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
    out, rewrites, rejections = optimize_and_run(model, input_ids=ids, attention_mask=mask)
    assert dict(rewrites) == tiny.golden[attn]
    assert [r for r in rejections if r.pattern != "BucketPadding"] == []
    assert len([r for r in rejections if r.pattern == "BucketPadding"]) == tiny.unpaddable
    assert rel_err(out.last_hidden_state, ref) < 1e-5


def test_new_shape_is_correct_and_restore_undoes():
    tiny = REGISTRY[0]
    model = tiny.build("sdpa")
    ids, mask = _inputs(model.config.vocab_size)
    transfuse.optimize(model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        ids2, mask2 = _inputs(model.config.vocab_size, batch=3, seq=5)
        out2 = model(input_ids=ids2, attention_mask=mask2).last_hidden_state
    transfuse.restore(model)
    assert "forward" not in model.__dict__
    with torch.no_grad():
        ref2 = model(input_ids=ids2, attention_mask=mask2).last_hidden_state
    assert rel_err(out2, ref2) < 1e-5
    q = model.encoder.layer[0].attention.self.query.weight
    k = model.encoder.layer[0].attention.self.key.weight
    assert q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()


def test_fp16_bert_within_torch_fp16_error():
    tiny = REGISTRY[0]
    model32 = tiny.build("sdpa")
    ids, mask = _inputs(model32.config.vocab_size)
    model16 = tiny.build("sdpa")
    model16.load_state_dict(model32.state_dict())
    model16.half()
    with torch.no_grad():
        ref = model32(input_ids=ids, attention_mask=mask).last_hidden_state
        eager16 = model16(input_ids=ids, attention_mask=mask).last_hidden_state
    out, _, _ = optimize_and_run(model16, input_ids=ids, attention_mask=mask)
    assert rel_err(out.last_hidden_state, ref) <= 2 * rel_err(eager16, ref) + 1e-3
