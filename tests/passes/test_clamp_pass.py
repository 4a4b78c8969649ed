"""T5's fp16 overflow guard (three per decoder block, two per encoder block) becomes one
clamp_if_inf each, and the logits stay eager's."""

import collections

import pytest
import torch
import transformers

import transfuse
from tests.helpers import rel_err


def _t5(dtype):
    config = transformers.T5Config(d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
                                   vocab_size=97, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config).eval().to(dtype)


@pytest.mark.parametrize("dtype, clamps", [(torch.float16, 2 * 2 + 2 * 3)])
def test_t5_overflow_clamp(dtype, clamps):
    model = _t5(dtype)
    ids = torch.randint(3, 97, (2, 9))
    dec = torch.randint(3, 97, (2, 5))
    with torch.no_grad():
        ref = model(input_ids=ids, decoder_input_ids=dec).logits.float()
        transfuse.optimize(model)
        out = model(input_ids=ids, decoder_input_ids=dec).logits.float()
    rewrites = collections.Counter()
    for record in model._transfuse_state.backend.records:
        rewrites.update(record.rewrites)
    assert rewrites["OverflowClamp"] == clamps
    assert rel_err(out, ref) < (2e-2 if dtype == torch.float16 else 1e-5)
