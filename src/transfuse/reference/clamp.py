"""Plain-PyTorch fp16 overflow guard, as Hugging Face's T5 layers write it."""

import torch


def clamp_if_inf_ref(x: torch.Tensor, bound_if_inf: float, bound_otherwise: float) -> torch.Tensor:
    bound = torch.where(torch.isinf(x).any(), bound_if_inf, bound_otherwise)
    return torch.clamp(x, min=-bound, max=bound)
