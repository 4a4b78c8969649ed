"""Hugging Face's rotary cos/sin tables in plain PyTorch, written as LlamaRotaryEmbedding.forward
computes them (transformers 5.x): the oracle for transfuse.kernels.rotary_table."""

import torch


def rotary_table_ref(inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float, dtype: torch.dtype):
    """inv_freq: (D/2,); positions: (B, S). Returns (cos, sin), each (B, S, D) in dtype."""
    inv_freq_expanded = inv_freq[None, :, None].float().expand(positions.shape[0], -1, 1)
    positions_expanded = positions[:, None, :].float()
    freqs = (inv_freq_expanded @ positions_expanded).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
