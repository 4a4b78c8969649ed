"""Plain-PyTorch attention and mask summary: the oracles for transfuse.kernels.attention.

Shapes and semantics as in the kernel module: q (batch, nheads, seqlen_q, headdim), k/v
(batch, nheads_kv, seqlen_k, headdim), mask bool (True = attend) or additive, broadcastable to
(batch, nheads, seqlen_q, seqlen_k).
"""

import torch

from transfuse.kernels.attention import (
    SUMMARY_BLOCK_M,
    SUMMARY_BLOCK_N,
    SUMMARY_FLAG_DENSE_ROW,
    SUMMARY_FLAG_DENSE_ROW_CAUSAL,
)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    masked_rows_zero: bool,
    key_len: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(scale * q @ k^T + mask) @ v computed in fp32, returned in q.dtype, contiguous.

    bool mask -> -inf where False (as F.scaled_dot_product_attention does); additive mask -> added in
    fp32; causal is top-left aligned (query i sees keys j <= i). `masked_rows_zero` gives 0 for rows
    whose every score is -inf (SDPA's behaviour); otherwise such rows are NaN (plain softmax).
    `key_len`: only the first key_len keys exist (the rest is padding).
    `sinks` (nheads,): one more logit per head, in the softmax but with no value (GPT-OSS's form:
    concatenated to the scores, softmax, the last column dropped).
    """
    if key_len is not None:
        k, v = k[:, :, :key_len], v[:, :, :key_len]
        if mask is not None and mask.shape[-1] != 1:
            mask = mask[..., :key_len]
    batch, nheads, seqlen_q, _ = q.shape
    nheads_kv = k.shape[1]
    group = nheads // nheads_kv
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = (q.float() @ kf.transpose(-1, -2)) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        elif mask.dtype == torch.float64:  # the kernels read fp32: finfo(float64).min becomes the fp32 min
            scores = scores + mask.clamp(min=torch.finfo(torch.float32).min).float()
        else:
            scores = scores + mask.float()
    if is_causal:
        above = torch.ones(seqlen_q, k.shape[2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, -1, 1, 1).expand(batch, nheads, seqlen_q, 1)
        return (torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ vf).to(q.dtype)
    probs = torch.softmax(scores, dim=-1)
    if masked_rows_zero:
        all_masked = (scores == float("-inf")).all(dim=-1, keepdim=True)
        probs = probs.masked_fill(all_masked, 0.0)
    return (probs @ vf).to(q.dtype)


def attention_mask_summary_ref(mask: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """The int8 block summary of `mask`, (batch_m, nheads_m, n_q_blocks, n_k_blocks + 1); see the kernel module."""
    m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    batch_m, nheads_m = m4.shape[:2]
    m4 = m4.expand(batch_m, nheads_m, seqlen_q, seqlen_k)
    if mask.dtype == torch.bool:
        visible, masked, unmasked = m4, ~m4, m4
        finite_masked = torch.zeros_like(m4)
    else:
        m32 = m4.clamp(min=torch.finfo(torch.float32).min).float() if mask.dtype == torch.float64 else m4.float()
        lowest = torch.finfo(torch.float32 if mask.dtype == torch.float64 else mask.dtype).min
        visible, masked, unmasked = m32 > lowest, m32 <= lowest, m32 == 0
        finite_masked = masked & (m32 > float("-inf"))
    num_q = -(-seqlen_q // SUMMARY_BLOCK_M)
    num_k = -(-seqlen_k // SUMMARY_BLOCK_N)
    summary = torch.empty(batch_m, nheads_m, num_q, num_k + 1, dtype=torch.int8, device=mask.device)
    for qb in range(num_q):
        rows = slice(qb * SUMMARY_BLOCK_M, min(seqlen_q, (qb + 1) * SUMMARY_BLOCK_M))
        for kb in range(num_k):
            cols = slice(kb * SUMMARY_BLOCK_N, min(seqlen_k, (kb + 1) * SUMMARY_BLOCK_N))
            all_masked = masked[:, :, rows, cols].flatten(2).all(-1)
            all_unmasked = unmasked[:, :, rows, cols].flatten(2).all(-1)
            summary[:, :, qb, kb] = torch.where(all_masked, 0, torch.where(all_unmasked, 2, 1)).to(torch.int8)
        i = torch.arange(rows.start, rows.stop, device=mask.device)
        j = torch.arange(seqlen_k, device=mask.device)
        causal_ok = j[None, :] <= i[:, None]
        vis, fin = visible[:, :, rows], finite_masked[:, :, rows]
        dense = (~vis.any(-1) & fin.any(-1)).any(-1)
        dense_causal = (~(vis & causal_ok).any(-1) & (fin & causal_ok).any(-1)).any(-1)
        flags = dense.to(torch.int8) * SUMMARY_FLAG_DENSE_ROW + dense_causal.to(torch.int8) * SUMMARY_FLAG_DENSE_ROW_CAUSAL
        summary[:, :, qb, num_k] = flags
    return summary
