"""Plain-PyTorch linear + cross-entropy: what torch.ops.transfuse.linear_cross_entropy computes.

A language model's head and loss as eager training code writes them under torch.autocast:
F.linear runs in the compute dtype (x's; autocast casts weight and bias to it), cross_entropy
upcasts the logits to fp32 (it is on autocast's fp32 list), so

    logits = F.linear(x, weight.to(x.dtype), bias.to(x.dtype)).float()
    loss   = F.cross_entropy(logits, target, ignore_index=, label_smoothing=, reduction=)

x: (rows, H), weight: (V, H), bias: (V,) or None, target: (rows,) int64. Vocabulary padding changes
nothing here (it is a performance option of the kernels), so this reference takes none.
"""

import torch
import torch.nn.functional as F


def linear_cross_entropy_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    # .to() is differentiable: an fp32 parameter gets its gradient back in fp32, as under autocast
    weight = weight.to(x.dtype)
    bias = None if bias is None else bias.to(x.dtype)
    logits = F.linear(x, weight, bias).float()
    return F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction=reduction)
