"""Plain-PyTorch normalisation over the last dim: the eager formulas the kernels in
transfuse.kernels.norm reproduce, and the semantics the graph passes promise.

Each function is written the way the model code it stands for computes, operation by operation,
so rounding happens where eager rounds:

    LayerNorm   torch.nn.functional.layer_norm: statistics and affine in fp32, one rounding at the end
    Llama/Mistral/Qwen2 (and T5 when its weight has x's dtype):
                h = x.float();  h = h * rsqrt(mean(h^2) + eps);  weight * h.to(x.dtype)
    Gemma, F.rms_norm:
                h = x.float();  h = h * rsqrt(mean(h^2) + eps);  (h * (offset + weight.float())).to(x.dtype)

x: (..., N); weight, bias: (N,). The add_ variants normalise s = x + residual, summed in x's dtype.
"""

import torch


def layer_norm_ref(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    h = x.float()
    mean = h.mean(-1, keepdim=True)
    var = (h - mean).pow(2).mean(-1, keepdim=True)  # biased, as F.layer_norm
    y = (h - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    # out_dtype: `F.layer_norm(x).to(out_dtype)`; from fp32 x that is still one rounding
    return y.to(x.dtype).to(out_dtype or x.dtype)


def add_layer_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    store_sum: bool,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual  # a narrower residual is promoted to x's dtype, as eager's add does
    out = layer_norm_ref(s, weight, bias, eps, out_dtype)
    return out, (s if store_sum else x.new_empty((0,)))


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    if out_dtype is not None:  # `rms_norm(x).to(out_dtype)`
        return rms_norm_ref(x, weight, eps, weight_offset, cast_before_weight).to(out_dtype)
    input_dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return h.to(input_dtype)
    if cast_before_weight:
        # Llama: `weight * h.to(input_dtype)`, the product in weight's dtype (== x's). Written with
        # an fp32 product and one rounding, which is the same number (a product of two fp16/bf16
        # values is exact in fp32) and also defines a non-zero weight_offset.
        scale = weight.float() + weight_offset if weight_offset != 0.0 else weight.float()
        return (h.to(input_dtype).float() * scale).to(input_dtype)
    # Gemma: `(h * (1.0 + weight.float())).type_as(x)`; F.rms_norm the same with no offset.
    return (h * (weight_offset + weight.float())).to(input_dtype)


def add_rms_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    store_sum: bool,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual  # a narrower residual is promoted to x's dtype, as eager's add does
    out = rms_norm_ref(s, weight, eps, weight_offset, cast_before_weight, out_dtype)
    return out, (s if store_sum else x.new_empty((0,)))
