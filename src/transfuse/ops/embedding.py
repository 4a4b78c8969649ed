"""torch.ops.transfuse.embedding_layer_norm: embedding lookups summed into a LayerNorm (the input
layer of BERT-family encoders). Kernel: transfuse.kernels.embedding; semantics:
transfuse.reference.embedding.embedding_layer_norm_ref.

The output is a new contiguous (*broadcast of the index shapes, N) tensor of the tables' dtype. An
out-of-range index gives a NaN output row (eager raises or device-asserts; see the kernel file).
Forward only: there is no autograd formula, and the pass that emits the op does not run on
training graphs.
"""

from typing import Optional

import torch

from transfuse.kernels import embedding as kernels


@torch.library.custom_op("transfuse::embedding_layer_norm", mutates_args=())
def embedding_layer_norm(
    indices: list[torch.Tensor],
    tables: list[torch.Tensor],
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
) -> torch.Tensor:
    """layer_norm(F.embedding(indices[0], tables[0]) + F.embedding(indices[1], tables[1]) + ...,
    weight, bias, eps), summed left to right in the tables' dtype; 1 to 4 lookups."""
    return kernels.embedding_layer_norm_fwd(indices, tables, weight, bias, eps)


@embedding_layer_norm.register_fake
def _(indices, tables, weight, bias, eps):
    out_dtype, shape = kernels.check_embedding_layer_norm_args(indices, tables, weight, bias)
    return tables[0].new_empty((*shape, tables[0].shape[1]), dtype=out_dtype)
