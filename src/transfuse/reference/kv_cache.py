"""Plain-PyTorch static KV-cache write, as Hugging Face's StaticLayer.update does it."""

import torch

from transfuse.reference.rotary import rotary_ref


def kv_cache_write_ref(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       start: torch.Tensor) -> None:
    position = torch.arange(k.shape[-2], device=keys.device) + start
    keys.index_copy_(2, position, k)
    values.index_copy_(2, position, v)


def rotary_kv_cache_write_ref(keys: torch.Tensor, values: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """rotary_ref on q and k, k_rot and v written as above; positions at or past the cache's length
    are dropped, as the kernel drops them (index_copy_ would fail on them)."""
    fits = torch.arange(k.shape[-2], device=k.device) + start < keys.shape[2]  # a prefix: positions grow
    kv_cache_write_ref(keys, values, rotary_ref(k, cos, sin)[:, :, fits], v[:, :, fits], start)
    return rotary_ref(q, cos, sin)
