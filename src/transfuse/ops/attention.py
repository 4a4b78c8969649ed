"""torch.ops.transfuse.attention and torch.ops.transfuse.attention_mask_summary (forward only: training
graphs use torch.ops.transfuse.attention_train, ops/attention_train.py).

    attention(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? mask_summary, float scale,
              bool is_causal, bool masked_rows_zero, Tensor? key_len=None, Tensor? sinks=None) -> Tensor
    attention_mask_summary(Tensor mask, int seqlen_q, int seqlen_k) -> Tensor

Shapes, mask forms and the numerics of fully masked rows are documented in
transfuse.kernels.attention. The output of `attention` is (batch, nheads, seqlen_q, headdim_v) with the
memory of a contiguous (batch, seqlen_q, nheads, headdim_v); the fake implementation returns the same
strides. The summary is computed once per forward and shared by every layer that uses the same mask.
`key_len` (one int32 on the device) ends the keys early: the runtime pads batches to a bucket and
the padded keys must not be attended to, whatever the mask says. `sinks` (one float per query head)
adds a logit with no value to every row's softmax (GPT-OSS).
"""

import torch

from transfuse.kernels.attention import (
    attention_empty_out,
    attention_fwd,
    attention_mask_summary_fwd,
    attention_summary_shape,
)


@torch.library.custom_op("transfuse::attention", mutates_args=())
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    mask_summary: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    masked_rows_zero: bool,
    key_len: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return attention_fwd(q, k, v, mask, mask_summary, scale, is_causal, masked_rows_zero, key_len, sinks)


@attention.register_fake
def _attention_fake(q, k, v, mask, mask_summary, scale, is_causal, masked_rows_zero, key_len=None, sinks=None):
    return attention_empty_out(q, v)


@torch.library.custom_op("transfuse::attention_mask_summary", mutates_args=())
def attention_mask_summary(mask: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    return attention_mask_summary_fwd(mask, seqlen_q, seqlen_k)


@attention_mask_summary.register_fake
def _attention_mask_summary_fake(mask, seqlen_q, seqlen_k):
    return mask.new_empty(attention_summary_shape(mask.shape, seqlen_q, seqlen_k), dtype=torch.int8)


def mask_summary_for(summary: torch.Tensor, summary_seqlen_k: int, mask: torch.Tensor, seqlen_q: int,
                     seqlen_k: int) -> torch.Tensor:
    """Another layer's summary of the same mask when its key length is this layer's, else a new one.

    Dynamo gives each layer's KV cache a size symbol of its own, equal at run time for a static
    cache (one summary per forward, not one per layer) but not always (a sliding-window layer's
    cache is shorter): a plain comparison of host ints in the rewritten graph, never a guess.
    A plain function, not an op: it only picks a tensor."""
    if summary_seqlen_k == seqlen_k:
        return summary
    return torch.ops.transfuse.attention_mask_summary(mask, seqlen_q, seqlen_k)
