"""torch.ops.transfuse.clamp_if_inf: clamp(x, -b, b) with b chosen by whether x holds an inf;
torch.ops.transfuse.clamp_if_nonfinite: clamp(x, -b, b) if x holds an inf or a NaN, else x
(transfuse.kernels.clamp; semantics: transfuse.reference.clamp). Forward only."""

import torch

from transfuse.kernels import clamp as kernels


@torch.library.custom_op("transfuse::clamp_if_inf", mutates_args=())
def clamp_if_inf(x: torch.Tensor, bound_if_inf: float, bound_otherwise: float) -> torch.Tensor:
    """A new contiguous tensor of x's shape and dtype."""
    return kernels.clamp_if_inf_fwd(x, bound_if_inf, bound_otherwise)


@clamp_if_inf.register_fake
def _(x, bound_if_inf, bound_otherwise):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("transfuse::clamp_if_nonfinite", mutates_args=())
def clamp_if_nonfinite(x: torch.Tensor, bound: float) -> torch.Tensor:
    """A new contiguous tensor of x's shape and dtype."""
    return kernels.clamp_if_nonfinite_fwd(x, bound)


@clamp_if_nonfinite.register_fake
def _(x, bound):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
