"""torch.ops.transfuse.kv_cache_write: a static KV cache's new keys and values written in place at
the position a device tensor holds, in one launch (transfuse.kernels.kv_cache; semantics:
transfuse.reference.kv_cache). torch.ops.transfuse.rotary_kv_cache_write: the same write with the
keys rotated on the way in, and the queries rotated alongside (rotary_pair + kv_cache_write in one
launch). Forward only."""

import torch

from transfuse.kernels import kv_cache as kernels


@torch.library.custom_op("transfuse::kv_cache_write", mutates_args=("keys", "values"))
def kv_cache_write(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   start: torch.Tensor) -> None:
    """keys/values (B, H, L, D) get k/v (B, H, n, D) at positions start .. start + n - 1."""
    kernels.kv_cache_write_fwd(keys, values, k, v, start)


@kv_cache_write.register_fake
def _(keys, values, k, v, start):
    kernels.check_kv_cache_write_args(keys, values, k, v, start)


@torch.library.custom_op("transfuse::rotary_kv_cache_write", mutates_args=("keys", "values"))
def rotary_kv_cache_write(keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """q: (B, Hq, n, D), k, v: (B, Hk, n, D), cos, sin broadcastable to (B, 1, n, D), keys/values
    (B, Hk, L, D). keys/values get rotary(k)/v at positions start .. start + n - 1 (those < L); returns
    rotary(q), a new contiguous tensor. Bit for bit rotary_pair(q, k, cos, sin) followed by
    kv_cache_write(keys, values, k_rot, v, start)."""
    return kernels.rotary_kv_cache_write_fwd(keys, values, q, k, v, cos, sin, start)


@rotary_kv_cache_write.register_fake
def _(keys, values, q, k, v, cos, sin, start):
    kernels.check_rotary_kv_cache_write_args(keys, values, q, k, v, cos, sin, start)
    return torch.empty_like(q, memory_format=torch.contiguous_format)
