"""Decoder families on the GPU: Llama prefill through optimize() within fp16's own error, RMSNorm
rewritten; generate() equal to eager, with the dynamic and the static cache (the static-cache case
was written without a GPU run: the next session with a device runs it)."""

import copy

import pytest
import torch
import transformers

import transfuse
from tests.helpers import rel_err

pytestmark = pytest.mark.gpu


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                   intermediate_size=688, vocab_size=1000, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).cuda().eval()


@pytest.mark.parametrize("batch,seq", [(2, 37), (1, 100), (4, 128)])
def test_llama_prefill_fp16_within_torch_error(batch, seq):
    model32 = _llama()
    model16 = copy.deepcopy(model32).half()
    opt = transfuse.optimize(copy.deepcopy(model16))
    ids = torch.randint(0, 1000, (batch, seq), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        ref = model32(input_ids=ids, attention_mask=mask, use_cache=False).logits
        eager = model16(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out = opt(input_ids=ids, attention_mask=mask, use_cache=False).logits
    keep = mask.bool()
    err, torch_err = rel_err(out[keep], ref[keep]), rel_err(eager[keep], ref[keep])
    assert err <= 2 * torch_err + 1e-4, f"{err:.2e} vs torch {torch_err:.2e}"
    assert "RMSNorm" in transfuse.report(opt)


@pytest.mark.parametrize("cache", [None, "static"])
def test_generate_equals_eager(cache):
    """With a static cache the decode step writes the cache in place inside a CUDA graph (the
    runner reads it at its own address); twice in a row, so the second generate reuses graphs."""
    model = _llama().float()
    ids = torch.randint(0, 1000, (2, 9), device="cuda")
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, cache_implementation=cache)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        opt = transfuse.optimize(copy.deepcopy(model))
        for _ in range(2):
            out = opt.generate(ids, **kwargs)
            assert torch.equal(out, ref)
