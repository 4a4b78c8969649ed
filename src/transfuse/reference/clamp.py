"""Plain-PyTorch fp16 overflow guards, as Hugging Face's T5 and BART layers write them."""

import torch


def clamp_if_inf_ref(x: torch.Tensor, bound_if_inf: float, bound_otherwise: float) -> torch.Tensor:
    bound = torch.where(torch.isinf(x).any(), bound_if_inf, bound_otherwise)
    return torch.clamp(x, min=-bound, max=bound)


def clamp_if_nonfinite_ref(x: torch.Tensor, bound: float) -> torch.Tensor:
    """BART's `if not torch.isfinite(x).all(): x = torch.clamp(x, -bound, bound)`, as a select."""
    return torch.where(torch.isfinite(x).all(), x, torch.clamp(x, min=-bound, max=bound))
