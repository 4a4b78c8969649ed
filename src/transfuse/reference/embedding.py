"""Plain-PyTorch embedding lookups summed into a LayerNorm, as BERT-family embeddings compute it
(transformers/models/bert/modeling_bert.py, BertEmbeddings): the oracle for
transfuse.kernels.embedding and the semantics of transfuse.embedding_layer_norm."""

import torch
import torch.nn.functional as F

from transfuse.reference.norm import layer_norm_ref


def embedding_layer_norm_ref(
    indices: list[torch.Tensor],
    tables: list[torch.Tensor],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    # Left to right in the tables' dtype, each add rounded, as `words + token_types + positions`.
    total = F.embedding(indices[0], tables[0])
    for idx, table in zip(indices[1:], tables[1:]):
        total = total + F.embedding(idx, table)
    return layer_norm_ref(total, weight, bias, eps)
