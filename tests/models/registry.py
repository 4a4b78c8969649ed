"""Tiny Hugging Face model configs for CPU tests, with the real sizes in comments, and the golden
number of matches each pass must find. An upstream modeling change that breaks a pattern changes a
count and fails CI."""

from __future__ import annotations

import dataclasses

import transformers


@dataclasses.dataclass(frozen=True)
class TinyModel:
    name: str
    config_cls: str
    model_cls: str
    config: dict
    # attention implementation -> pass pattern -> expected matches (two layers; per layer: merged
    # QKV, four GEMMs, two residual norms; plus embedding norm, pooler, embedding projection). The
    # embedding norm counts twice: as the (Residual)LayerNorm the norm pass made, then as the
    # EmbeddingLayerNorm that took it and its lookups over.
    golden: dict
    # Dynamic dimensions the bucketed runtime may not pad (RoBERTa counts positions along the
    # sequence, so padded positions would run past its position table).
    unpaddable: int = 0

    def build(self, attn_implementation: str):
        cfg = getattr(transformers, self.config_cls)(**self.config)
        cfg._attn_implementation = attn_implementation
        return getattr(transformers, self.model_cls)(cfg).eval()


LAYERS = 2
_BERT_LIKE = dict(
    hidden_size=32,  # 768
    num_hidden_layers=LAYERS,  # 12
    num_attention_heads=2,  # 12 (head dim 16; 64 real)
    intermediate_size=48,  # 3072
    vocab_size=97,  # 30522
    max_position_embeddings=64,  # 512
)


REGISTRY = [
    TinyModel("bert", "BertConfig", "BertModel", _BERT_LIKE, {
            "eager": {"EmbeddingLayerNorm": 1, "SiblingLinears": 2, "LinearEpilogue": 9, "ResidualLayerNorm": 4, "LayerNorm": 1, "ManualAttention": 2, "EvalDropout": 7, "LayerNormLinear": 3},
            "sdpa": {"EmbeddingLayerNorm": 1, "SiblingLinears": 2, "LinearEpilogue": 9, "ResidualLayerNorm": 4, "LayerNorm": 1, "TorchSDPA": 2, "KeyPadding": 2, "EvalDropout": 5, "LayerNormLinear": 3},
        }),
    TinyModel("roberta", "RobertaConfig", "RobertaModel", dict(_BERT_LIKE, pad_token_id=1), {
            "eager": {"EmbeddingLayerNorm": 1, "SiblingLinears": 2, "LinearEpilogue": 9, "ResidualLayerNorm": 5, "ManualAttention": 2, "EvalDropout": 7, "LayerNormLinear": 3},
            "sdpa": {"EmbeddingLayerNorm": 1, "SiblingLinears": 2, "LinearEpilogue": 9, "ResidualLayerNorm": 5, "TorchSDPA": 2, "KeyPadding": 2, "EvalDropout": 5, "LayerNormLinear": 3},
        }, unpaddable=1),
    TinyModel("electra", "ElectraConfig", "ElectraModel", dict(_BERT_LIKE, embedding_size=32), {
            "eager": {"EmbeddingLayerNorm": 1, "SiblingLinears": 2, "LinearEpilogue": 8, "ResidualLayerNorm": 4, "LayerNorm": 1, "ManualAttention": 2, "EvalDropout": 7, "LayerNormLinear": 3},
            "sdpa": {"EmbeddingLayerNorm": 1, "SiblingLinears": 2, "LinearEpilogue": 8, "ResidualLayerNorm": 4, "LayerNorm": 1, "TorchSDPA": 2, "KeyPadding": 2, "EvalDropout": 5, "LayerNormLinear": 3},
        }),
    TinyModel(
        "minilm",  # MiniLM-L12-H384: BERT with head dim 32
        "BertConfig",
        "BertModel",
        dict(_BERT_LIKE, hidden_size=64, num_attention_heads=2, intermediate_size=96),  # 384 / 12 heads
        {
            "eager": {"EmbeddingLayerNorm": 1, "SiblingLinears": 2, "LinearEpilogue": 9, "ResidualLayerNorm": 4, "LayerNorm": 1, "ManualAttention": 2, "EvalDropout": 7, "LayerNormLinear": 3},
            "sdpa": {"EmbeddingLayerNorm": 1, "SiblingLinears": 2, "LinearEpilogue": 9, "ResidualLayerNorm": 4, "LayerNorm": 1, "TorchSDPA": 2, "KeyPadding": 2, "EvalDropout": 5, "LayerNormLinear": 3},
        },
    ),
    TinyModel(
        "distilbert",
        "DistilBertConfig",
        "DistilBertModel",
        dict(dim=32, n_layers=LAYERS, n_heads=2, hidden_dim=48, vocab_size=97, max_position_embeddings=64),  # 768/6/12/3072
        {
            "eager": {"EmbeddingLayerNorm": 1, "SiblingLinears": 2, "LinearEpilogue": 8, "ResidualLayerNorm": 4, "LayerNorm": 1, "ManualAttention": 2, "EvalDropout": 5, "LayerNormLinear": 3},
            "sdpa": {"EmbeddingLayerNorm": 1, "SiblingLinears": 2, "LinearEpilogue": 8, "ResidualLayerNorm": 4, "LayerNorm": 1, "TorchSDPA": 2, "KeyPadding": 2, "EvalDropout": 3, "LayerNormLinear": 3},
        },
    ),
    TinyModel(
        "albert",
        "AlbertConfig",
        "AlbertModel",
        dict(_BERT_LIKE, embedding_size=16),  # 128
        {
            "eager": {"EmbeddingLayerNorm": 1, "SiblingLinears": 2, "LinearEpilogue": 10, "ResidualLayerNorm": 4, "LayerNorm": 1, "ManualAttention": 2, "EvalDropout": 5, "LayerNormLinear": 3},
            "sdpa": {"EmbeddingLayerNorm": 1, "SiblingLinears": 2, "LinearEpilogue": 10, "ResidualLayerNorm": 4, "LayerNorm": 1, "TorchSDPA": 2, "KeyPadding": 2, "EvalDropout": 3, "LayerNormLinear": 3},
        },
    ),
]
