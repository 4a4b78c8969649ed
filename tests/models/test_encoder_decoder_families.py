"""Encoder-decoder families through optimize() on the CPU (interpreter): logits equal to eager with
padding in the encoder input, greedy generate() equal to eager (beam search: test_generate.py), and
the golden number of matches each pass makes on the first trace (encoder and decoder of one
forward). Tiny configs: 2+2 layers, hidden 32, two heads (1+1 for BART's relatives)."""

import pytest
import torch
import transformers

import transfuse
from tests.helpers import rel_err

COMMON = dict(vocab_size=97, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
ATTENTION = {"TorchSDPA": 6, "SiblingLinears": 5, "LinearEpilogue": 22}  # 2 encoder, 2 decoder self, 2 cross
# the decoder's cache (self and cross, keys and values, 2 layers): each starts with a torch.cat onto an empty tensor
ATTENTION["EmptyCat"] = 8

# family -> (config class, model class, config, golden rewrites of the first trace)
FAMILIES = {
    # v1.0: ReLU FFN, tied head; relative-position bias added to every attention's scores
    "t5": ("T5Config", "T5ForConditionalGeneration",
           dict(d_model=32, d_kv=16, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=2, **COMMON),
           {**ATTENTION, "InplaceArithmetic": 1, "EvalDropout": 18, "RMSNorm": 2, "ResidualRMSNorm": 10,
            "RMSNormLinear": 11}),
    # v1.1 / flan: gated-GELU FFN (gate and up merged, the GELU gate in their GEMM's epilogue: GeGLU), untied
    # head, a head dim that is not d_model / heads
    "t5-v1.1": ("T5Config", "T5ForConditionalGeneration",
                dict(d_model=32, d_kv=24, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=2,
                     feed_forward_proj="gated-gelu", tie_word_embeddings=False, **COMMON),
                {**ATTENTION, "SiblingLinears": 9, "GeGLU": 4, "LinearEpilogue": 18, "InplaceArithmetic": 1,
                 "EvalDropout": 18, "RMSNorm": 2, "ResidualRMSNorm": 10, "RMSNormLinear": 12}),
    # learned positions, post-norm, GELU
    "bart": ("BartConfig", "BartForConditionalGeneration",
             dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                  encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64, forced_eos_token_id=None, **COMMON),
             {**ATTENTION, "KeyPadding": 2, "EvalDropout": 16, "ResidualLayerNorm": 11, "LayerNorm": 1,
              "LayerNormLinear": 12}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_logits_generate_and_matches(family):
    config_cls, model_cls, config, golden = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config)).eval()
    ids = torch.randint(3, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # padding in the encoder input
    decoder_ids = torch.randint(3, 97, (2, 5))
    searches = [dict(max_new_tokens=3, do_sample=False)]
    with torch.no_grad():
        ref_logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        refs = [model.generate(ids, attention_mask=mask, **s) for s in searches]
        transfuse.optimize(model)
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        outs = [model.generate(ids, attention_mask=mask, **s) for s in searches]
    assert rel_err(logits, ref_logits) < 1e-5
    for out, ref in zip(outs, refs):
        assert torch.equal(out, ref)
    assert dict(model._transfuse_state.backend.records[0].rewrites) == golden
    # every decode step's self-attention writes its cache inside the attention kernel (KVCacheAttention):
    # two decoder layers (the first step's trace also writes the cross-attention caches: four)
    fused = [r.rewrites.get("KVCacheAttention", 0) for b in model._transfuse_state.backends for r in b.records]
    assert fused[-1] == 2, fused


def test_bart_fp16_graph_breaks_keep_the_weights():
    """BART in fp16 as written breaks the graph in every encoder layer (`if not torch.isfinite(h).all()`;
    transfuse.branchless removes the break, disabled here), so each layer's forward is a frame whose
    trace Dynamo reuses for every layer. The user's weights must stay as they were and every call give
    the first call's logits (before runtime/instances.py, layer 1's QKV weights were copied into
    layer 0's from the second call on)."""
    config_cls, model_cls, config, _ = FAMILIES["bart"]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config)).eval().half()
    ids = torch.randint(3, 97, (2, 9))
    decoder_ids = torch.randint(3, 97, (2, 5))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model(input_ids=ids, decoder_input_ids=decoder_ids).logits.float()
        transfuse.optimize(model, disable=("BranchlessGuard",))
        outs = [model(input_ids=ids, decoder_input_ids=decoder_ids).logits.float() for _ in range(3)]
    assert not [k for k, v in model.state_dict().items() if not torch.equal(v, weights[k])]
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])
    assert rel_err(outs[0], ref) < 5e-3  # fp16 against fp16 eager


# BART's relatives (sinusoidal or learned positions, pre- or post-norm, their own fp16 guards)
BART_FAMILY = {
    "marian": ("MarianConfig", "MarianMTModel", dict(decoder_vocab_size=97)),
    "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration", {}),
    "mbart": ("MBartConfig", "MBartForConditionalGeneration", {}),
}


@pytest.mark.parametrize("family", sorted(BART_FAMILY))
def test_bart_family_generate_matches_eager(family):
    """Marian, Pegasus and mBART through the same machinery: greedy (decode loop) and beam search
    (Hugging Face's loop) equal eager's, with padding in the encoder input. One layer each side: what
    sets them apart from BART (positions, norm placement) is outside the layer loop or the same in
    every layer; BART's two layers (one cache per layer) are test_family_logits_generate_and_matches'."""
    config_cls, model_cls, extra = BART_FAMILY[family]
    config = getattr(transformers, config_cls)(
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64, forced_eos_token_id=None, **extra,
        **COMMON)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    ids = torch.randint(3, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    searches = [dict(max_new_tokens=3, do_sample=False), dict(max_new_tokens=3, num_beams=2, do_sample=False)]
    with torch.no_grad():
        refs = [model.generate(ids, attention_mask=mask, **s) for s in searches]
        transfuse.optimize(model)
        outs = [model.generate(ids, attention_mask=mask, **s) for s in searches]
    for out, ref in zip(outs, refs):
        assert torch.equal(out, ref)
    state = model._transfuse_state
    assert state.eager_reason is None and state.decode_loop.calls == 1 and not state.decode_loop.left_to_hf
