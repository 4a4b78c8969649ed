"""Plain-PyTorch training attention: the oracle for transfuse.kernels.attention_train.

Shapes and semantics as in the kernel module: q (batch, nheads, seqlen_q, headdim), k/v
(batch, nheads_kv, seqlen_k, headdim), bias additive and broadcastable to (batch, nheads, seqlen_q,
seqlen_k), causal top-left aligned (query i sees keys j <= i). Differentiable: autograd through it
gives the reference gradients, dbias included.
"""

from typing import Optional

import torch


def attention_train_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: Optional[torch.Tensor],
    scale: float,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): softmax(s) @ v in q.dtype and logsumexp(s) in fp32, s = scale * q @ k^T + bias,
    all computed in fp32; GQA/MQA by repeating k/v heads.

    A row whose every score is -inf gives out = 0, lse = -inf and zero gradients (the kernels'
    semantics, SDPA's "safe softmax"): its scores are replaced by 0 before the softmax and the
    logsumexp, so that neither the values nor the gradients see -inf - (-inf).
    """
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = (q.float() @ kf.transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.float()
    if is_causal:
        above = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    dead = (scores == float("-inf")).all(dim=-1, keepdim=True)
    safe = scores.masked_fill(dead, 0.0)
    probs = torch.softmax(safe, dim=-1).masked_fill(dead, 0.0)
    lse = torch.logsumexp(safe, dim=-1).masked_fill(dead.squeeze(-1), float("-inf"))
    return (probs @ vf).to(q.dtype), lse
