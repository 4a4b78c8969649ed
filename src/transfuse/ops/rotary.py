"""torch.ops.transfuse.rotary: x * cos + rotate_half(x) * sin in one kernel (transfuse.kernels.rotary;
semantics: transfuse.reference.rotary). Forward only."""

import torch

from transfuse.kernels import rotary as kernels


@torch.library.custom_op("transfuse::rotary", mutates_args=())
def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, S, D); cos, sin broadcastable to x, x's dtype. A new contiguous tensor of x's shape."""
    return kernels.rotary_fwd(x, cos, sin)


@rotary.register_fake
def _(x, cos, sin):
    kernels.check_rotary_args(x, cos, sin)
    return torch.empty_like(x, memory_format=torch.contiguous_format)
