"""Plain-PyTorch static KV-cache write, as Hugging Face's StaticLayer.update does it."""

import torch


def kv_cache_write_ref(keys: torch.Tensor, values: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       start: torch.Tensor) -> None:
    position = torch.arange(k.shape[-2], device=keys.device) + start
    keys.index_copy_(2, position, k)
    values.index_copy_(2, position, v)
