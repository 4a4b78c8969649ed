"""Correctness sweep of transfuse.optimize() over Hugging Face model families that no issue names.

For each family (a tiny random config built from transformers' config class, fixed seed) and dtype:
an fp32 eager reference, an eager copy in the dtype, and a deep copy of that through
transfuse.optimize(); then these checks, one JSON line each in OUT/sweep.jsonl:

  fwd13, fwd37  logits on a batch of 3 with padding (left for decoders, right for encoder inputs),
                compared on the positions that are not padding: relative-norm error of transfuse and
                of eager-in-the-dtype against the fp32 reference; pass if
                err(transfuse) <= 2 * err(eager) + atol (atol 1e-3 for fp16/bf16, 1e-4 for fp32)
  gen_b3, gen_b2  greedy generate(max_new_tokens=8) at two batch sizes (decoders, encoder-decoders):
                tokens equal to eager-in-the-dtype's, except on a row whose first differing step had
                an eager top-2 logit margin below a tie tolerance, or where the fp32 model, given the
                tokens both runs agree on, prefers transfuse's token or prefers eager's by less than
                TIE_FACTOR x eager's own max logit error in the dtype (such rows are counted, not failed)
  params        the model's state_dict after every call equals the one saved before optimize()
  report        transfuse.report(model) returns a string

Vision and audio families (kinds "img", "vl", "asr", "wav"; MEDIA) get the same forward rule on their
main output (the first field of the model's output: logits, last_hidden_state or logits_per_image),
on inputs of their own:

  fwd_b3, fwd_b2  img: pixel_values (batch, 3, H, W), standard normal, at batch 3 and 2 (an image has no
                padding: every row and patch is compared, and a pooler_output too where the model has one);
                vl (CLIP): the same images and ids of length 13 and 37 with right padding; logits_per_image,
                text_embeds and image_embeds compared; asr (Whisper): input_features (batch, mel bins,
                2 * max_source_positions) at batch 3 and 2, which the encoder needs exactly, and decoder
                ids of length 7 and 11; decoder logits compared
  fwd13, fwd37  wav (CTC heads): input_values (3, samples) making 13 and 37 frames; where the feature
                extractor takes a mask (feat_extract_norm="layer"), rows 1 and 2 padded by 3 and 6 frames'
                samples, and the logits compared on the frames that are not padding
  gen_b3, gen_b2  asr: greedy generate() from input_features, as for the encoder-decoders

--extra adds checks (names in EXTRA_CHECKS; "all" for every one): beam search, sampling from a seed,
a 40-token greedy generate, hidden states, attention probabilities, batch 1 without a mask, and
inputs_embeds in place of input_ids (nomask and embeds are text checks: vision and audio families skip them).

An exception in transfuse's model is a FAIL; one that eager in the same dtype raises too is a SKIP.

  CPU (Triton's interpreter, tiny shapes, a few families at a time):
    TRITON_INTERPRET=1 PYTHONPATH=src python3 bench/family_sweep.py --device cpu --dtypes fp32 \
        --only gpt2,llama --out /tmp/sweep
  Vision and audio only (--only takes the kinds' names too: img, vl, asr, wav):
    ... --only img,vl,asr,wav
  GPU:
    PYTHONPATH=src python3 bench/family_sweep.py --device cuda --dtypes fp16,bf16,fp32 --out $OUT
  Wider and longer (head dims x4, inputs past the 64-position tables, which grow to fit):
    ... --scale 4 --seqs 100,300

(The fwd13/fwd37 names follow --seqs.)

Each (family, dtype) runs in a worker process (--jobs of them; 0 runs in this process), so that a
hang or a crash costs one unit, not the sweep: a unit past --unit-timeout is killed and recorded as
a FAIL, and --time-limit stops handing out new units. Kernels compiled for one family are reused by
the next in the same worker (shapes are shared across families where the config allows).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import selectors
import subprocess
import sys
import time
import traceback
from pathlib import Path

VOCAB = 101
PAD, BOS, EOS = 0, 1, 2
IDS = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
SEQS = (13, 37)  # two shapes: the second is a new bucket / a second trace (--seqs sets others)
SCALE = 1  # --scale: widths (hidden, FFN, head dims) multiplied by it; head counts kept
DECODER_SEQS = {13: 7, 37: 11}  # encoder-decoders: decoder length for each encoder length
BATCH = 3
NEW_TOKENS = 8
ATOL = {"fp32": 1e-4, "fp16": 1e-3, "bf16": 1e-3}
# A generated row whose first differing token had an eager top-2 margin below
# max(TIE_FACTOR * the forward's max-abs logit difference, TIE_FLOOR) is a near-tie, not a failure.
TIE_FACTOR = 4.0
TIE_FLOOR = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 2e-2}
DTYPES = ("fp32", "fp16", "bf16")
LONG_TOKENS = 40  # --extra long: greedy generation past the first cache buckets
EXTRA = ()  # --extra: checks beyond the default ones (see EXTRA_CHECKS)
EXTRA_CHECKS = {
    "beam": "generate(num_beams=3, num_return_sequences=3) at batch 2: each row's best beam equal to eager's",
    "sample": "generate(do_sample=True, top_k=20) from one seed at batch 2: the same random draws as eager's",
    "long": f"greedy generate of {LONG_TOKENS} new tokens at batch 2",
    "hidden": "forward with output_hidden_states=True: every hidden state, not only the logits",
    "attn": "forward with output_attentions=True: logits and the attention probabilities",
    "nomask": "forward at batch 1 without an attention mask",
    "embeds": "forward from inputs_embeds instead of input_ids",
}
PROTOCOL = "@@SWEEP "

# ---------------------------------------------------------------------------------------------
# Families, in the order of the brief. (name, kind, config class, model class, config, attention)
# kind: "dec" (causal LM: generate), "enc" (masked LM, right padding), "s2s" (encoder-decoder).
# attention None keeps the family's default; a name sets config._attn_implementation.
# Head dims (hd) vary: 16, 32 and 80; GQA where the family has it; max positions 64.
# ---------------------------------------------------------------------------------------------
_LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, max_position_embeddings=64, **IDS)  # hd 16, GQA 2:1

FAMILIES = [
    ("gpt2", "dec", "GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, **IDS), None),
    ("gpt2:eager", "dec", "GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, **IDS), "eager"),
    ("gpt_neo", "dec", "GPTNeoConfig", "GPTNeoForCausalLM",  # hd 32, a local layer with a window of 8
     dict(hidden_size=64, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]], window_size=8,
          intermediate_size=128, max_position_embeddings=64, **IDS), None),
    ("gptj", "dec", "GPTJConfig", "GPTJForCausalLM",  # hd 32, rotary on 16 of them
     dict(n_embd=128, n_layer=2, n_head=4, rotary_dim=16, n_positions=64, **IDS), None),
    ("gpt_neox", "dec", "GPTNeoXConfig", "GPTNeoXForCausalLM",  # hd 16, rotary on a quarter (Pythia)
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, rotary_pct=0.25,
          max_position_embeddings=64, **IDS), None),
    ("opt", "dec", "OPTConfig", "OPTForCausalLM",  # hd 16
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64,
          max_position_embeddings=64, **IDS), None),
    ("bloom", "dec", "BloomConfig", "BloomForCausalLM",  # hd 32, ALiBi
     dict(hidden_size=64, n_layer=2, n_head=2, **IDS), None),
    ("falcon", "dec", "FalconConfig", "FalconForCausalLM",  # new decoder architecture: GQA, rotary, hd 16
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
          alibi=False, max_position_embeddings=64, **IDS), None),
    ("falcon:alibi", "dec", "FalconConfig", "FalconForCausalLM",  # Falcon-RW: ALiBi, sequential, bias, hd 32
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, new_decoder_architecture=False, alibi=True,
          multi_query=False, parallel_attn=False, bias=True, max_position_embeddings=64, **IDS), None),
    ("falcon:mq", "dec", "FalconConfig", "FalconForCausalLM",  # Falcon-7B: multi-query, parallel attn, hd 32
     dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False, alibi=False,
          multi_query=True, parallel_attn=True, max_position_embeddings=64, **IDS), None),
    ("llama", "dec", "LlamaConfig", "LlamaForCausalLM", _LLAMA, None),
    ("llama:eager", "dec", "LlamaConfig", "LlamaForCausalLM", _LLAMA, "eager"),
    ("llama:hd80", "dec", "LlamaConfig", "LlamaForCausalLM",  # head dim 80 (not a power of two), GQA 3:1
     dict(_LLAMA, hidden_size=240, num_attention_heads=3, num_key_value_heads=1, head_dim=80), None),
    ("llama:hd256", "dec", "LlamaConfig", "LlamaForCausalLM",  # head dim 256 (Gemma's), MQA
     dict(_LLAMA, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=256), None),
    ("mistral", "dec", "MistralConfig", "MistralForCausalLM", dict(_LLAMA, head_dim=32), None),  # hd 32 != hidden/heads
    ("mixtral", "dec", "MixtralConfig", "MixtralForCausalLM",  # 4 experts, top 2
     dict(_LLAMA, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2), None),
    ("qwen2", "dec", "Qwen2Config", "Qwen2ForCausalLM", dict(_LLAMA, hidden_size=128, num_attention_heads=4), None),  # hd 32, QKV bias
    ("qwen3", "dec", "Qwen3Config", "Qwen3ForCausalLM",  # hd 80, MQA, Q/K norms
     dict(_LLAMA, num_attention_heads=2, num_key_value_heads=1, head_dim=80), None),
    ("qwen3:eager", "dec", "Qwen3Config", "Qwen3ForCausalLM",
     dict(_LLAMA, num_attention_heads=2, num_key_value_heads=1, head_dim=80), "eager"),
    ("gemma", "dec", "GemmaConfig", "GemmaForCausalLM", dict(_LLAMA, num_key_value_heads=1, head_dim=32), None),  # MQA, GeGLU
    ("gemma2", "dec", "Gemma2Config", "Gemma2ForCausalLM",  # soft-capping, sliding window 8 on layer 0
     dict(_LLAMA, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]), None),
    ("gemma3_text", "dec", "Gemma3TextConfig", "Gemma3ForCausalLM",  # Q/K norms, local/global rope
     dict(_LLAMA, head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"]), None),
    ("phi", "dec", "PhiConfig", "PhiForCausalLM",  # Phi-2 geometry: hd 80, rotary on 32, parallel block
     dict(hidden_size=160, num_hidden_layers=2, num_attention_heads=2, intermediate_size=192,
          partial_rotary_factor=0.4, max_position_embeddings=64, **IDS), None),
    ("phi3", "dec", "Phi3Config", "Phi3ForCausalLM", _LLAMA, None),  # fused qkv and gate_up
    ("stablelm", "dec", "StableLmConfig", "StableLmForCausalLM",  # hd 32, QKV bias, rotary on a quarter
     dict(_LLAMA, num_attention_heads=2, num_key_value_heads=2, use_qkv_bias=True, partial_rotary_factor=0.25), None),
    ("starcoder2", "dec", "Starcoder2Config", "Starcoder2ForCausalLM", dict(_LLAMA, sliding_window=None), None),
    ("gpt_bigcode", "dec", "GPTBigCodeConfig", "GPTBigCodeForCausalLM",  # multi-query, hd 16
     dict(n_embd=64, n_layer=2, n_head=4, multi_query=True, n_positions=64, **IDS), None),
    ("codegen", "dec", "CodeGenConfig", "CodeGenForCausalLM",  # hd 32, rotary on 16, mp_num 4 split
     dict(n_embd=128, n_layer=2, n_head=4, rotary_dim=16, n_positions=64, n_ctx=64, **IDS), None),
    ("cohere", "dec", "CohereConfig", "CohereForCausalLM", dict(_LLAMA, logit_scale=0.5), None),  # parallel block, interleaved rope
    ("olmo", "dec", "OlmoConfig", "OlmoForCausalLM",  # hd 32, clipped QKV, non-parametric norm
     dict(_LLAMA, hidden_size=128, num_key_value_heads=4, clip_qkv=8.0), None),
    ("olmo2", "dec", "Olmo2Config", "Olmo2ForCausalLM", _LLAMA, None),  # post-norms, Q/K norms
    ("granite", "dec", "GraniteConfig", "GraniteForCausalLM",  # multipliers
     dict(_LLAMA, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
          logits_scaling=8.0), None),
    ("mpt", "dec", "MptConfig", "MptForCausalLM",  # hd 32, ALiBi
     dict(d_model=128, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64, **IDS), None),
    ("smollm3", "dec", "SmolLM3Config", "SmolLM3ForCausalLM",  # layer 1 without rope
     dict(_LLAMA, no_rope_layers=[1, 0], no_rope_layer_interval=2), None),
    # encoders (masked-LM heads give logits), right padding
    ("bert", "enc", "BertConfig", "BertForMaskedLM",
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, max_position_embeddings=64,
          vocab_size=VOCAB, pad_token_id=PAD), None),
    ("bert:eager", "enc", "BertConfig", "BertForMaskedLM",
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, max_position_embeddings=64,
          vocab_size=VOCAB, pad_token_id=PAD), "eager"),
    ("roberta", "enc", "RobertaConfig", "RobertaForMaskedLM",  # hd 32, positions counted past the pad id
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=96, max_position_embeddings=66,
          vocab_size=VOCAB, pad_token_id=1, bos_token_id=0, eos_token_id=2), None),
    ("distilbert", "enc", "DistilBertConfig", "DistilBertForMaskedLM",
     dict(dim=64, n_layers=2, n_heads=4, hidden_dim=96, max_position_embeddings=64, vocab_size=VOCAB, pad_token_id=PAD), None),
    ("albert", "enc", "AlbertConfig", "AlbertForMaskedLM",  # factorised embeddings, shared layer
     dict(embedding_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
          max_position_embeddings=64, vocab_size=VOCAB, pad_token_id=PAD), None),
    ("electra", "enc", "ElectraConfig", "ElectraForMaskedLM",  # hd 32, embedding projection
     dict(embedding_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=96,
          max_position_embeddings=64, vocab_size=VOCAB, pad_token_id=PAD), None),
    ("deberta", "enc", "DebertaConfig", "DebertaForMaskedLM",  # disentangled relative attention
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, max_position_embeddings=64,
          relative_attention=True, pos_att_type=["c2p", "p2c"], max_relative_positions=64, vocab_size=VOCAB,
          pad_token_id=PAD), None),
    ("deberta-v2", "enc", "DebertaV2Config", "DebertaV2ForMaskedLM",  # hd 32, log buckets, shared keys
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=96, max_position_embeddings=64,
          relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=16, max_relative_positions=64,
          share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False, vocab_size=VOCAB,
          pad_token_id=PAD), None),
    ("xlm-roberta", "enc", "XLMRobertaConfig", "XLMRobertaForMaskedLM",
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, max_position_embeddings=66,
          vocab_size=VOCAB, pad_token_id=1, bos_token_id=0, eos_token_id=2), None),
    ("mpnet", "enc", "MPNetConfig", "MPNetForMaskedLM",  # relative position bias
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, max_position_embeddings=66,
          relative_attention_num_buckets=32, vocab_size=VOCAB, pad_token_id=1), None),
    ("modernbert", "enc", "ModernBertConfig", "ModernBertForMaskedLM",  # hd 32, global + local (window 8) layers
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=96, max_position_embeddings=64,
          layer_types=["full_attention", "sliding_attention"], local_attention=8, vocab_size=VOCAB, pad_token_id=PAD,
          bos_token_id=BOS, eos_token_id=EOS, cls_token_id=BOS, sep_token_id=EOS), None),
    ("mobilebert", "enc", "MobileBertConfig", "MobileBertForMaskedLM",  # bottlenecks, NoNorm, 2 FFNs a layer
     dict(hidden_size=64, embedding_size=32, true_hidden_size=32, intra_bottleneck_size=32, num_hidden_layers=2,
          num_attention_heads=2, intermediate_size=64, num_feedforward_networks=2, max_position_embeddings=64,
          vocab_size=VOCAB, pad_token_id=PAD), None),
    ("camembert", "enc", "CamembertConfig", "CamembertForMaskedLM",
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=96, max_position_embeddings=66,
          vocab_size=VOCAB, pad_token_id=1, bos_token_id=0, eos_token_id=2), None),
]
_S2S_IDS = dict(vocab_size=VOCAB, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, decoder_start_token_id=EOS)
_T5 = dict(d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=2, num_heads=4, **_S2S_IDS)
_BART = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=64, forced_eos_token_id=None, **_S2S_IDS)
FAMILIES += [
    ("t5", "s2s", "T5Config", "T5ForConditionalGeneration", dict(_T5, decoder_start_token_id=PAD), None),
    ("t5-v1.1", "s2s", "T5Config", "T5ForConditionalGeneration",  # gated GELU, untied head, hd 32
     dict(_T5, d_kv=32, feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=PAD), None),
    ("mt5", "s2s", "MT5Config", "MT5ForConditionalGeneration",
     dict(_T5, d_kv=32, num_heads=2, feed_forward_proj="gated-gelu", decoder_start_token_id=PAD), None),
    ("umt5", "s2s", "UMT5Config", "UMT5ForConditionalGeneration",  # a position bias in every layer
     dict(_T5, feed_forward_proj="gated-gelu", decoder_start_token_id=PAD), None),
    ("bart", "s2s", "BartConfig", "BartForConditionalGeneration", _BART, None),
    ("bart:eager", "s2s", "BartConfig", "BartForConditionalGeneration", _BART, "eager"),
    ("mbart", "s2s", "MBartConfig", "MBartForConditionalGeneration",  # pre-norm, hd 32
     dict(_BART, encoder_attention_heads=2, decoder_attention_heads=2), None),
    ("marian", "s2s", "MarianConfig", "MarianMTModel", dict(_BART, decoder_start_token_id=PAD), None),  # sinusoidal
    ("pegasus", "s2s", "PegasusConfig", "PegasusForConditionalGeneration",
     dict(_BART, encoder_attention_heads=2, decoder_attention_heads=2, decoder_start_token_id=PAD), None),
    ("m2m100", "s2s", "M2M100Config", "M2M100ForConditionalGeneration", _BART, None),
    ("blenderbot", "s2s", "BlenderbotConfig", "BlenderbotForConditionalGeneration",
     dict(_BART, encoder_attention_heads=2, decoder_attention_heads=2), None),
    ("plbart", "s2s", "PLBartConfig", "PLBartForConditionalGeneration", _BART, None),
    ("led", "s2s", "LEDConfig", "LEDForConditionalGeneration",  # local attention, window 16 (inputs padded to it)
     dict({k: v for k, v in _BART.items() if k != "max_position_embeddings"}, attention_window=16,
          max_encoder_position_embeddings=64, max_decoder_position_embeddings=64), None),
    ("longt5", "s2s", "LongT5Config", "LongT5ForConditionalGeneration",
     dict(_T5, encoder_attention_type="local", local_radius=4, decoder_start_token_id=PAD), None),
    ("longt5:tglobal", "s2s", "LongT5Config", "LongT5ForConditionalGeneration",
     dict(_T5, encoder_attention_type="transient-global", local_radius=4, global_block_size=4,
          decoder_start_token_id=PAD), None),
    ("prophetnet", "s2s", "ProphetNetConfig", "ProphetNetForConditionalGeneration",
     dict(hidden_size=64, encoder_ffn_dim=96, decoder_ffn_dim=96, num_encoder_layers=2, num_decoder_layers=2,
          num_encoder_attention_heads=4, num_decoder_attention_heads=4, max_position_embeddings=64, ngram=2,
          num_buckets=32, relative_max_distance=64, **_S2S_IDS), None),
]
# More families (session 26): attention sinks, multi-head latent attention, chunked attention, MoE
# routing, sliding windows, partial rotary, hybrid convolution layers, rotary encoders, local-block
# encoders and a switch-MoE T5.
FAMILIES += [
    ("gpt_oss", "dec", "GptOssConfig", "GptOssForCausalLM",  # attention sinks, sliding window 8, 4 experts top 2
     dict(_LLAMA, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
          layer_types=["sliding_attention", "full_attention"]), None),
    ("deepseek_v3", "dec", "DeepseekV3Config", "DeepseekV3ForCausalLM",  # MLA: qk 24 (16 + rope 8), v 16
     dict(_LLAMA, num_key_value_heads=4, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4,
          num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
          qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16), None),
    ("llama4_text", "dec", "Llama4TextConfig", "Llama4ForCausalLM",  # chunked attention 8, NoPE layer, L2 qk norm
     dict(_LLAMA, head_dim=16, intermediate_size_mlp=96, num_local_experts=2, num_experts_per_tok=1,
          attention_chunk_size=8, no_rope_layers=[1, 0], use_qk_norm=True, interleave_moe_layer_step=2), None),
    ("glm4", "dec", "Glm4Config", "Glm4ForCausalLM",  # half-rotary interleaved, post norms
     dict(_LLAMA, head_dim=16, partial_rotary_factor=0.5), None),
    ("nemotron", "dec", "NemotronConfig", "NemotronForCausalLM",  # relu^2, LayerNorm1P, half rotary
     dict(_LLAMA, head_dim=16, partial_rotary_factor=0.5), None),
    ("persimmon", "dec", "PersimmonConfig", "PersimmonForCausalLM",  # Q/K layer norms, relu^2, half rotary
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, qk_layernorm=True,
          partial_rotary_factor=0.5, max_position_embeddings=64, **IDS), None),
    ("xglm", "dec", "XGLMConfig", "XGLMForCausalLM",  # sinusoidal positions, scaled embeddings
     dict(d_model=64, num_layers=2, attention_heads=4, ffn_dim=96, max_position_embeddings=64, **IDS), None),
    ("biogpt", "dec", "BioGptConfig", "BioGptForCausalLM",
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
          max_position_embeddings=64, **IDS), None),
    ("cohere2", "dec", "Cohere2Config", "Cohere2ForCausalLM",  # sliding window 8, global layer without rope
     dict(_LLAMA, sliding_window=8, layer_types=["sliding_attention", "full_attention"]), None),
    ("exaone4", "dec", "Exaone4Config", "Exaone4ForCausalLM",  # sliding window, Q/K norms, post norms
     dict(_LLAMA, sliding_window=8, layer_types=["sliding_attention", "full_attention"]), None),
    ("apertus", "dec", "ApertusConfig", "ApertusForCausalLM", dict(_LLAMA), None),  # xIELU activation
    ("qwen3_moe", "dec", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",  # 4 experts top 2, Q/K norms
     dict(_LLAMA, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2), None),
    ("lfm2", "dec", "Lfm2Config", "Lfm2ForCausalLM",  # short convolutions and attention layers
     dict(_LLAMA, layer_types=["conv", "full_attention"]), None),
    ("roformer", "enc", "RoFormerConfig", "RoFormerForMaskedLM",  # rotary in an encoder
     dict(hidden_size=64, embedding_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
          max_position_embeddings=64, vocab_size=VOCAB, pad_token_id=PAD), None),
    ("esm", "enc", "EsmConfig", "EsmForMaskedLM",  # rotary, pre-norm, token dropout
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, max_position_embeddings=66,
          position_embedding_type="rotary", token_dropout=True, mask_token_id=3, vocab_size=VOCAB, pad_token_id=1), None),
    ("megatron_bert", "enc", "MegatronBertConfig", "MegatronBertForMaskedLM",  # pre-norm BERT
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, max_position_embeddings=64,
          vocab_size=VOCAB, pad_token_id=PAD), None),
    ("squeezebert", "enc", "SqueezeBertConfig", "SqueezeBertForMaskedLM",  # grouped 1x1 convolutions
     dict(hidden_size=64, embedding_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
          max_position_embeddings=64, vocab_size=VOCAB, pad_token_id=PAD), None),
    ("pegasus_x", "s2s", "PegasusXConfig", "PegasusXForConditionalGeneration",  # global tokens, local blocks of 8
     dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
          encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=64, num_global_tokens=4, block_size=8,
          stagger_local_blocks=True, **dict(_S2S_IDS, decoder_start_token_id=PAD)), None),
    ("switch_transformers", "s2s", "SwitchTransformersConfig", "SwitchTransformersForConditionalGeneration",
     dict(_T5, num_experts=4, expert_capacity=8, encoder_sparse_step=2, decoder_sparse_step=2,
          decoder_start_token_id=PAD), None),
]
# More families (session 27): MoE variants, a second latent attention, differential attention,
# sliding windows with Q/K norms, a hybrid state-space model, pre-norm and factorised encoders and
# encoder-decoders of their own kinds.
_ENC = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, max_position_embeddings=66,
            vocab_size=VOCAB, pad_token_id=1, bos_token_id=0, eos_token_id=2)
FAMILIES += [
    ("qwen2_moe", "dec", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",  # 4 experts top 2 and a gated shared expert
     dict(_LLAMA, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2), None),
    ("olmoe", "dec", "OlmoeConfig", "OlmoeForCausalLM",  # Q/K norms over all heads, 4 experts top 2
     dict(_LLAMA, num_experts=4, num_experts_per_tok=2), None),
    ("phimoe", "dec", "PhimoeConfig", "PhimoeForCausalLM",  # sparse-mixer routing, LayerNorm, sliding window
     dict(_LLAMA, num_local_experts=4, num_experts_per_tok=2, sliding_window=8), None),
    ("granitemoe", "dec", "GraniteMoeConfig", "GraniteMoeForCausalLM",  # scaled residuals, logits and attention
     dict(_LLAMA, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=2.0, residual_multiplier=0.5,
          logits_scaling=2.0, attention_multiplier=0.2), None),
    ("deepseek_v2", "dec", "DeepseekV2Config", "DeepseekV2ForCausalLM",  # MLA without a q LoRA, complex rotary
     dict(_LLAMA, num_key_value_heads=4, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4,
          num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32,
          qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16), None),
    ("minicpm3", "dec", "MiniCPM3Config", "MiniCPM3ForCausalLM",  # MLA with scaled embeddings and residuals
     dict(_LLAMA, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
          v_head_dim=16), None),
    ("diffllama", "dec", "DiffLlamaConfig", "DiffLlamaForCausalLM",  # differential attention: two softmaxes
     dict(_LLAMA, head_dim=16), None),
    ("olmo3", "dec", "Olmo3Config", "Olmo3ForCausalLM",  # sliding window 8, Q/K norms, post norms
     dict(_LLAMA, sliding_window=8, layer_types=["sliding_attention", "full_attention"]), None),
    ("helium", "dec", "HeliumConfig", "HeliumForCausalLM", dict(_LLAMA, head_dim=16), None),
    ("ernie4_5", "dec", "Ernie4_5Config", "Ernie4_5ForCausalLM", dict(_LLAMA, head_dim=16), None),
    ("seed_oss", "dec", "SeedOssConfig", "SeedOssForCausalLM", dict(_LLAMA, head_dim=16), None),
    ("jamba", "dec", "JambaConfig", "JambaForCausalLM",  # Mamba and attention layers, MoE every other layer
     dict(_LLAMA, num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
          expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_expand=2, use_mamba_kernels=False), None),
    ("xlm-roberta-xl", "enc", "XLMRobertaXLConfig", "XLMRobertaXLForMaskedLM", dict(_ENC), None),  # pre-norm
    ("data2vec-text", "enc", "Data2VecTextConfig", "Data2VecTextForMaskedLM", dict(_ENC), None),
    ("rembert", "enc", "RemBertConfig", "RemBertForMaskedLM",  # decoupled input and output embeddings
     dict(_ENC, input_embedding_size=32, output_embedding_size=48), None),
    ("convbert", "enc", "ConvBertConfig", "ConvBertForMaskedLM",  # span-based dynamic convolution heads
     dict(_ENC, embedding_size=64), None),
    ("eurobert", "enc", "EuroBertConfig", "EuroBertForMaskedLM", dict(_LLAMA), None),  # Llama-style encoder
    ("fsmt", "s2s", "FSMTConfig", "FSMTForConditionalGeneration",  # two vocabularies, sinusoidal positions
     dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
          encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=64, src_vocab_size=VOCAB,
          tgt_vocab_size=VOCAB, langs=["en", "de"], pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
          decoder_start_token_id=EOS), None),
    ("blenderbot_small", "s2s", "BlenderbotSmallConfig", "BlenderbotSmallForConditionalGeneration",
     dict(_BART, max_position_embeddings=64), None),
    ("t5gemma", "s2s", "T5GemmaConfig", "T5GemmaForConditionalGeneration",  # Gemma-2 encoder and decoder
     dict(encoder=dict(_LLAMA, head_dim=16, sliding_window=8), decoder=dict(_LLAMA, head_dim=16, sliding_window=8),
          **_S2S_IDS), None),
]
# More families (session 28): Llama relatives whose blocks differ (ReLU^2 MLPs, sub-norms, Q/K
# norms after rotary, interleaved partial rotary, clipped QKV), more mixture-of-experts routers (and
# JetMoE's mixture of attention heads), state-space and linear-attention hybrids and a pure Mamba
# (transfuse must leave what it does not know exactly as it was), encoders with task embeddings,
# pre-norm, full-attention BigBird and Funnel's pooling, and three more encoder-decoders.
FAMILIES += [
    ("arcee", "dec", "ArceeConfig", "ArceeForCausalLM", dict(_LLAMA), None),  # ReLU^2 MLP without a gate
    ("bitnet", "dec", "BitNetConfig", "BitNetForCausalLM", dict(_LLAMA), None),  # sub-norms inside attention and MLP
    ("dbrx", "dec", "DbrxConfig", "DbrxForCausalLM",  # fused Wqkv with clipping, 4 experts top 2
     dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=64,
          attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
          ffn_config=dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2), **IDS), None),
    ("doge", "dec", "DogeConfig", "DogeForCausalLM", dict(_LLAMA), None),  # dynamic mask attention
    ("dots1", "dec", "Dots1Config", "Dots1ForCausalLM",  # Q/K norms, DeepSeek-style routed and shared experts
     dict(_LLAMA, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
          first_k_dense_replace=1, n_group=1, topk_group=1), None),
    ("glm", "dec", "GlmConfig", "GlmForCausalLM", dict(_LLAMA, head_dim=16), None),  # interleaved partial rotary
    ("glm4_moe", "dec", "Glm4MoeConfig", "Glm4MoeForCausalLM",
     dict(_LLAMA, head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
          first_k_dense_replace=1, n_group=1, topk_group=1, use_qk_norm=True), None),
    ("hunyuan_v1_dense", "dec", "HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM",  # Q/K norms after rotary
     dict(_LLAMA, head_dim=16), None),
    ("hunyuan_v1_moe", "dec", "HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM",
     dict(_LLAMA, head_dim=16, num_experts=4, moe_topk=2), None),
    ("jetmoe", "dec", "JetMoeConfig", "JetMoeForCausalLM",  # mixture of attention heads and of MLPs
     dict(hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16, intermediate_size=96,
          num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64, **IDS), None),
    ("minimax", "dec", "MiniMaxConfig", "MiniMaxForCausalLM",  # lightning (linear) attention, then softmax attention
     dict(_LLAMA, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
          layer_types=["linear_attention", "full_attention"], block_size=8), None),
    ("ministral", "dec", "MinistralConfig", "MinistralForCausalLM",
     dict(_LLAMA, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]), None),
    ("nanochat", "dec", "NanoChatConfig", "NanoChatForCausalLM", dict(_LLAMA, head_dim=16), None),  # weightless norms
    ("vaultgemma", "dec", "VaultGemmaConfig", "VaultGemmaForCausalLM", dict(_LLAMA, head_dim=16, sliding_window=8), None),
    ("flex_olmo", "dec", "FlexOlmoConfig", "FlexOlmoForCausalLM", dict(_LLAMA, num_experts=4, num_experts_per_tok=2), None),
    ("mamba", "dec", "MambaConfig", "MambaForCausalLM",  # no attention at all
     dict(hidden_size=64, num_hidden_layers=2, state_size=8, expand=2, use_mambapy=False, **IDS), None),
    ("falcon_h1", "dec", "FalconH1Config", "FalconH1ForCausalLM",  # Mamba-2 beside attention in every layer
     dict(_LLAMA, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
          mamba_chunk_size=8), None),
    ("ctrl", "dec", "CTRLConfig", "CTRLLMHeadModel",  # sinusoidal positions, no causal-mask buffer
     dict(n_embd=64, n_layer=2, n_head=4, dff=96, n_positions=64, **IDS), None),
    ("ernie", "enc", "ErnieConfig", "ErnieForMaskedLM", dict(_ENC, use_task_id=True), None),  # task-type embeddings
    ("roberta-prelayernorm", "enc", "RobertaPreLayerNormConfig", "RobertaPreLayerNormForMaskedLM", dict(_ENC), None),
    ("bigbird", "enc", "BigBirdConfig", "BigBirdForMaskedLM", dict(_ENC, attention_type="original_full"), None),
    ("funnel", "enc", "FunnelConfig", "FunnelForMaskedLM",  # relative attention, pooling between blocks
     dict(d_model=64, n_head=4, d_head=16, d_inner=96, block_sizes=[1, 1], vocab_size=VOCAB, pad_token_id=1), None),
    ("mvp", "s2s", "MvpConfig", "MvpForConditionalGeneration", dict(_BART, max_position_embeddings=64), None),
    ("bigbird_pegasus", "s2s", "BigBirdPegasusConfig", "BigBirdPegasusForConditionalGeneration",
     dict(_BART, max_position_embeddings=64, attention_type="original_full"), None),
    ("nllb_moe", "s2s", "NllbMoeConfig", "NllbMoeForConditionalGeneration",  # top-2 experts with capacity
     dict(_BART, max_position_embeddings=64, num_experts=4, expert_capacity=8, encoder_sparse_step=2,
          decoder_sparse_step=2), None),
]
# Vision and audio (session 29): vision transformers on 32x32 images in 8x8 patches (16 patches, hd 16),
# CLIP's two towers, Swin's shifted windows, Whisper (an encoder-decoder from log-mel frames, with
# generate()) and CTC heads on raw waveforms. ConvNeXt (no attention) and the detection heads
# (YOLOS, DETR) are left out.
# kind: "img" (pixel_values), "vl" (CLIP: input_ids with right padding and pixel_values), "asr" (speech
# encoder-decoder: input_features, decoder ids, generate), "wav" (input_values, CTC logits per frame).
_IMG = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=96)  # ViT-B/16: 224, 16, 768, 12, 12, 3072
_WAV = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,  # base: 768, 12, 12
            conv_dim=(32, 32, 32), conv_kernel=(8, 3, 3), conv_stride=(4, 2, 2),  # 16 samples a frame (320)
            num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,  # 128, 16
            vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
FAMILIES += [
    ("vit", "img", "ViTConfig", "ViTForImageClassification", dict(_IMG, num_labels=10), None),  # CLS head
    ("deit", "img", "DeiTConfig", "DeiTModel", dict(_IMG), None),  # CLS and distillation tokens
    ("beit", "img", "BeitConfig", "BeitModel",  # relative position bias in every layer, layer scale, mean pooling
     dict(_IMG, use_relative_position_bias=True, layer_scale_init_value=0.1), None),
    ("data2vec-vision", "img", "Data2VecVisionConfig", "Data2VecVisionModel",  # BEiT with one shared bias table
     dict(_IMG, use_shared_relative_position_bias=True, layer_scale_init_value=0.1), None),
    ("dinov2", "img", "Dinov2Config", "Dinov2Model",  # layer scale; MLP width from mlp_ratio (128)
     dict({k: v for k, v in _IMG.items() if k != "intermediate_size"}, mlp_ratio=2), None),
    ("siglip", "img", "SiglipVisionConfig", "SiglipVisionModel", dict(_IMG), None),  # no CLS, attention-pooling head
    ("clip", "vl", "CLIPConfig", "CLIPModel",  # causal text tower (pools at the highest id: eos 2), vision tower
     dict(text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                           max_position_embeddings=64, **IDS),
          vision_config=dict(_IMG), projection_dim=32), None),
    # Swin's widths are embed_dim times 2 per stage: --scale leaves them (embed_dim is not in _WIDTHS).
    ("swin", "img", "SwinConfig", "SwinModel",  # 8x8 patches of 4, windows of 4 shifted by 2, then 4x4 (no shift)
     dict(image_size=32, patch_size=4, embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=4, mlp_ratio=2.0),
     None),
    ("whisper", "asr", "WhisperConfig", "WhisperForConditionalGeneration",  # 32 mel frames -> 16 positions, hd 16
     dict(num_mel_bins=16, max_source_positions=16, max_target_positions=64, d_model=64, encoder_layers=2,  # 80, 1500, 448
          decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=96,
          decoder_ffn_dim=96, suppress_tokens=None, begin_suppress_tokens=None,
          **dict(_S2S_IDS, decoder_start_token_id=BOS)), None),
    ("wav2vec2", "wav", "Wav2Vec2Config", "Wav2Vec2ForCTC",  # layer-norm feature extractor, pre-norm: takes a mask
     dict(_WAV, feat_extract_norm="layer", do_stable_layer_norm=True, conv_bias=True), None),
    ("hubert", "wav", "HubertConfig", "HubertForCTC", dict(_WAV), None),  # group-norm extractor, post-norm: no mask
    # more text variants (session 29; Nystromformer left out: eager runs only inputs of exactly
    # segment_means_seq_len tokens)
    ("gpt2:upcast", "dec", "GPT2Config", "GPT2LMHeadModel",  # scores in fp32 via baddbmm, 1/layer_idx scaling
     dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, reorder_and_upcast_attn=True,
          scale_attn_by_inverse_layer_idx=True, **IDS), "eager"),
    ("modernbert-decoder", "dec", "ModernBertDecoderConfig", "ModernBertDecoderForCausalLM",  # hd 32, local window 8
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=96, max_position_embeddings=64,
          local_attention=8, global_attn_every_n_layers=2, **IDS), None),
    ("xlnet", "enc", "XLNetConfig", "XLNetLMHeadModel",  # two-stream relative attention, hd 16
     dict(d_model=64, n_layer=2, n_head=4, d_inner=96, vocab_size=VOCAB, pad_token_id=PAD), None),
    ("longformer", "enc", "LongformerConfig", "LongformerForMaskedLM",  # sliding window of 4 plus global tokens
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, attention_window=[4, 4],
          max_position_embeddings=80, vocab_size=VOCAB, pad_token_id=1, bos_token_id=0, eos_token_id=2), None),
    ("luke", "enc", "LukeConfig", "LukeForMaskedLM",  # words only (no entity inputs)
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, entity_vocab_size=10,
          entity_emb_size=32, max_position_embeddings=66, vocab_size=VOCAB, pad_token_id=1), None),
    ("xmod", "enc", "XmodConfig", "XmodForMaskedLM",  # per-language adapters after each layer
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, max_position_embeddings=66,
          languages=["en_XX", "de_DE"], default_language="en_XX", vocab_size=VOCAB, pad_token_id=1), None),
    ("ibert", "enc", "IBertConfig", "IBertForMaskedLM",  # quant_mode off: RoBERTa through I-BERT's own modules
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, max_position_embeddings=66,
          vocab_size=VOCAB, pad_token_id=1), None),
    ("layoutlm", "enc", "LayoutLMConfig", "LayoutLMForMaskedLM",  # 2-D position embeddings (boxes default to 0)
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, max_position_embeddings=64,
          vocab_size=VOCAB, pad_token_id=PAD), None),
    ("fnet", "enc", "FNetConfig", "FNetForMaskedLM",  # no attention: Fourier mixing
     dict(hidden_size=64, num_hidden_layers=2, intermediate_size=96, max_position_embeddings=64, vocab_size=VOCAB,
          pad_token_id=PAD), None),
    # session 30: families not swept before
    ("openai-gpt", "dec", "OpenAIGPTConfig", "OpenAIGPTLMHeadModel",  # GPT-1: post-norm, no cache
     dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB), None),
    ("xlm", "enc", "XLMConfig", "XLMWithLMHeadModel",  # sinusoidal-free learned positions, post-norm
     dict(emb_dim=64, n_layers=2, n_heads=4, max_position_embeddings=64, vocab_size=VOCAB, pad_index=PAD), None),
    ("flaubert", "enc", "FlaubertConfig", "FlaubertWithLMHeadModel",  # XLM with pre-norm option
     dict(emb_dim=64, n_layers=2, n_heads=4, max_position_embeddings=64, vocab_size=VOCAB, pad_index=PAD,
          pre_norm=True), None),
    ("recurrent_gemma", "dec", "RecurrentGemmaConfig", "RecurrentGemmaForCausalLM",  # RG-LRU blocks beside local attention
     dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, intermediate_size=96,
          lru_width=64, attention_window_size=16, block_types=["recurrent", "recurrent", "attention"],
          vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS), None),
    ("zamba2", "dec", "Zamba2Config", "Zamba2ForCausalLM",  # Mamba-2 layers and a shared attention block
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
          mamba_d_state=8, mamba_headdim=16, mamba_ngroups=1, n_mamba_heads=8, layers_block_type=["mamba", "hybrid"],
          max_position_embeddings=64, use_mem_rope=True, **IDS), None),
    ("bamba", "dec", "BambaConfig", "BambaForCausalLM",  # Mamba-2 and attention layers
     dict(_LLAMA, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8,
          attn_layer_indices=[1]), None),
    ("qwen3_next", "dec", "Qwen3NextConfig", "Qwen3NextForCausalLM",  # gated delta-net linear attention + MoE
     dict(_LLAMA, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
          linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
          shared_expert_intermediate_size=32, full_attention_interval=2), None),
    ("ernie4_5_moe", "dec", "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",  # experts with a shared expert
     dict(_LLAMA, moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1,
          moe_layer_start_index=1), None),
    ("granitemoehybrid", "dec", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",  # Mamba-2 + attention + MoE
     dict(_LLAMA, num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8,
          mamba_n_groups=1, mamba_chunk_size=8, layer_types=["mamba", "attention"]), None),
]
# session 32: decoder families new in transformers 5.x, not swept before (experts cut to 4, 2 per token)
_FEW_EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES += [
    ("ministral3", "dec", "Ministral3Config", "Ministral3ForCausalLM", dict(_LLAMA, head_dim=16), None),
    ("cwm", "dec", "CwmConfig", "CwmForCausalLM", dict(_LLAMA, head_dim=16), None),  # Llama-3 with local layers
    ("hyperclovax", "dec", "HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", dict(_LLAMA, head_dim=16), None),
    ("jais2", "dec", "Jais2Config", "Jais2ForCausalLM", dict(_LLAMA, head_dim=16), None),
    ("olmo_hybrid", "dec", "OlmoHybridConfig", "OlmoHybridForCausalLM", dict(_LLAMA, head_dim=16), None),
    ("gpt_neox_japanese", "dec", "GPTNeoXJapaneseConfig", "GPTNeoXJapaneseForCausalLM", dict(_LLAMA), None),
    ("granite_swa", "dec", "GraniteSWAConfig", "GraniteSWAForCausalLM", dict(_LLAMA, head_dim=16), None),
    ("granitemoe_swa", "dec", "GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", dict(_LLAMA, head_dim=16), None),
    ("granitemoeshared", "dec", "GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(_LLAMA, head_dim=16),
     None),
    ("cohere2_moe", "dec", "Cohere2MoeConfig", "Cohere2MoeForCausalLM", dict(_LLAMA, head_dim=16), None),
    ("hrm_text", "dec", "HrmTextConfig", "HrmTextForCausalLM", dict(_LLAMA, head_dim=16), None),
    ("minimax_m2", "dec", "MiniMaxM2Config", "MiniMaxM2ForCausalLM",
     dict(_LLAMA, head_dim=16, num_local_experts=4, num_experts_per_tok=2), None),
    ("exaone_moe", "dec", "ExaoneMoeConfig", "ExaoneMoeForCausalLM", dict(_LLAMA, **_FEW_EXPERTS, head_dim=16, num_experts=4),
     None),
    ("mellum", "dec", "MellumConfig", "MellumForCausalLM", dict(_LLAMA, **_FEW_EXPERTS, head_dim=16, num_local_experts=4),
     None),
    ("laguna", "dec", "LagunaConfig", "LagunaForCausalLM",
     dict(_LLAMA, **_FEW_EXPERTS, head_dim=16, num_experts=4, shared_expert_intermediate_size=32), None),
    ("afmoe", "dec", "AfmoeConfig", "AfmoeForCausalLM", dict(_LLAMA, **_FEW_EXPERTS, head_dim=16, num_experts=4), None),
    ("zaya", "dec", "ZayaConfig", "ZayaForCausalLM", dict(_LLAMA, head_dim=16, num_experts=4, moe_intermediate_size=32),
     None),
    ("hy_v3", "dec", "HYV3Config", "HYV3ForCausalLM", dict(_LLAMA, **_FEW_EXPERTS, head_dim=16, num_experts=4), None),
    ("solar_open", "dec", "SolarOpenConfig", "SolarOpenForCausalLM",
     dict(_LLAMA, **_FEW_EXPERTS, head_dim=16, n_routed_experts=4), None),
    ("deepseek_v4", "dec", "DeepseekV4Config", "DeepseekV4ForCausalLM",
     dict(_LLAMA, **_FEW_EXPERTS, head_dim=16, n_routed_experts=4, q_lora_rank=32, o_lora_rank=32), None),
    ("nemotron_h", "dec", "NemotronHConfig", "NemotronHForCausalLM",
     dict(_LLAMA, head_dim=16, n_routed_experts=4, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
          mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=8), None),  # Mamba-2, MoE, attention
    ("gemma4_text", "dec", "Gemma4TextConfig", "Gemma4ForCausalLM",  # per-layer inputs, local and global layers
     dict(_LLAMA, head_dim=16, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16), None),
]
# session 33: more transformers-5.x families not swept before: linear-attention hybrids (Qwen3.5,
# Qwen3.5-MoE, Qwen4-Exp, Kimi-Linear, LFM2-MoE), MLA variants (DeepSeek-V3.2, GLM-4-MoE-Lite,
# GLM-MoE-DSA, LongCat-Flash, Youtu, A.X K1/K2, HY-V4), sparse-indexer attention, MoE with zero
# experts, Gemma-3n, and older decoders (Mamba-2, FalconMamba, BertGeneration, CPM-Ant, RWKV, TrOCR).
_MLA = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16)
_DELTA_NET = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                  layer_types=["linear_attention", "full_attention"])
FAMILIES += [
    ("qwen3_5_text", "dec", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(_LLAMA, head_dim=16, **_DELTA_NET), None),
    ("qwen3_5_moe_text", "dec", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
     dict(_LLAMA, **_FEW_EXPERTS, **_DELTA_NET, head_dim=16, num_experts=4, shared_expert_intermediate_size=32), None),
    ("qwen4_exp_text", "dec", "Qwen4ExpTextConfig", "Qwen4ExpForCausalLM",  # delta-net and indexed sparse attention
     dict(_LLAMA, **_FEW_EXPERTS, **dict(_DELTA_NET, layer_types=["linear_attention", "qwen_sparse_attention"]),
          head_dim=16, num_experts=4, shared_expert_intermediate_size=32, indexer_n_heads=2, indexer_kv_heads=1,
          indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2), None),
    ("kimi_linear", "dec", "KimiLinearConfig", "KimiLinearForCausalLM",  # KDA linear attention beside MLA
     dict(_LLAMA, **_FEW_EXPERTS, **dict(_MLA, q_lora_rank=None), num_experts=4, linear_head_dim=16, linear_num_heads=4,
          mlp_layer_types=["dense", "sparse"], layer_types=["linear_attention", "full_attention"]), None),
    ("lfm2_moe", "dec", "Lfm2MoeConfig", "Lfm2MoeForCausalLM",
     dict(_LLAMA, **_FEW_EXPERTS, head_dim=16, num_experts=4, num_dense_layers=1, layer_types=["conv", "full_attention"]),
     None),
    ("deepseek_v32", "dec", "DeepseekV32Config", "DeepseekV32ForCausalLM",  # MLA with a sparse top-k indexer
     dict(_LLAMA, **_FEW_EXPERTS, **_MLA, n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1,
          index_topk=8, index_head_dim=16, index_n_heads=2, mlp_layer_types=["dense", "sparse"],
          layer_types=["deepseek_sparse_attention"] * 2), None),
    ("glm4_moe_lite", "dec", "Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM",
     dict(_LLAMA, **_FEW_EXPERTS, **_MLA, n_routed_experts=4, n_shared_experts=1, mlp_layer_types=["dense", "sparse"]),
     None),
    ("glm_moe_dsa", "dec", "GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
     dict(_LLAMA, **_FEW_EXPERTS, **_MLA, n_routed_experts=4, n_shared_experts=1, index_topk=8, index_head_dim=16,
          index_n_heads=2, mlp_layer_types=["dense", "sparse"]), None),
    ("longcat_flash", "dec", "LongcatFlashConfig", "LongcatFlashForCausalLM",  # zero-computation experts
     dict(_LLAMA, **_FEW_EXPERTS, **_MLA, head_dim=8, n_routed_experts=4, moe_topk=2, zero_expert_num=2,
          expert_ffn_hidden_size=32, num_layers=1), None),
    ("youtu", "dec", "YoutuConfig", "YoutuForCausalLM", dict(_LLAMA, **_MLA, head_dim=8), None),
    ("axk1", "dec", "AXK1Config", "AXK1ForCausalLM",
     dict(_LLAMA, **_FEW_EXPERTS, **_MLA, head_dim=8, n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1,
          first_k_dense_replace=1), None),
    ("axk2", "dec", "AXK2Config", "AXK2ForCausalLM",
     dict(_LLAMA, **_FEW_EXPERTS, **_MLA, n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1,
          first_k_dense_replace=1), None),
    ("hy_v4", "dec", "HYV4Config", "HYV4ForCausalLM",  # MLA, an indexer, hyper-connections
     dict(_LLAMA, **_FEW_EXPERTS, **dict(_MLA, v_head_dim=16), n_routed_experts=4, index_topk=8, index_head_dim=16,
          index_n_heads=2), None),
    ("mimo_v2_flash", "dec", "MiMoV2FlashConfig", "MiMoV2FlashForCausalLM",  # qk 24 / v 16 heads, sliding window
     dict(_LLAMA, **_FEW_EXPERTS, head_dim=24, v_head_dim=16, n_routed_experts=4, sliding_window=8), None),
    ("aria_text", "dec", "AriaTextConfig", "AriaTextForCausalLM",
     dict(_LLAMA, head_dim=16, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1), None),
    ("minimax_m3_vl_text", "dec", "MiniMaxM3VLTextConfig", "MiniMaxM3VLForCausalLM",  # block-sparse indexed attention
     dict(_LLAMA, head_dim=16, num_local_experts=4, num_experts_per_tok=2, dense_intermediate_size=96,
          shared_intermediate_size=32, rotary_dim=8, index_n_heads=2, index_head_dim=16, index_block_size=4,
          index_topk_blocks=2), None),
    ("inkling_text", "dec", "InklingTextConfig", "InklingForCausalLM",  # relative-position SWA layers, MoE
     dict(_LLAMA, **_FEW_EXPERTS, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
          sliding_window_size=8, rel_extent=16, n_routed_experts=4, n_shared_experts=1), None),
    ("gemma3n_text", "dec", "Gemma3nTextConfig", "Gemma3nForCausalLM",  # AltUp, LAuReL, per-layer inputs
     dict(_LLAMA, head_dim=16, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, laurel_rank=8,
          sliding_window=8, layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0,
          activation_sparsity_pattern=[0.0, 0.0], altup_num_inputs=2), None),
    ("gemma4_unified_text", "dec", "Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM",
     dict(_LLAMA, head_dim=16, sliding_window=8), None),
    ("mamba2", "dec", "Mamba2Config", "Mamba2ForCausalLM",
     dict(hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=8, n_groups=1, chunk_size=8, **IDS),
     None),
    ("falcon_mamba", "dec", "FalconMambaConfig", "FalconMambaForCausalLM",
     dict(hidden_size=64, num_hidden_layers=2, state_size=8, **IDS), None),
    ("bert-generation", "dec", "BertGenerationConfig", "BertGenerationDecoder",
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, max_position_embeddings=64,
          is_decoder=True, **IDS), None),
    ("cpmant", "dec", "CpmAntConfig", "CpmAntForCausalLM",
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, dim_head=16, dim_ff=96, **IDS), None),
    ("rwkv", "dec", "RwkvConfig", "RwkvForCausalLM",
     dict(hidden_size=64, num_hidden_layers=2, attention_hidden_size=64, intermediate_size=96, context_length=64, **IDS),
     None),
    ("trocr", "dec", "TrOCRConfig", "TrOCRForCausalLM",
     dict(d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=96, max_position_embeddings=64, **IDS),
     None),
]
# session 32: encoder families new in transformers 5.x (MRA, YOSO: their CPU paths)
_ENC = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, max_position_embeddings=64,
            vocab_size=VOCAB, pad_token_id=PAD)
FAMILIES += [
    ("esmc", "enc", "EsmcConfig", "EsmcForMaskedLM", dict(_ENC), None),
    ("jina_embeddings_v3", "enc", "JinaEmbeddingsV3Config", "JinaEmbeddingsV3ForMaskedLM", dict(_ENC), None),
    ("nomic_bert", "enc", "NomicBertConfig", "NomicBertForMaskedLM", dict(_ENC), None),
    ("neomme", "enc", "NeoMMEConfig", "NeoMMEForMaskedLM", dict(_ENC), None),
    ("roc_bert", "enc", "RoCBertConfig", "RoCBertForMaskedLM",  # shape and pronunciation embeddings beside the ids
     dict(_ENC, shape_vocab_size=VOCAB, pronunciation_vocab_size=VOCAB), None),
    ("tapas", "enc", "TapasConfig", "TapasForMaskedLM", dict(_ENC), None),  # seven token-type embeddings
    ("mra", "enc", "MraConfig", "MraForMaskedLM", dict(_ENC), None),
    ("yoso", "enc", "YosoConfig", "YosoForMaskedLM", dict(_ENC), None),
]
# session 34: transformers-5.17 families not swept before: a byte-level model with entropy patching
# (BLT), a multimodal-RoPE text decoder (Cohere Compass), an mLSTM recurrence (xLSTM), Zamba v1,
# Reformer's chunked local and LSH attention, T5Gemma-2 and a composite bert2bert EncoderDecoderModel.
_BLT_PART = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2, intermediate_size=96,
                 max_position_embeddings=64, vocab_size=VOCAB)
_REFORMER = dict(hidden_size=64, attention_head_size=16, num_attention_heads=4, feed_forward_size=96,
                 attn_layers=["local", "lsh"], axial_pos_shape=[8, 8], axial_pos_embds_dim=[32, 32],
                 max_position_embeddings=64, local_attn_chunk_length=8, lsh_attn_chunk_length=8, num_buckets=4,
                 num_hashes=2, hash_seed=0,  # a fixed seed: the same random rotations (buckets) in every call
                 hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, **IDS)
_T5GEMMA2_TEXT = dict(_LLAMA, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"])
_BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, max_position_embeddings=64,
             **IDS)
FAMILIES += [
    # BLT: a patcher LM's entropies cut the bytes into patches (threshold 4.35: patches of 1 to 10 tokens with these
    # weights, no entropy within 1e-4 of it), hashed n-gram embeddings, local encoder and decoder cross-attending
    # to the patches, a global transformer over the patches; data-dependent patch counts
    ("blt", "dec", "BltConfig", "BltForCausalLM",
     dict(_BLT_PART, patching_mode="entropy", patching_threshold=4.35, patch_size=4, cross_attn_k=2,
          encoder_hash_byte_group_size=[3, 4], encoder_hash_byte_group_vocab=64, patcher_config=dict(_BLT_PART),
          encoder_config=dict(_BLT_PART, num_hidden_layers=1, hidden_size_global=64),
          decoder_config=dict(_BLT_PART, hidden_size_global=64), global_config=dict(_BLT_PART),
          pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS), None),
    ("cohere_compass_text", "dec", "CohereCompassTextConfig", "CohereCompassForCausalLM",  # 3-section mRoPE (sliding
     dict(_LLAMA, layer_types=["sliding_attention", "full_attention"], sliding_window=8, logit_scale=0.5,  # layer), NoPE
          rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0, mrope_section=[3, 3, 2]),
                               full_attention=None)), None),  # global layer, parallel attention+MLP, scaled logits
    ("xlstm", "dec", "xLSTMConfig", "xLSTMForCausalLM",  # mLSTM (matrix memory): chunkwise kernel, then step kernel
     dict(hidden_size=64, num_hidden_layers=2, num_heads=4, qk_dim_factor=1.0, chunk_size=8,
          autocast_kernel_dtype="float32", **IDS), None),
    ("zamba", "dec", "ZambaConfig", "ZambaForCausalLM",  # Mamba layers, one attention block shared by the hybrid layers
     dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, attention_head_dim=16,
          intermediate_size=96, n_mamba_heads=2, mamba_d_state=8, layers_block_type=["mamba", "hybrid", "hybrid"],
          use_mamba_kernels=False, max_position_embeddings=64, **IDS), None),
    ("reformer", "enc", "ReformerConfig", "ReformerForMaskedLM",  # chunked local and LSH (hashed-bucket) attention,
     dict(_REFORMER, local_num_chunks_after=1, lsh_num_chunks_after=1), None),  # axial positions, reversible layers
    ("reformer:lm", "dec", "ReformerConfig", "ReformerModelWithLMHead",  # causal local and LSH, its own bucket cache
     dict(_REFORMER, is_decoder=True), None),
    ("t5gemma2", "s2s", "T5Gemma2Config", "T5Gemma2ForConditionalGeneration",  # Gemma-3 blocks, merged self+cross
     dict(encoder=dict(text_config=dict(_T5GEMMA2_TEXT), vision_config=dict(_IMG), mm_tokens_per_image=4),  # attention
          decoder=dict(_T5GEMMA2_TEXT), **_S2S_IDS), None),  # (a tiny SigLIP tower is built but gets no image)
    ("bert2bert", "s2s", "EncoderDecoderConfig", "EncoderDecoderModel",  # composite: BERT encoder, BERT decoder with
     dict(encoder=dict(_BERT, model_type="bert"),  # cross-attention (EncoderDecoderConfig.for_model sub-configs)
          decoder=dict(_BERT, model_type="bert", is_decoder=True, add_cross_attention=True),
          pad_token_id=PAD, decoder_start_token_id=BOS), None),
]
# session 35: text models of transformers 5.17 that no entry above builds: Mistral-4 (MLA and experts, interleaved
# rope), Mllama's text decoder (cross-attention layers, here without images), Emu3's text decoder, Nystromformer
# (landmarks = segment length: its softmax path, whatever the input length, and the conv on the values)
FAMILIES += [
    ("mistral4", "dec", "Mistral4Config", "Mistral4ForCausalLM",  # MLA: qk 24 (16 + rope 8), v 16; 4 experts
     dict(_LLAMA, **_MLA, **_FEW_EXPERTS, qk_head_dim=24, head_dim=24, n_shared_experts=1, n_routed_experts=4,
          n_group=1, topk_group=1, first_k_dense_replace=1), None),
    ("mllama_text", "dec", "MllamaTextConfig", "MllamaForCausalLM",  # layer 1 a cross-attention layer (no image: skipped)
     dict(_LLAMA, num_hidden_layers=3, cross_attention_layers=[1]), None),
    ("emu3_text", "dec", "Emu3TextConfig", "Emu3ForCausalLM", dict(_LLAMA, attention_dropout=0.0), None),
    ("nystromformer", "enc", "NystromformerConfig", "NystromformerForMaskedLM",  # landmark (Nystrom) attention, a
     dict(_ENC, num_landmarks=64, segment_means_seq_len=64, conv_kernel_size=3), None),  # depthwise conv on values
]
# Vision-language models asked for text only, as users often do: the whole model class (its vision tower built,
# no image given). Qwen2-VL's family take multimodal RoPE: position ids (3, batch, seq) from get_rope_index, the
# head dim's frequencies in three sections, rope deltas carried through generate().
_MROPE_TEXT = dict(_LLAMA, head_dim=16, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                            mrope_section=[2, 3, 3]))
_QWEN_VISION = dict(depth=1, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
FAMILIES += [
    ("qwen2_vl", "dec", "Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
     dict(text_config=dict(_MROPE_TEXT), vision_config=dict(_QWEN_VISION, embed_dim=32, mlp_ratio=2), **IDS), None),
    ("qwen2_5_vl", "dec", "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration",
     dict(text_config=dict(_MROPE_TEXT), vision_config=dict(_QWEN_VISION, intermediate_size=96, out_hidden_size=64,
                                                            window_size=28, fullatt_block_indexes=[0]), **IDS), None),
    ("qwen3_vl", "dec", "Qwen3VLConfig", "Qwen3VLForConditionalGeneration",  # interleaved mRoPE, deepstack
     dict(text_config=dict(_MROPE_TEXT, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                             mrope_section=[2, 3, 3], mrope_interleaved=True)),
          vision_config=dict(_QWEN_VISION, intermediate_size=96, out_hidden_size=64, num_position_embeddings=16,
                             deepstack_visual_indexes=[0]), **IDS), None),
    ("git", "dec", "GitConfig", "GitForCausalLM",  # GIT: a BERT-style causal decoder over (here no) image tokens
     dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96, max_position_embeddings=64,
          vision_config=dict(_IMG), **IDS), None),
    ("gemma3", "dec", "Gemma3Config", "Gemma3ForConditionalGeneration",  # Gemma-3 with its SigLIP tower, text only
     dict(text_config=dict(_LLAMA, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"]),
          vision_config=dict(_IMG), mm_tokens_per_image=4, **IDS), None),
]
MEDIA = ("img", "vl", "asr", "wav")  # kinds whose inputs are not (only) token ids
GENERATIVE = ("dec", "s2s", "asr")  # kinds with generate() checks
BY_NAME = {f[0]: f for f in FAMILIES}


_WIDTHS = ("hidden_size", "n_embd", "d_model", "dim", "hidden_dim", "intermediate_size", "n_inner", "d_ff",
           "encoder_ffn_dim", "decoder_ffn_dim", "head_dim", "d_kv", "rotary_dim", "embedding_size")
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_encoder_position_embeddings",
              "max_decoder_position_embeddings", "max_target_positions")


def geometry(config: dict, nested: bool = False) -> dict:
    """A family's config at the sweep's geometry: widths times SCALE, and position tables that
    hold the longest input of SEQS plus the generated tokens (in steps of 64). nested: the same for
    the sub-configs given as dicts (CLIP's text_config and vision_config)."""
    longest = max(max(SEQS) + NEW_TOKENS, SEQS[0] + (LONG_TOKENS if "long" in EXTRA else 0)) + 8
    extra = max(0, -(-(longest - 64) // 64) * 64)
    out = dict(config)
    for key, v in config.items():
        if key in _WIDTHS and isinstance(v, int):
            out[key] = v * SCALE
        elif key in _POSITIONS and isinstance(v, int):
            out[key] = v + extra
        elif nested and isinstance(v, dict):
            out[key] = geometry(v)
    return out


def base_name(name: str) -> str:
    return name.split(":")[0]


def select(only: str | None, skip: str | None) -> list[str]:
    """Family names in the order above; --only/--skip name a family (all its variants) or one variant,
    or a vision/audio kind (img, vl, asr, wav: all its families)."""
    def hit(name, wanted):
        kind = BY_NAME[name][1]
        return name in wanted or base_name(name) in wanted or (kind in MEDIA and kind in wanted)
    names = [f[0] for f in FAMILIES]
    if only:
        wanted = {w.strip() for w in only.split(",") if w.strip()}
        unknown = [w for w in wanted if not any(hit(n, {w}) for n in names)]
        if unknown:
            raise SystemExit(f"family_sweep: unknown families {unknown}; see --list")
        names = [n for n in names if hit(n, wanted)]
    if skip:
        wanted = {w.strip() for w in skip.split(",") if w.strip()}
        names = [n for n in names if not hit(n, wanted)]
    return names


# ---------------------------------------------------------------------------------------------
# One unit: (family, dtype), run inside a worker.
# ---------------------------------------------------------------------------------------------
class EagerFailed(Exception):
    """Eager in the same dtype raised too: the check is a SKIP."""


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _maxabs(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def _spread_weights(model) -> None:
    """Hugging Face's initialisation (std 0.02, zero biases, unit norms) leaves a 2-layer model
    close to the identity: its logits are the input embedding's, and greedy generation repeats the
    last token. Matrices get std 1/sqrt(their larger side), biases and norm weights noise of 0.1 around
    their initial value, so that every layer moves the logits and errors show."""
    import torch

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if p.dim() >= 2:
                p.copy_(noise / math.sqrt(max(p.shape[-1], p.shape[-2])))
            else:
                p.add_(0.1 * noise)


def _dynamo_alone(model):
    """A copy of the model under Dynamo without transfuse (its "eager" backend, dynamic shapes): what
    a failure looks like when it is inherited from the trace rather than made by transfuse."""
    import torch

    return torch.compile(copy.deepcopy(model), backend="eager", dynamic=True)


def _cuda_fault(exc: BaseException) -> bool:
    """A device-side fault (misaligned address, illegal memory access...): the CUDA context is lost."""
    return "CUDA error" in str(exc) or type(exc).__name__ == "AcceleratorError"


def _logits(out):
    return out.logits if hasattr(out, "logits") else out[0]


class Unit:
    def __init__(self, family: str, dtype: str, device: str, emit):
        self.family, self.dtype, self.device, self.emit = family, dtype, device, emit
        self.spec = BY_NAME[family]
        self.kind = self.spec[1]
        self.seq2seq = self.kind in ("s2s", "asr")  # generate() starts the decoder from its start token
        self.records: list[dict] = []
        self.logit_diff = 0.0  # max-abs logit difference transfuse vs eager-in-dtype over the forwards
        self.eager_error = 0.0  # max-abs logit error of eager-in-dtype against fp32 over the forwards
        self.eager_nonfinite = False  # eager's logits in this dtype had an inf or a NaN

    def record(self, check: str, status: str, **fields):
        rec = dict(family=self.family, dtype=self.dtype, check=check, status=status, device=self.device, **fields)
        self.records.append(rec)
        self.emit(rec)

    # -- building --------------------------------------------------------------------------
    def build(self):
        import torch
        import transformers

        name, kind, config_cls, model_cls, config, attn = self.spec
        # a copy: some config classes consume their sub-config dicts (EncoderDecoderConfig pops "model_type")
        cfg = getattr(transformers, config_cls)(**geometry(copy.deepcopy(config), nested=kind in MEDIA))
        if attn is not None:
            cfg._attn_implementation = attn
        torch.manual_seed(0)
        ref = getattr(transformers, model_cls)(cfg).eval()
        _spread_weights(ref)
        ref = ref.to(self.device)
        dtype = self.torch_dtype()
        eager = copy.deepcopy(ref).to(dtype) if dtype != torch.float32 else copy.deepcopy(ref)
        ours = copy.deepcopy(eager)
        saved = {k: v.detach().clone() for k, v in ours.state_dict().items()}
        attn_used = getattr(ref.config, "_attn_implementation", None)
        return ref, eager, ours, saved, attn_used

    def inputs(self, seq: int, batch: int = BATCH, seed: int = 0) -> dict:
        """ids with padding (decoders: left; encoder inputs: right) set to the pad id; rows 1 and 2
        padded by 3 and 6 positions."""
        import torch

        if self.kind in ("img", "asr", "wav"):
            return self.media_inputs(seq, batch, seed)
        g = torch.Generator().manual_seed(1000 * seq + seed)
        ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
        mask = torch.ones_like(ids)
        pad = self.spec[4].get("pad_token_id", PAD)
        for row, n in ((1, 3), (2, 6)):
            if row < batch:
                if self.kind == "dec":
                    mask[row, :n] = 0
                else:
                    mask[row, seq - n:] = 0
        ids = ids.masked_fill(mask == 0, pad)
        kw = dict(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
        if self.kind == "s2s":
            dec = torch.randint(3, VOCAB, (batch, DECODER_SEQS.get(seq, max(7, seq // 3))), generator=g)
            kw["decoder_input_ids"] = dec.to(self.device)
        if self.kind == "vl":  # CLIP: the text above (right padding) and as many images
            kw["pixel_values"] = self.media_inputs(seq, batch, seed, g)["pixel_values"]
        return kw

    def media_inputs(self, seq: int, batch: int, seed: int, g=None) -> dict:
        """Standard-normal pixel_values (batch, channels, size, size); Whisper's input_features (batch,
        mel bins, 2 * max_source_positions: its encoder takes no other length) and decoder ids; raw
        input_values (batch, samples) making `seq` frames, with rows 1 and 2 padded by 3 and 6 frames'
        samples (zeros, masked) where the feature extractor takes a mask (feat_extract_norm="layer";
        Hugging Face says group-norm models must be given unpadded inputs and no mask). Float inputs
        are rounded to the unit's dtype, so that the fp32 reference sees the values the others do;
        cast() gives each model its own dtype."""
        import torch

        g = g or torch.Generator().manual_seed(1000 * seq + seed)
        cfg = self.spec[4]
        if self.kind in ("img", "vl"):
            vision = cfg.get("vision_config", cfg)
            size = vision["image_size"]
            pixels = torch.randn(batch, vision.get("num_channels", 3), size, size, generator=g)
            return dict(pixel_values=self._rounded(pixels).to(self.device))
        if self.kind == "asr":
            feats = torch.randn(batch, cfg["num_mel_bins"], 2 * cfg["max_source_positions"], generator=g)
            dec = torch.randint(3, VOCAB, (batch, DECODER_SEQS.get(seq, max(7, seq // 3))), generator=g)
            return dict(input_features=self._rounded(feats).to(self.device), decoder_input_ids=dec.to(self.device))
        # "wav": the samples whose convolutions give exactly `seq` frames
        samples, hop = seq, 1
        for k, stride in zip(reversed(cfg["conv_kernel"]), reversed(cfg["conv_stride"])):
            samples, hop = (samples - 1) * stride + k, hop * stride
        values = torch.randn(batch, samples, generator=g)
        kw = dict(input_values=values)
        if cfg.get("feat_extract_norm") == "layer":
            mask = torch.ones(batch, samples, dtype=torch.long)
            for row, n in ((1, 3), (2, 6)):
                if row < batch:
                    mask[row, samples - n * hop:] = 0
            kw = dict(input_values=values.masked_fill(mask == 0, 0.0), attention_mask=mask)
        return {k: self._rounded(v).to(self.device) for k, v in kw.items()}

    def torch_dtype(self):
        import torch

        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.dtype]

    def _rounded(self, t):
        return t.to(self.torch_dtype()).float() if t.is_floating_point() else t

    @staticmethod
    def cast(kw: dict, model) -> dict:
        """kw with its float tensors in the model's dtype (token ids, masks and flags as they are): Whisper's
        and wav2vec2's convolutions do not cast their input to their weights' dtype."""
        import torch

        return {k: v.to(model.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in kw.items()}

    def output_mask(self, model, kw: dict, seq: int):
        """The positions of the outputs that a forward check compares (None: all of them): the
        token mask for text, the frames of the samples that are not padding for a waveform; none for
        images, CLIP's pooled similarities and Whisper's decoder."""
        if self.kind in ("img", "vl", "asr"):
            return None
        if self.kind == "wav":
            mask = kw.get("attention_mask")
            return None if mask is None else model._get_feature_vector_attention_mask(seq, mask)
        return kw.get("attention_mask")

    # -- checks ----------------------------------------------------------------------------
    def run_eager(self, fn):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - any eager failure makes the check a SKIP
            if _cuda_fault(exc):
                raise  # sticky: raised by the first call after the faulting kernel, which may be ours
            raise EagerFailed(_short(exc)) from exc

    def _compared(self, out, variant: str | None, mask) -> list[tuple[str, object]]:
        """The tensors a forward check compares, each cut to its positions that are not padding:
        the logits, and the hidden states or attention probabilities the variant asks for."""
        import torch

        items = [("logits", _logits(out))]
        # what _logits() took: logits, or the first field set (last_hidden_state, logits_per_image)
        self.main_output = "logits" if hasattr(out, "logits") else next(iter(out.keys()), "[0]")
        if self.kind == "img" and isinstance(getattr(out, "pooler_output", None), torch.Tensor):
            items.append(("pooler_output", out.pooler_output))
        elif self.kind == "vl":
            items += [("text_embeds", out.text_embeds), ("image_embeds", out.image_embeds)]
        if variant == "hidden":
            keys = ("hidden_states", "encoder_hidden_states", "decoder_hidden_states")
        elif variant == "attn":
            keys = ("attentions", "encoder_attentions", "decoder_attentions", "cross_attentions")
        else:
            keys = ()
        for key in keys:
            value = getattr(out, key, None)
            if isinstance(value, torch.Tensor):  # an encoder's last hidden state, not a tuple
                continue
            items += [(f"{key}[{i}]", t) for i, t in enumerate(value or ()) if t is not None]
        cut = []
        for name, t in items:
            t = t.float()
            on_encoder = not self.seq2seq or name.startswith("encoder")
            if mask is not None and on_encoder:
                keep = mask.bool()
                t = t.transpose(1, 2)[keep] if "attentions" in name else t[keep]  # (B, H, Sq, Sk): by query
            cut.append((name, t))
        return cut

    def forward(self, ref, eager, ours, seq: int, variant: str | None = None, batch: int = BATCH):
        import torch

        kw = self.inputs(seq, batch=1 if variant == "nomask" else batch)
        keep = self.output_mask(ref, kw, seq)
        if variant == "nomask":
            kw.pop("attention_mask")
        if variant in ("hidden", "attn"):
            kw[f"output_{'hidden_states' if variant == 'hidden' else 'attentions'}"] = True

        def call(model):
            args = self.cast(kw, model)
            if variant == "embeds":  # each model embeds with its own (equal) table, in its own dtype
                args["inputs_embeds"] = model.get_input_embeddings()(args.pop("input_ids"))
            return self._compared(model(**args), variant, keep)

        with torch.no_grad():
            want = self.run_eager(lambda: call(ref))
            base = self.run_eager(lambda: call(eager))
            try:
                got = call(ours)
            except Exception as exc:  # noqa: BLE001
                # Does Dynamo alone raise it too (the model's code under torch.compile)? Then inherited.
                try:
                    call(_dynamo_alone(eager))
                except Exception as again:  # noqa: BLE001
                    if type(again) is type(exc):
                        return dict(status="SKIP", reason=f"inherited: {_short(exc)}; torch.compile(backend='eager', "
                                                          f"dynamic=True) without transfuse raises it too")
                raise
        if [n for n, _ in got] != [n for n, _ in want]:
            reason = f"outputs {[n for n, _ in got][:6]} != eager's {[n for n, _ in want][:6]}"
            with torch.no_grad():
                # the same history as ours: the plain forwards first (graphs traced without the variant)
                alone_model = _dynamo_alone(eager)
                alone_model(**self.cast(self.inputs(seq, batch=batch), eager))
                alone = call(alone_model)
            if [n for n, _ in alone] == [n for n, _ in got]:
                return dict(status="SKIP", reason=f"inherited: {reason}; torch.compile(backend='eager', dynamic=True) "
                                                  f"without transfuse returns the same")
            return dict(status="FAIL", reason=reason)
        bad = [n for (n, g), (_, w) in zip(got, want) if g.shape != w.shape]
        if bad:
            return dict(status="FAIL", reason=f"{bad[0]} shape differs from eager's")
        worst = None
        for (name, g), (_, w), (_, b) in zip(got, want, base):
            if not torch.isfinite(b).all():
                if name == "logits":
                    self.eager_nonfinite = True
                    return dict(status="SKIP", reason="eager's logits in this dtype are not finite")
                continue
            err_ours, err_eager = _rel(g, w), _rel(b, w)
            tol = 2 * err_eager + ATOL[self.dtype]
            if name == "logits" and variant is None:
                self.logit_diff = max(self.logit_diff, _maxabs(g, b))
                self.eager_error = max(self.eager_error, _maxabs(b, w))
            ratio = err_ours / tol if math.isfinite(err_ours) else math.inf
            if worst is None or ratio > worst[0]:
                worst = (ratio, name, dict(err_ours=err_ours, err_eager=err_eager, tol=tol, maxabs_ours=_maxabs(g, w),
                                           maxabs_eager=_maxabs(b, w), logit_scale=float(w.abs().max())))
        ratio, name, fields = worst
        fields.update(compared=len(got), worst=name)
        if self.kind in MEDIA:  # "logits" above is the model's main output: name it
            fields.update(output=self.main_output, batch=batch)
        if ratio <= 1:
            return dict(status="PASS", reason="", **fields)
        label = f"fwd{seq}" + (f" {variant}" if variant else "") + (f" {name}" if name != "logits" else "")
        reason = f"{label} rel err {fields['err_ours']:.2e} > {fields['tol']:.2e} (eager {fields['err_eager']:.2e})"
        # Does Dynamo alone (no transfuse: its "eager" backend, dynamic shapes) give the same error?
        # Then the failure is inherited from the trace of the model, not made by transfuse.
        try:
            traced = _dynamo_alone(eager)
            with torch.no_grad():
                mine = dict(call(traced))[name]
            err_dynamo = _rel(mine, dict(want)[name])
            fields["err_dynamo"] = err_dynamo
        except Exception as exc:  # noqa: BLE001
            fields["err_dynamo"] = f"raises {_short(exc)}"
            return dict(status="FAIL", reason=reason, **fields)
        tol = fields["tol"]
        if err_dynamo > tol and abs(err_dynamo - fields["err_ours"]) <= 0.05 * err_dynamo + ATOL[self.dtype]:
            return dict(status="SKIP", reason=f"inherited: {reason}; torch.compile(backend='eager', dynamic=True) "
                                              f"without transfuse gives {err_dynamo:.2e}", **fields)
        return dict(status="FAIL", reason=f"{reason}; Dynamo alone {err_dynamo:.2e}", **fields)

    def fp32_logits(self, fp32_model, kw: dict, row: int, tokens, prompt: int):
        """The fp32 model's logits (fp32, one row per position) after each of `tokens`: an
        encoder-decoder's decoder tokens over the row's encoder input, or a decoder's prompt
        (`prompt` tokens, the row's padding kept) and what follows it."""
        import torch

        tokens = tokens.to(self.device)
        with torch.no_grad():
            if self.seq2seq:  # the row's encoder inputs: ids and mask, or Whisper's input_features
                out = fp32_model(**{k: v[row:row + 1] for k, v in self.cast(kw, fp32_model).items()
                                    if k != "decoder_input_ids"},
                                 decoder_input_ids=tokens[None])
            else:
                mask = torch.ones(1, tokens.shape[0], dtype=kw["attention_mask"].dtype, device=self.device)
                mask[0, :prompt] = kw["attention_mask"][row]
                out = fp32_model(input_ids=tokens[None], attention_mask=mask)
        return _logits(out)[0].float()

    def fp32_gap(self, fp32_model, kw: dict, row: int, prefix, prompt: int, a: int, b: int) -> float:
        """The fp32 model's logit of token a minus that of token b, after `prefix` (the tokens both
        runs agree on) of one row: whether the fp32 model too prefers eager's token."""
        logits = self.fp32_logits(fp32_model, kw, row, prefix, prompt)[-1]
        return float(logits[a] - logits[b])

    def fp32_score(self, fp32_model, kw: dict, row: int, sequence) -> float:
        """The fp32 model's mean log-probability of the tokens `sequence` generated after one row's
        prompt, up to its first EOS: a beam's score as generate() gives it with length_penalty 1."""
        import torch

        sequence = sequence.to(self.device)
        if self.seq2seq:  # after the decoder's start token
            new = sequence[1:]
            logits = self.fp32_logits(fp32_model, kw, row, sequence[:-1], 1)
        else:
            prompt = kw["input_ids"].shape[1]
            new = sequence[prompt:]
            logits = self.fp32_logits(fp32_model, kw, row, sequence, prompt)[prompt - 1:-1]
        # a beam that ended early holds its EOS, then padding (which may be a token the model emits)
        eos = fp32_model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        ended = torch.isin(new, torch.tensor(eos, dtype=new.dtype, device=new.device)).nonzero()
        keep = int(ended[0]) + 1 if len(ended) else new.shape[0]
        logp = torch.log_softmax(logits[:keep], dim=-1).gather(-1, new[:keep, None])
        return float(logp.mean())

    def generate(self, eager, ours, seq: int, batch: int, fp32_model=None, new_tokens: int = NEW_TOKENS):
        import torch

        kw = self.inputs(seq, batch=batch, seed=1)
        kw.pop("decoder_input_ids", None)
        gen = dict(max_new_tokens=new_tokens, do_sample=False, num_beams=1, pad_token_id=self.spec[4].get("pad_token_id", PAD))
        scored = dict(output_scores=True, return_dict_in_generate=True)
        with torch.no_grad():
            ref = self.run_eager(lambda: eager.generate(**self.cast(kw, eager), **gen, **scored))
            # Whisper's generate() drops the decoder's start token from a plain tensor, not from a dict
            out = ours.generate(**self.cast(kw, ours), **gen, **(scored if self.kind == "asr" else {}))
        want = ref.sequences.cpu()
        got = out.cpu() if isinstance(out, torch.Tensor) else out.sequences.cpu()
        # what precedes the generated tokens: the prompt, or an encoder-decoder's start token
        # (scores[i] chose sequences[:, prompt + i])
        prompt = 1 if self.seq2seq else kw["input_ids"].shape[1]
        want, got = self._pad_to(want, got, gen["pad_token_id"])
        scores = [s.float().cpu() for s in ref.scores]
        tie_tol = max(TIE_FACTOR * self.logit_diff, TIE_FLOOR[self.dtype])
        equal = ties = bad = dtype_noise = 0
        margins, gaps = [], []
        for row in range(batch):
            diff = (want[row, prompt:] != got[row, prompt:]).nonzero()
            if not len(diff):
                equal += 1
                continue
            step = int(diff[0])
            if step < len(scores):
                top = scores[step][row].topk(2).values
                margin = float(top[0] - top[1])
            else:
                margin = None  # past eager's last step (EOS): a length difference
            margins.append(margin)
            if margin is not None and margin < tie_tol:
                ties += 1
                continue
            gap = None
            if fp32_model is not None and margin is not None:
                # The fp32 model as arbiter: if it prefers ours, or prefers eager's token by less
                # than TIE_FACTOR x eager's own logit error in this dtype, either token is a
                # faithful answer in this dtype (the two runs' errors differ, not their meaning).
                gap = self.fp32_gap(fp32_model, kw, row, want[row, :prompt + step], prompt,
                                    int(want[row, prompt + step]), int(got[row, prompt + step]))
                gaps.append(gap)
            if gap is not None and gap < TIE_FACTOR * self.eager_error:
                dtype_noise += 1
            else:
                bad += 1
        fields = dict(rows=batch, equal=equal, near_ties=ties, mismatched=bad, tie_tol=tie_tol,
                      margins_at_divergence=margins, fp32_gaps=gaps, dtype_noise=dtype_noise, prompt_len=seq,
                      tokens_match=float((want == got).float().mean()))
        reason = "" if not bad else (f"generate batch {batch}: {bad}/{batch} rows differ (margins {margins}, "
                                     f"fp32 prefers eager's token by {gaps})")
        return dict(status="FAIL" if bad else "PASS", reason=reason, **fields)

    def _pad_to(self, a, b, fill):
        import torch.nn.functional as F

        width = max(a.shape[-1], b.shape[-1])
        return F.pad(a, (0, width - a.shape[-1]), value=fill), F.pad(b, (0, width - b.shape[-1]), value=fill)

    def beam(self, eager, ours, seq: int, fp32_model=None):
        """Beam search at batch 2, 3 beams, all returned. A row passes when its best beam is eager's;
        a different best beam is a near-tie when eager too found it, or scored it, within the tie
        tolerance of its own best (sequence scores are mean log-probabilities per token). Past that,
        the fp32 model is the arbiter, as in generate(): it scores both best beams, and if it prefers
        ours, or eager's by less than TIE_FACTOR x eager's own logit error in this dtype, the two are
        the same answer within the dtype's error (a mixture-of-experts router that flips an expert in
        fp16 moves logits far more than rounding does, in eager as in transfuse)."""
        import torch

        kw = self.inputs(seq, batch=2, seed=2)
        kw.pop("decoder_input_ids", None)
        fill = self.spec[4].get("pad_token_id", PAD)
        gen = dict(max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=3, num_return_sequences=3, pad_token_id=fill,
                   output_scores=True, return_dict_in_generate=True)
        with torch.no_grad():
            ref = self.run_eager(lambda: eager.generate(**self.cast(kw, eager), **gen))
            out = ours.generate(**self.cast(kw, ours), **gen)
        want, got = self._pad_to(ref.sequences.cpu(), out.sequences.cpu(), fill)
        want, got = want.view(2, 3, -1), got.view(2, 3, -1)
        ws, gs = ref.sequences_scores.float().cpu().view(2, 3), out.sequences_scores.float().cpu().view(2, 3)
        tie_tol = max(TIE_FACTOR * self.logit_diff, TIE_FLOOR[self.dtype])
        equal = ties = bad = dtype_noise = 0
        gaps, fp32_gaps = [], []
        for row in range(2):
            if torch.equal(want[row, 0], got[row, 0]):
                equal += 1
                gaps.append(float((gs[row, 0] - ws[row, 0]).abs()))
                continue
            same = [j for j in range(3) if torch.equal(want[row, j], got[row, 0])]
            gap = float(ws[row, 0] - ws[row, same[0]]) if same else float((ws[row, 0] - gs[row, 0]).abs())
            gaps.append(gap)
            if gap < tie_tol:
                ties += 1
                continue
            if fp32_model is not None:
                scores = [self.fp32_score(fp32_model, kw, row, seqs[row, 0]) for seqs in (want, got)]
                fp32_gaps.append(scores[0] - scores[1])
                if scores[0] - scores[1] < TIE_FACTOR * self.eager_error:
                    dtype_noise += 1
                    continue
            bad += 1
        fields = dict(rows=2, equal=equal, near_ties=ties, mismatched=bad, tie_tol=tie_tol, score_gaps=gaps,
                      fp32_gaps=fp32_gaps, dtype_noise=dtype_noise, eager_error=self.eager_error)
        reason = "" if not bad else (f"beam search: {bad}/2 rows' best beams differ (score gaps {gaps}, tie {tie_tol:.1e}; "
                                     f"fp32 prefers eager's by {fp32_gaps})")
        return dict(status="FAIL" if bad else "PASS", reason=reason, **fields)

    def sample(self, eager, ours, seq: int):
        """Sampling from one seed at batch 2: both runs must draw the same random numbers (the
        generator's state after generate() equal), and so give the same tokens except where a draw
        lands between the two runs' probabilities (then the rest of that row differs)."""
        import torch

        if self.eager_nonfinite:  # multinomial over a NaN asserts on the GPU, and ends the process's CUDA
            return dict(status="SKIP", reason="sample: eager's logits in this dtype are not finite")
        kw = self.inputs(seq, batch=2, seed=3)
        kw.pop("decoder_input_ids", None)
        fill = self.spec[4].get("pad_token_id", PAD)
        gen = dict(max_new_tokens=NEW_TOKENS, do_sample=True, top_k=20, num_beams=1, pad_token_id=fill)
        state = torch.cuda.get_rng_state if self.device == "cuda" else torch.get_rng_state
        with torch.no_grad():
            torch.manual_seed(7)
            want = self.run_eager(lambda: eager.generate(**self.cast(kw, eager), **gen)).cpu()
            drawn_eager = state()
            torch.manual_seed(7)
            got = ours.generate(**self.cast(kw, ours), **gen).cpu()
            drawn_ours = state()
        want, got = self._pad_to(want, got, fill)
        equal = sum(bool(torch.equal(want[r], got[r])) for r in range(2))
        same_draws = torch.equal(drawn_eager, drawn_ours)
        # an encoder-decoder's start token (Whisper's plain tensor has dropped it), or the prompt
        prompt = {"s2s": 1, "asr": 0}[self.kind] if self.seq2seq else kw["input_ids"].shape[1]
        first_equal = bool(torch.equal(want[:, prompt], got[:, prompt]))
        fields = dict(rows=2, equal=equal, near_ties=0, mismatched=2 - equal, same_draws=same_draws,
                      tokens_match=float((want == got).float().mean()))
        if not same_draws:
            return dict(status="FAIL", reason="sampling from one seed: the random generator's state after generate() "
                                              "differs from eager's (random numbers drawn differently)", **fields)
        if not equal and not first_equal:
            return dict(status="FAIL", reason="sampling from one seed: no row equals eager's, not even the first "
                                              "sampled token", **fields)
        return dict(status="PASS", reason="", **fields)

    def run(self):
        import torch

        import transfuse

        t0 = time.perf_counter()
        try:
            ref, eager, ours, saved, attn = self.build()
        except Exception as exc:  # noqa: BLE001
            self.record("build", "SKIP", reason=f"build fails: {_short(exc)}", traceback=traceback.format_exc())
            return self.records
        self.attn = attn
        try:
            transfuse.optimize(ours)
        except Exception as exc:  # noqa: BLE001
            self.record("optimize", "FAIL", reason=f"optimize: {_short(exc)}", traceback=traceback.format_exc(),
                        attn=attn)
            return self.records
        if self.kind in ("img", "vl", "asr"):  # two batch sizes (images and Whisper's frames have one size)
            checks = [(f"fwd_b{b}", lambda s=s, b=b: self.forward(ref, eager, ours, s, batch=b))
                      for s, b in zip(SEQS, (BATCH, 2))]
        else:
            checks = [(f"fwd{s}", lambda s=s: self.forward(ref, eager, ours, s)) for s in SEQS]
        if self.kind in GENERATIVE:
            checks += [("gen_b3", lambda: self.generate(eager, ours, SEQS[0], BATCH, ref)),
                       ("gen_b2", lambda: self.generate(eager, ours, SEQS[1], 2, ref))]
        for extra in EXTRA:
            if extra in ("nomask", "embeds") and self.kind in MEDIA:
                continue  # text checks: batch 1 unmasked ids, inputs_embeds for ids
            if extra in ("hidden", "attn", "nomask", "embeds"):
                checks.append((f"fwd_{extra}", lambda v=extra: self.forward(ref, eager, ours, SEQS[0], v)))
            elif self.kind in GENERATIVE:
                checks.append({
                    "beam": ("beam", lambda: self.beam(eager, ours, SEQS[0], ref)),
                    "sample": ("sample", lambda: self.sample(eager, ours, SEQS[0])),
                    "long": ("gen_long", lambda: self.generate(eager, ours, SEQS[0], 2, ref, LONG_TOKENS)),
                }[extra])
        for i, (check, fn) in enumerate(checks):
            t = time.perf_counter()
            try:
                result = fn()
            except EagerFailed as exc:
                result = dict(status="SKIP", reason=f"{check}: eager {self.dtype} fails too: {exc}")
                if self.device == "cuda" and not _cuda_usable():
                    # Eager's own failure (e.g. a cuDNN attention graph that faulted) lost the
                    # context: what follows would fail whoever runs it.
                    self.record(check, result.pop("status"), seconds=round(time.perf_counter() - t, 2), attn=attn,
                                **result)
                    for later, _ in checks[i + 1:]:
                        self.record(later, "NOTRUN", reason=f"eager's failure at {check} lost the CUDA context")
                    return self.records
            except Exception as exc:  # noqa: BLE001
                result = dict(status="FAIL", reason=f"{check}: {_short(exc)}", traceback=traceback.format_exc())
                if _cuda_fault(exc):
                    # The process's CUDA context is lost: every later call raises the same error.
                    # The faulting kernel is the last one launched before the call that raised,
                    # eager's or transfuse's; --blocking (CUDA_LAUNCH_BLOCKING=1) names it.
                    result["reason"] += (" (a CUDA fault is reported by the first call after the kernel that "
                                         "made it, eager's or transfuse's; rerun with --blocking to find it)")
                    self.record(check, result.pop("status"), seconds=round(time.perf_counter() - t, 2), attn=attn,
                                **result)
                    for later, _ in checks[i + 1:]:
                        self.record(later, "NOTRUN", reason=f"the CUDA context was lost at {check}")
                    return self.records
            self.record(check, result.pop("status"), seconds=round(time.perf_counter() - t, 2), attn=attn, **result)
        changed = [k for k, v in ours.state_dict().items() if k not in saved or not torch.equal(v, saved[k])]
        missing = [k for k in saved if k not in ours.state_dict()]
        self.record("params", "FAIL" if changed or missing else "PASS", changed=changed[:20], missing=missing[:20],
                    reason=f"parameters changed: {(changed + missing)[:4]}" if changed or missing else "")
        try:
            text = transfuse.report(ours)
            state = getattr(ours, "_transfuse_state", None)
            rewrites: dict = {}
            for backend in getattr(state, "backends", ()):
                for r in backend.records:
                    for k, v in r.rewrites.items():
                        rewrites[k] = rewrites.get(k, 0) + v
            fallbacks = [line.strip() for line in text.splitlines()
                         if "left to eager" in line or "default cache" in line or "as written" in line]
            self.record("report", "PASS", rewrites=rewrites, traces=sum(len(b.records) for b in getattr(state, "backends", ())),
                        fallbacks=fallbacks[:10], report=text[:4000])
        except Exception as exc:  # noqa: BLE001
            self.record("report", "FAIL", reason=f"report: {_short(exc)}", traceback=traceback.format_exc())
        del ref, eager, ours, saved
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()
        self.seconds = time.perf_counter() - t0
        return self.records


# ---------------------------------------------------------------------------------------------
# Worker: reads "family dtype" lines on stdin, writes protocol lines on stdout.
# ---------------------------------------------------------------------------------------------
def worker(args) -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout = sys.stderr  # anything the libraries print goes to the worker's log, not the protocol
    os.dup2(2, 1)
    import torch  # noqa: F401  (imported before the first unit so that its time is not the unit's)
    import transformers

    import transfuse  # noqa: F401

    transformers.logging.set_verbosity_error()
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    proto.write(PROTOCOL + json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        family, dtype = line.split()
        t0 = time.perf_counter()
        print(f"=== {family} {dtype}", file=sys.stderr, flush=True)
        try:
            Unit(family, dtype, args.device, lambda rec: proto.write(PROTOCOL + json.dumps(rec, default=str) + "\n")).run()
        except BaseException as exc:  # noqa: BLE001 - a unit never takes the worker down silently
            rec = dict(family=family, dtype=dtype, check="unit", status="FAIL", device=args.device,
                       reason=f"sweep error: {_short(exc)}", traceback=traceback.format_exc())
            proto.write(PROTOCOL + json.dumps(rec, default=str) + "\n")
        done = {"done": [family, dtype], "seconds": time.perf_counter() - t0}
        if args.device == "cuda" and not _cuda_usable():
            done["broken"] = True  # a device-side assert poisons this process's CUDA context: start afresh
        proto.write(PROTOCOL + json.dumps(done) + "\n")
        if done.get("broken"):
            return


def _cuda_usable() -> bool:
    import torch

    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
        return True
    except Exception:  # noqa: BLE001 - any CUDA error here means the context is gone
        return False


class Worker:
    def __init__(self, index: int, args, log_dir: Path):
        self.index = index
        self.log = open(log_dir / f"worker{index}.log", "ab")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--device", args.device,
               "--seqs", args.seqs, "--scale", str(args.scale), "--extra", ",".join(EXTRA)]
        if args.no_cudnn_sdpa:
            cmd.append("--no-cudnn-sdpa")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     start_new_session=True)
        self.buffer = b""
        self.unit: tuple[str, str] | None = None
        self.started = 0.0
        self.last_beat = 0.0
        self.ready = False

    def send(self, unit):
        self.unit, self.started = unit, time.monotonic()
        self.last_beat = self.started
        self.proc.stdin.write(f"{unit[0]} {unit[1]}\n".encode())
        self.proc.stdin.flush()

    def close(self):
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def kill(self):
        try:
            os.killpg(self.proc.pid, 9)  # its own session: the worker and whatever it started
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def run_parent(args, units, out_dir: Path, emit, started: float) -> list[tuple[str, str]]:
    """Hands units to --jobs workers; returns the units never started."""
    log_dir = out_dir / "workers"
    log_dir.mkdir(parents=True, exist_ok=True)
    pending = list(units)
    sel = selectors.DefaultSelector()
    workers: list[Worker] = []
    next_index = 0

    def spawn():
        nonlocal next_index
        w = Worker(next_index, args, log_dir)
        next_index += 1
        sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        workers.append(w)
        return w

    def retire(w, kill=False):
        sel.unregister(w.proc.stdout)
        workers.remove(w)
        if kill:
            w.kill()
        else:
            w.close()
            w.proc.wait()
            w.log.close()

    def feed(w):
        if pending and time.monotonic() - started < args.time_limit:
            w.send(pending.pop(0))
            log(f"start {w.unit[0]} {w.unit[1]} (worker {w.index})", started)
        else:
            w.unit = None
            retire(w)

    for _ in range(max(1, min(args.jobs, len(pending)))):
        spawn()
    while workers:
        events = sel.select(timeout=5.0)
        for key, _ in events:
            w = key.data
            chunk = os.read(w.proc.stdout.fileno(), 1 << 16)
            if not chunk:  # the worker died
                if not w.ready:
                    retire(w, kill=True)
                    tail = (log_dir / f"worker{w.index}.log").read_text(errors="replace")[-3000:]
                    raise SystemExit(f"family_sweep: a worker died before its first unit:\n{tail}")
                if w.unit is not None:
                    code = w.proc.poll()
                    emit(dict(family=w.unit[0], dtype=w.unit[1], check="unit", status="FAIL", device=args.device,
                              reason=f"worker died (exit {code}) during the unit; see workers/worker{w.index}.log"))
                    log(f"worker {w.index} died in {w.unit[0]} {w.unit[1]}", started)
                retire(w, kill=True)
                if pending and time.monotonic() - started < args.time_limit:
                    spawn()
                continue
            w.buffer += chunk
            while b"\n" in w.buffer:
                line, w.buffer = w.buffer.split(b"\n", 1)
                text = line.decode(errors="replace")
                if not text.startswith(PROTOCOL):
                    continue
                msg = json.loads(text[len(PROTOCOL):])
                if msg.get("ready"):
                    w.ready = True
                    feed(w)
                elif "done" in msg:
                    status = unit_status([r for r in RESULTS if (r["family"], r["dtype"]) == tuple(msg["done"])])
                    log(f"done  {msg['done'][0]} {msg['done'][1]} in {msg['seconds']:.1f} s: {status}", started)
                    if msg.get("broken"):  # its CUDA context is unusable: a fresh worker takes the next unit
                        log(f"worker {w.index} retired: CUDA context broken", started)
                        w.unit = None
                        retire(w, kill=True)
                        if pending and time.monotonic() - started < args.time_limit:
                            spawn()
                        break
                    feed(w)
                else:
                    emit(msg)
        now = time.monotonic()
        for w in list(workers):
            if w.unit is None:
                continue
            if now - w.started > args.unit_timeout:
                emit(dict(family=w.unit[0], dtype=w.unit[1], check="unit", status="FAIL", device=args.device,
                          reason=f"timeout: still running after {args.unit_timeout:.0f} s (killed)"))
                log(f"timeout {w.unit[0]} {w.unit[1]}: worker {w.index} killed", started)
                w.unit = None
                retire(w, kill=True)
                if pending and now - started < args.time_limit:
                    spawn()
            elif now - w.last_beat > args.heartbeat:
                w.last_beat = now
                log(f"still running {w.unit[0]} {w.unit[1]} ({now - w.started:.0f} s)", started)
    return pending


def run_inline(args, units, emit, started) -> list[tuple[str, str]]:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    pending = list(units)
    while pending and time.monotonic() - started < args.time_limit:
        family, dtype = pending.pop(0)
        log(f"start {family} {dtype}", started)
        t0 = time.perf_counter()
        try:
            Unit(family, dtype, args.device, emit).run()
        except Exception as exc:  # noqa: BLE001
            emit(dict(family=family, dtype=dtype, check="unit", status="FAIL", device=args.device,
                      reason=f"sweep error: {_short(exc)}", traceback=traceback.format_exc()))
        rows = [r for r in RESULTS if (r["family"], r["dtype"]) == (family, dtype)]
        log(f"done  {family} {dtype} in {time.perf_counter() - t0:.1f} s: {unit_status(rows)}", started)
    return pending


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------
RESULTS: list[dict] = []


def log(text: str, started: float) -> None:
    print(f"[{time.monotonic() - started:6.0f}s] {text}", flush=True)


def unit_status(rows: list[dict]) -> str:
    states = {r["status"] for r in rows}
    if "FAIL" in states:
        return "FAIL"
    if "PASS" in states:
        return "PASS"
    return "SKIP" if states else "NOTRUN"


def table(units, not_run) -> str:
    lines = []
    head = ("family", "dtype", "attn", "fwd err ours/eager", "generate", "params", "rw", "traces", "status", "reason")
    rows = []
    for family, dtype in units:
        recs = [r for r in RESULTS if (r["family"], r["dtype"]) == (family, dtype)]
        if (family, dtype) in not_run or not recs:
            rows.append((family, dtype, "", "", "", "", "", "", "NOTRUN", "time limit" if (family, dtype) in not_run else ""))
            continue
        by = {r["check"]: r for r in recs}
        fwd = [r for r in recs if r["check"].startswith("fwd") and "err_ours" in r]
        err = (f"{max(r['err_ours'] for r in fwd):.1e}/{max(r['err_eager'] for r in fwd):.1e}" if fwd else "-")
        gens = [r for r in recs if r["check"].startswith("gen") and "rows" in r]
        gen = ("-" if not gens else
               f"{sum(r['equal'] for r in gens)}/{sum(r['rows'] for r in gens)}"
               + (f" ({sum(r['near_ties'] for r in gens)} tie)" if any(r["near_ties"] for r in gens) else "")
               + (f" ({sum(r.get('dtype_noise', 0) for r in gens)} fp32-ok)"
                  if any(r.get("dtype_noise") for r in gens) else ""))
        params = {"PASS": "kept", "FAIL": "CHANGED"}.get(by.get("params", {}).get("status"), "-")
        rw = by.get("report", {}).get("rewrites")
        rw = str(sum(rw.values())) if isinstance(rw, dict) else "-"
        traces = str(by.get("report", {}).get("traces", "-"))
        status = unit_status(recs)
        reason = next((r.get("reason", "") for r in recs if r["status"] == "FAIL"), "")
        if status == "SKIP":
            reason = next((r.get("reason", "") for r in recs if r["status"] == "SKIP"), "")
        elif status == "PASS":
            skipped = [r["check"] for r in recs if r["status"] == "SKIP"]
            fallbacks = by.get("report", {}).get("fallbacks") or []
            first_skip = next((r.get("reason", "") for r in recs if r["status"] == "SKIP"), "")
            reason = "; ".join(([f"skipped {','.join(skipped)}: {first_skip}"] if skipped else []) + fallbacks[:1])
        attn = next((r.get("attn") for r in recs if r.get("attn")), "") or ""
        rows.append((family, dtype, attn, err, gen, params, rw, traces, status, reason[:110]))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    widths[-1] = min(widths[-1], 110)
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines.append(fmt.format(*head))
    lines.append(fmt.format(*("-" * w for w in widths)))
    for r in rows:
        lines.append(fmt.format(*r))
    counts = {s: sum(1 for u in units if unit_status([r for r in RESULTS if (r["family"], r["dtype"]) == u]) == s)
              for s in ("PASS", "FAIL", "SKIP", "NOTRUN")}
    lines.append("units: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtypes", default="fp16,bf16,fp32")
    p.add_argument("--only", help="comma-separated families (a base name selects its variants too)")
    p.add_argument("--skip", help="comma-separated families to leave out")
    p.add_argument("--out", default="sweep-out")
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes (default 6 on cuda, 1 on cpu; 0 runs in this process, no timeout)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds after which no new unit starts (default 420 on cuda, none on cpu)")
    p.add_argument("--unit-timeout", type=float, default=None,
                   help="seconds one (family, dtype) may take before its worker is killed (default 180 cuda, 1200 cpu)")
    p.add_argument("--heartbeat", type=float, default=60.0, help="seconds between 'still running' lines")
    p.add_argument("--blocking", action="store_true",
                   help="CUDA_LAUNCH_BLOCKING=1 in the workers: a CUDA fault is raised by the kernel that made it")
    p.add_argument("--no-cudnn-sdpa", action="store_true",
                   help="turn off PyTorch's cuDNN attention (eager MiniMax's decode faults in it on torch 2.11)")
    p.add_argument("--precompile", action="store_true",
                   help="keep transfuse's parallel precompile of every bucket (off by default: TRANSFUSE_PRECOMPILE=0)")
    p.add_argument("--seqs", default="13,37", help="the two input lengths of the forward and generate checks")
    p.add_argument("--scale", type=int, default=1,
                   help="widths (hidden, FFN, head dims) times this; position tables grow with --seqs")
    p.add_argument("--extra", default="",
                   help="comma-separated checks beyond the default ones: " + ", ".join(EXTRA_CHECKS) + " (or all)")
    p.add_argument("--list", action="store_true", help="print the families and exit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    global SEQS, SCALE, EXTRA
    SEQS, SCALE = tuple(int(v) for v in args.seqs.split(",")), args.scale
    EXTRA = tuple(EXTRA_CHECKS) if args.extra == "all" else tuple(e.strip() for e in args.extra.split(",") if e.strip())
    unknown = [e for e in EXTRA if e not in EXTRA_CHECKS]
    if unknown:
        raise SystemExit(f"family_sweep: unknown --extra checks {unknown}; known: {', '.join(EXTRA_CHECKS)}")
    if len(SEQS) != 2:
        raise SystemExit("family_sweep: --seqs takes two lengths, e.g. 13,37")
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit is defined
    if not args.precompile:
        os.environ.setdefault("TRANSFUSE_PRECOMPILE", "0")
    if args.blocking:
        os.environ["CUDA_LAUNCH_BLOCKING"] = "1"  # before the workers (and CUDA) start
    if args.worker:
        worker(args)
        return 0
    if args.list:
        for name, kind, _, model_cls, _, attn in FAMILIES:
            print(f"{name:16} {kind:4} {model_cls}{'' if attn is None else ' attn=' + attn}")
        return 0
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise SystemExit(f"family_sweep: unknown dtypes {bad} (use {','.join(DTYPES)})")
    if args.jobs is None:
        args.jobs = 6 if args.device == "cuda" else 1
    if args.unit_timeout is None:
        args.unit_timeout = 180.0 if args.device == "cuda" else 1200.0
    if args.time_limit is None:
        args.time_limit = 420.0 if args.device == "cuda" else float("inf")
    units = [(f, d) for f in select(args.only, args.skip) for d in dtypes]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    sink = open(out_dir / "sweep.jsonl", "a", buffering=1)

    import torch
    import transformers
    import triton

    meta = dict(torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
                python=platform.python_version(), device=args.device,
                gpu=torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() else None,
                interpret=os.environ.get("TRITON_INTERPRET"), precompile=os.environ.get("TRANSFUSE_PRECOMPILE", "1"),
                argv=sys.argv[1:], time=time.strftime("%Y-%m-%d %H:%M:%S"))

    def emit(rec):
        rec = {**rec, **{k: meta[k] for k in ("torch", "triton", "transformers")}}
        RESULTS.append(rec)
        sink.write(json.dumps(rec, default=str) + "\n")

    started = time.monotonic()
    log(f"{len(units)} units on {args.device} ({meta['gpu'] or 'CPU'}), torch {meta['torch']}, triton "
        f"{meta['triton']}, transformers {meta['transformers']}, jobs {args.jobs}, out {out_dir}", started)
    try:
        if args.jobs == 0:
            not_run = run_inline(args, units, emit, started)
        else:
            not_run = run_parent(args, units, out_dir, emit, started)
    except KeyboardInterrupt:
        not_run = [u for u in units if not any((r["family"], r["dtype"]) == u for r in RESULTS)]
    sink.close()
    text = table(units, set(not_run))
    (out_dir / "table.txt").write_text(text + "\n")
    print(f"\nfamily sweep, {time.monotonic() - started:.0f} s ({meta['device']}"
          f"{', ' + meta['gpu'] if meta['gpu'] else ''}; torch {meta['torch']}, triton {meta['triton']}, "
          f"transformers {meta['transformers']})")
    print(text)
    return 1 if any(unit_status([r for r in RESULTS if (r["family"], r["dtype"]) == u]) == "FAIL" for u in units) else 0


if __name__ == "__main__":
    sys.exit(main())
