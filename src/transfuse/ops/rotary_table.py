"""torch.ops.transfuse.rotary_table: Hugging Face's rotary cos/sin tables (inv_freq @ positions,
concatenated with itself, cos, sin, scaled, cast) in one kernel (transfuse.kernels.rotary_table;
semantics: transfuse.reference.rotary_table). Inference only: the tables come from a buffer and
integer positions, which have no gradient."""

import torch

from transfuse.kernels import rotary_table as kernels


@torch.library.custom_op("transfuse::rotary_table", mutates_args=())
def rotary_table(inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """inv_freq: (D/2,); positions: (B, S). (cos, sin), each a new contiguous (B, S, D) tensor in dtype."""
    return kernels.rotary_table_fwd(inv_freq, positions, scaling, dtype)


@rotary_table.register_fake
def _(inv_freq, positions, scaling, dtype):
    kernels.check_rotary_table_args(inv_freq, positions, dtype)
    shape = (positions.shape[0], positions.shape[1], 2 * inv_freq.shape[0])
    return (positions.new_empty(shape, dtype=dtype), positions.new_empty(shape, dtype=dtype))
