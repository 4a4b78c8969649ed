"""Plain-PyTorch rotary embedding (rotate-half form), the formula transfuse.kernels.rotary computes:
out = x * cos + rotate_half(x) * sin in fp32, rounded once to x's dtype."""

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.float()
    return (h * cos.float() + rotate_half(h) * sin.float()).to(x.dtype)
