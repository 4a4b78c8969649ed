"""torch.ops.transfuse.rotary: x * cos + rotate_half(x) * sin in one kernel (transfuse.kernels.rotary;
semantics: transfuse.reference.rotary); torch.ops.transfuse.rotary_pair: the same for an attention's Q
and K in one launch. Forward only."""

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


@torch.library.custom_op("transfuse::rotary_pair", mutates_args=())
def rotary_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotary(q, cos, sin), rotary(k, cos, sin)); q and k may have different head counts (GQA)."""
    return kernels.rotary_pair_fwd(q, k, cos, sin)


@rotary_pair.register_fake
def _(q, k, cos, sin):
    kernels.check_rotary_pair_args(q, k, cos, sin)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format))
