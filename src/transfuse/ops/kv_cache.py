"""torch.ops.transfuse.kv_cache_write: a static KV cache's new keys and values written in place at
the position a device tensor holds, in one launch (transfuse.kernels.kv_cache; semantics:
transfuse.reference.kv_cache). Forward only."""

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
