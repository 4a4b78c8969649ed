"""torch.ops.transfuse.{layer_norm, add_layer_norm, rms_norm, add_rms_norm}: normalisation over
the last dim, optionally fused with the residual add before it. Kernels: transfuse.kernels.norm;
semantics, operation by operation: transfuse.reference.norm.

Every output is a new contiguous tensor of x's shape and dtype. The add_ ops return (out, s) with
s = x + residual in x's dtype; with store_sum=False s is never written and an empty (0,) tensor
stands in for it, so a graph whose sum has no other user (BERT's post-norm) saves its traffic.

The ops take eps as given: where a model passes eps=None to F.rms_norm, the caller resolves it to
torch.finfo(torch.float32).eps, what torch uses for fp16, bf16 and fp32 inputs alike.
Forward only for now (no autograd formula is registered). Optional[...] rather than `X | None` in
the signatures: it is the spelling every torch version's schema inference reads.
"""

from typing import Optional

import torch

from transfuse.kernels import norm as kernels


@torch.library.custom_op("transfuse::layer_norm", mutates_args=())
def layer_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    """F.layer_norm(x, (N,), weight, bias, eps) for x: (..., N); weight, bias: (N,) in x's dtype or fp32."""
    return kernels.layer_norm_fwd(x, weight, bias, eps)


@layer_norm.register_fake
def _(x, weight, bias, eps):
    out_dtype = kernels.check_layer_norm_args(x, weight, bias)
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("transfuse::add_layer_norm", mutates_args=())
def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    store_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual), x + residual); the second is an empty (0,) tensor unless store_sum."""
    return kernels.add_layer_norm_fwd(x, residual, weight, bias, eps, store_sum)


@add_layer_norm.register_fake
def _(x, residual, weight, bias, eps, store_sum):
    out_dtype = kernels.check_layer_norm_args(x, weight, bias, residual)
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape if store_sum else (0,))


@torch.library.custom_op("transfuse::rms_norm", mutates_args=())
def rms_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
) -> torch.Tensor:
    """RMSNorm over the last dim. cast_before_weight=True, weight_offset=0: Llama/Mistral/Qwen2 (and
    T5 with a weight of x's dtype); cast_before_weight=False: F.rms_norm (offset 0) and Gemma
    (offset 1.0). Output dtype is x's; see kernels.norm.check_rms_norm_args for the weight dtypes."""
    return kernels.rms_norm_fwd(x, weight, eps, weight_offset, cast_before_weight)


@rms_norm.register_fake
def _(x, weight, eps, weight_offset, cast_before_weight):
    out_dtype = kernels.check_rms_norm_args(x, weight, weight_offset, cast_before_weight)
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("transfuse::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    store_sum: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the second is an empty (0,) tensor unless store_sum."""
    return kernels.add_rms_norm_fwd(x, residual, weight, eps, weight_offset, cast_before_weight, store_sum)


@add_rms_norm.register_fake
def _(x, residual, weight, eps, weight_offset, cast_before_weight, store_sum):
    out_dtype = kernels.check_rms_norm_args(x, weight, weight_offset, cast_before_weight, residual)
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape if store_sum else (0,))
