"""torch.ops.transfuse.attention_train and the two ops it is made of (training: autograd registered).

    attention_train(Tensor q, Tensor k, Tensor v, Tensor? bias, float scale, bool is_causal) -> Tensor
    attention_train_fwd(Tensor q, Tensor k, Tensor v, Tensor? bias, float scale, bool is_causal)
        -> (Tensor out, Tensor lse, Tensor stats)
    attention_train_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? bias, Tensor out, Tensor stats,
                        Tensor? grad_lse, float scale, bool is_causal, bool bias_needs_grad)
        -> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)
    attention_train_bwd_packed(<attention_train_bwd's arguments>, int[] order, Tensor? grad_k_extra,
                               Tensor? grad_v_extra) -> (Tensor dqkv, Tensor dbias)

Shapes, the bias forms, the causal alignment (top-left, as F.scaled_dot_product_attention) and the
numerics of fully masked rows are documented in transfuse.kernels.attention_train. No dropout.

Why three ops: register_autograd's setup_context only sees an op's outputs, and the backward needs
the softmax's row statistics, so the op that carries the autograd formula, attention_train_fwd, returns
(out, lse, stats); stats (row maximum and log of the row sum, kept apart: see the kernel module) is not
differentiable. attention_train, the op callers use, is CompositeImplicitAutograd: it is
attention_train_fwd and drops lse and stats, so autograd, fake tensors and torch.compile all go
through attention_train_fwd (whose backward is the attention_train_bwd op: a graph node of its own
under torch.compile too); being composite, it has no fake implementation of its own (torch refuses
one). lse is differentiable as
well: its gradient folds into the backward's delta at no cost.

attention_train_bwd_packed is the same backward writing dq, dk and dv into one (batch, seqlen,
width) tensor, side by side in `order` (0 = dq, 1 = dk, 2 = dv), each as (seqlen, heads, head_dim)
rows: the gradient of a fused QKV projection (GPT-2's c_attn, nanoGPT's), which eager concatenates
from three tensors after the backward (passes/backward_packed_qkv.py puts it in the backward graph).
grad_k_extra / grad_v_extra: what else k and v receive (Hugging Face's returned KV cache's
gradients), added before the store.

attention_train_bwd returns an empty (0,) tensor in place of dbias unless bias_needs_grad (a schema
cannot return None). Double backward is not supported. Optional[...] rather than `X | None` in the
signatures: it is the spelling every torch version's schema inference reads.
"""

from typing import Optional

import torch

from transfuse.kernels import attention_train as kernels


@torch.library.custom_op("transfuse::attention_train_fwd", mutates_args=())
def attention_train_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: Optional[torch.Tensor],
    scale: float,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, stats): out (batch, nheads, seqlen_q, headdim), lse (batch, nheads, seqlen_q) fp32,
    stats (batch, nheads, 2, seqlen_q) fp32: what the backward reads."""
    return kernels.attention_train_fwd(q, k, v, bias, scale, is_causal)


@attention_train_fwd.register_fake
def _attention_train_fwd_fake(q, k, v, bias, scale, is_causal):
    kernels.check_attention_train_args(q, k, v, bias, scale)
    return kernels.attention_train_empty_out(q)


@torch.library.custom_op("transfuse::attention_train_bwd", mutates_args=())
def attention_train_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: Optional[torch.Tensor],
    out: torch.Tensor,
    stats: torch.Tensor,
    grad_lse: Optional[torch.Tensor],
    scale: float,
    is_causal: bool,
    bias_needs_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dbias); dbias is an empty (0,) tensor unless bias_needs_grad and bias is given."""
    dq, dk, dv, dbias = kernels.attention_train_bwd(
        grad_out, q, k, v, bias, out, stats, scale, is_causal, bias_needs_grad, dlse=grad_lse)
    return dq, dk, dv, dbias if dbias is not None else q.new_empty((0,))


@attention_train_bwd.register_fake
def _attention_train_bwd_fake(grad_out, q, k, v, bias, out, stats, grad_lse, scale, is_causal, bias_needs_grad):
    kernels.check_attention_train_args(q, k, v, bias, scale)
    dq, dk, dv, dbias = kernels.attention_train_empty_grads(q, k, v, bias, bias_needs_grad)
    return dq, dk, dv, dbias if dbias is not None else q.new_empty((0,))


@torch.library.custom_op("transfuse::attention_train_bwd_packed", mutates_args=())
def attention_train_bwd_packed(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: Optional[torch.Tensor],
    out: torch.Tensor,
    stats: torch.Tensor,
    grad_lse: Optional[torch.Tensor],
    scale: float,
    is_causal: bool,
    bias_needs_grad: bool,
    order: list[int],
    grad_k_extra: Optional[torch.Tensor] = None,
    grad_v_extra: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dqkv, dbias): attention_train_bwd's dq, dk + grad_k_extra, dv + grad_v_extra in one (batch,
    seqlen, width) tensor, in `order`; dbias as attention_train_bwd's."""
    packed, parts = _packed_grads(q, k, v, order)
    _, _, _, dbias = kernels.attention_train_bwd(
        grad_out, q, k, v, bias, out, stats, scale, is_causal, bias_needs_grad, dlse=grad_lse, grads=parts,
        dk_add=grad_k_extra, dv_add=grad_v_extra)
    return packed, dbias if dbias is not None else q.new_empty((0,))


@attention_train_bwd_packed.register_fake
def _attention_train_bwd_packed_fake(grad_out, q, k, v, bias, out, stats, grad_lse, scale, is_causal,
                                     bias_needs_grad, order, grad_k_extra=None, grad_v_extra=None):
    kernels.check_attention_train_args(q, k, v, bias, scale)
    packed, _ = _packed_grads(q, k, v, order)
    dbias = kernels.attention_train_empty_grads(q, k, v, bias, bias_needs_grad, with_qkv=False)[3]
    return packed, dbias if dbias is not None else q.new_empty((0,))


def _packed_grads(q, k, v, order):
    """(packed, (dq, dk, dv)): a new (batch, seqlen, width) tensor and the three (batch, heads, seqlen,
    head_dim) views of it the backward writes, laid side by side in `order`."""
    if sorted(order) != [0, 1, 2]:
        raise ValueError(f"attention_train_bwd_packed: order must be a permutation of [0, 1, 2], got {order}")
    like = (q, k, v)
    batch, seqlen = q.shape[0], q.shape[2]
    for name, t in zip("qkv", like):
        torch._check(t.shape[2] == seqlen, lambda: f"attention_train_bwd_packed: q, k and v must have one "
                                                   f"sequence length (self-attention), {name} differs")
    widths = [like[i].shape[1] * like[i].shape[3] for i in order]
    packed = q.new_empty((batch, seqlen, sum(widths)))
    parts: list = [None, None, None]
    start = 0
    for i, width in zip(order, widths):
        heads, head_dim = like[i].shape[1], like[i].shape[3]
        parts[i] = packed[:, :, start:start + width].view(batch, seqlen, heads, head_dim).transpose(1, 2)
        start += width
    return packed, tuple(parts)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, scale, is_causal = inputs
    out, _, stats = output
    ctx.mark_non_differentiable(stats)
    ctx.save_for_backward(q, k, v, bias, out, stats)
    ctx.scale = scale
    ctx.is_causal = is_causal
    # An unused lse (the usual case) then arrives as None rather than a tensor of zeros to read.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_lse, _grad_stats):
    q, k, v, bias, out, stats = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if grad_out is None:  # only lse was used
        grad_out = torch.zeros_like(out)
    bias_needs_grad = bias is not None and needs[3]
    dq, dk, dv, dbias = torch.ops.transfuse.attention_train_bwd(
        grad_out, q, k, v, bias, out, stats, grad_lse, ctx.scale, ctx.is_causal, bias_needs_grad)
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
            dbias if bias_needs_grad else None, None, None)


attention_train_fwd.register_autograd(_backward, setup_context=_setup_context)


torch.library.define(
    "transfuse::attention_train",
    "(Tensor q, Tensor k, Tensor v, Tensor? bias, float scale, bool is_causal) -> Tensor",
    tags=(torch.Tag.pt2_compliant_tag,),
)


@torch.library.impl("transfuse::attention_train", "CompositeImplicitAutograd")
def _attention_train_composite(q, k, v, bias, scale, is_causal):
    return torch.ops.transfuse.attention_train_fwd(q, k, v, bias, scale, is_causal)[0]


def attention_train(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: Optional[torch.Tensor],
    scale: float,
    is_causal: bool,
) -> torch.Tensor:
    """softmax(scale * q @ k^T + bias (+ causal)) @ v, differentiable in q, k, v and bias:
    torch.ops.transfuse.attention_train."""
    return torch.ops.transfuse.attention_train(q, k, v, bias, scale, is_causal)
