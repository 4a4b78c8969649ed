"""What the attention kernel tests (inference and training) share."""

import torch

FP32_MIN = torch.finfo(torch.float32).min


def qkv(batch, nheads, nheads_kv, seqlen_q, seqlen_k, head_dim, dtype, device):
    """Random q (batch, nheads, seqlen_q, head_dim) and k, v (batch, nheads_kv, seqlen_k, head_dim)."""
    q = torch.randn(batch, nheads, seqlen_q, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, nheads_kv, seqlen_k, head_dim, dtype=dtype, device=device)
    v = torch.randn(batch, nheads_kv, seqlen_k, head_dim, dtype=dtype, device=device)
    return q, k, v
