"""Autograd of the GEMM with epilogue: transfuse::linear's formula, and the training ops that keep
the pre-activation for it.

    linear_train(Tensor x, Tensor weight, Tensor? bias, str activation, Tensor? residual) -> Tensor
    linear_train_fwd(Tensor x, Tensor weight, Tensor? bias, str activation, Tensor? residual)
        -> (Tensor out, Tensor pre)
    activation_backward(Tensor grad_out, Tensor pre, str activation) -> Tensor
    activation_bias_backward(Tensor grad_out, Tensor pre, str activation, ScalarType? dbias_dtype=None)
        -> (Tensor, Tensor)
    bias_grad(Tensor dy, ScalarType? out_dtype=None) -> Tensor

Shapes and activations are transfuse::linear's (transfuse.ops.gemm). With pre = x @ W^T + b
(fp32 accumulation, rounded to x's dtype) and out = act(pre) + residual:

    grad_pre = grad_out * act'(pre)      (gated "<act>_mul": the gate's and the up's halves, (..., 2N))
    dx = grad_pre @ W,   dW = grad_pre^T @ x,   db = sum of grad_pre over rows,   dresidual = grad_out

grad_pre is one Triton kernel (transfuse.kernels.activation_backward, through the
activation_backward op, so that torch.compile traces it as one node with a fake implementation);
dx and dW are torch's (cuBLAS), as in eager's linear backward. db is ours: torch's column sum of a
bf16 (8192, 768..3072) gradient runs at a fraction of the memory bandwidth (~24 us on an H100), so
it is transfuse.kernels.bias_grad (bias_grad op), or, where the activation kernel writes grad_pre,
summed by that same kernel as it writes it (activation_bias_backward op). Like eager's, db is
accumulated in fp32 and rounded once to grad_pre's dtype, which is the bias's (under autocast that
is the bf16 copy of an fp32 parameter, and the cast's backward widens db to fp32, as in eager).

What is saved. Eager's linear + activation keeps x and W for the GEMM's backward and the linear's
output h for the activation's (GELU and SiLU save their input, ReLU and tanh their output, which is
h's size; a gated MLP keeps h, twice N wide, and act(gate) too). linear_train_fwd keeps x, W and
pre, h's twin, so a training step holds no more than eager's, and no more at the forward's peak
either (pre and out live together, as h and act(h) do in eager). Its forward is transfuse.linear's
bare GEMM writing pre and one kernel for act(pre) + residual; for "none" there is no pre to keep
(an empty (0,) tensor stands in, as a schema cannot return None) and the residual goes into the
GEMM's own epilogue. As for eager's matmul, x is kept only when W needs a gradient and W only when
x does.

Why two forward ops: register_autograd's setup_context sees an op's outputs, not its
intermediates, so the op that carries the formula, linear_train_fwd, returns pre as well;
linear_train, the one the LinearEpilogue pass puts into training graphs, is CompositeImplicitAutograd
and drops it (as transfuse.ops.attention_train does with the log-sum-exp). pre is differentiable
too: a gradient reaching it is added to grad_pre.

transfuse::linear itself gets a formula as well, for callers that differentiate through the
inference op: setup_context cannot see its pre, so its backward recomputes pre with one more GEMM
(F.linear) unless the activation is "none". The passes never do that: training graphs get
linear_train. Double backward is not supported (activation_backward has no formula).
Optional[...] rather than `X | None` in the signatures: every torch version's schema inference
reads it.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from transfuse.kernels import activation_backward as kernels
from transfuse.kernels import bias_grad as bias_grad_kernels
from transfuse.kernels._config import INTERPRET
from transfuse.kernels.gemm import check_linear_args
from transfuse.ops.gemm import linear_dispatch


@torch.library.custom_op("transfuse::linear_train_fwd", mutates_args=())
def linear_train_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: str,
    residual: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(x @ weight.T + bias) + residual, x @ weight.T + bias); the second is an empty (0,)
    tensor for activation "none"."""
    if activation == "none":
        return linear_dispatch(x, weight, bias, "none", residual), x.new_empty((0,))
    pre = linear_dispatch(x, weight, bias, "none", None)
    return kernels.activation_fwd(pre, activation, residual), pre


@linear_train_fwd.register_fake
def _linear_train_fwd_fake(x, weight, bias, activation, residual):
    n_out = check_linear_args(x, weight, bias, activation, residual)
    pre = x.new_empty((0,) if activation == "none" else (*x.shape[:-1], weight.shape[0]))
    return x.new_empty((*x.shape[:-1], n_out)), pre


@torch.library.custom_op("transfuse::activation", mutates_args=())
def activation(pre: torch.Tensor, activation: str) -> torch.Tensor:
    """act(pre) as linear_train_fwd computes its first output without a residual (the same kernel,
    so the same bits): a training step's backward recomputes it from the saved pre
    (passes/recompute_activations.py) instead of keeping both from the forward."""
    return kernels.activation_fwd(pre, activation, None)


@activation.register_fake
def _activation_fake(pre, activation):
    n = kernels.check_activation_args(pre, activation, None, "residual")
    return pre.new_empty((*pre.shape[:-1], n))


@torch.library.custom_op("transfuse::activation_backward", mutates_args=())
def activation_backward(grad_out: torch.Tensor, pre: torch.Tensor, activation: str) -> torch.Tensor:
    """grad_out * act'(pre), pre's shape and dtype, contiguous (see kernels.activation_backward)."""
    return kernels.activation_bwd(grad_out, pre, activation)


@activation_backward.register_fake
def _activation_backward_fake(grad_out, pre, activation):
    kernels.check_activation_args(pre, activation, grad_out, "grad_out")
    return torch.empty(pre.shape, dtype=pre.dtype, device=pre.device)


@torch.library.custom_op("transfuse::activation_bias_backward", mutates_args=())
def activation_bias_backward(grad_out: torch.Tensor, pre: torch.Tensor, activation: str,
                             dbias_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(activation_backward's grad_pre, its sum over every row: (pre.shape[-1],) in dbias_dtype, pre's
    when None)."""
    return kernels.activation_bias_bwd(grad_out, pre, activation, dbias_dtype)


@activation_bias_backward.register_fake
def _activation_bias_backward_fake(grad_out, pre, activation, dbias_dtype=None):
    kernels.check_activation_args(pre, activation, grad_out, "grad_out")
    return (torch.empty(pre.shape, dtype=pre.dtype, device=pre.device),
            torch.empty((pre.shape[-1],), dtype=dbias_dtype or pre.dtype, device=pre.device))


@torch.library.custom_op("transfuse::bias_grad", mutates_args=())
def bias_grad(dy: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """dy: (..., N), any strides, summed over every dim but the last: (N,) in out_dtype (dy's when
    None), fp32 accumulation rounded once (see kernels.bias_grad)."""
    if not dy.is_cuda and not INTERPRET:  # a CPU linear_train("none") runs torch's GEMMs too
        return dy.reshape(-1, dy.shape[-1]).sum(0, dtype=out_dtype)
    return bias_grad_kernels.bias_grad(dy, out_dtype)


@bias_grad.register_fake
def _bias_grad_fake(dy, out_dtype=None):
    torch._check(dy.dim() >= 1, lambda: "dy must be (..., N)")
    return dy.new_empty((dy.shape[-1],), dtype=out_dtype or dy.dtype)


# ---------------------------------------------------------------------------------------------
# The formula, shared by linear_train_fwd (pre saved) and linear (pre recomputed). Tensors go
# through save_for_backward: version counters catch an in-place change before the backward, and
# saved-tensor hooks (offloading, checkpointing) see every one.


def _grads(ctx, grad_out, x, weight, pre, grad_pre_in=None):
    """(dx, dweight, dbias, None, dresidual) for the five inputs of either op."""
    need_x, need_weight, need_bias, _, need_residual = ctx.needs_input_grad[:5]
    dresidual = grad_out if need_residual else None
    if not (need_x or need_weight or need_bias):
        return None, None, None, None, dresidual
    dbias = None
    if grad_out is None:  # only pre was used downstream
        grad_pre = grad_pre_in
    elif ctx.activation == "none":
        grad_pre = grad_out
    elif need_bias and grad_pre_in is None:  # the activation kernel sums grad_pre as it writes it
        grad_pre, dbias = torch.ops.transfuse.activation_bias_backward(grad_out, pre, ctx.activation)
    else:
        grad_pre = torch.ops.transfuse.activation_backward(grad_out, pre, ctx.activation)
    if grad_out is not None and grad_pre_in is not None:
        grad_pre = grad_pre + grad_pre_in
    if grad_pre is None:
        return None, None, None, None, dresidual
    rows = grad_pre.reshape(-1, grad_pre.shape[-1])
    dx = (rows @ weight).view(ctx.x_shape) if need_x else None
    dweight = rows.t() @ x.reshape(-1, x.shape[-1]) if need_weight else None
    if need_bias and dbias is None:
        dbias = torch.ops.transfuse.bias_grad(rows)
    return dx, dweight, dbias, None, dresidual


def _linear_train_fwd_setup_context(ctx, inputs, output):
    x, weight, bias, activation, residual = inputs
    need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
    ctx.activation, ctx.x_shape = activation, x.shape  # x itself is kept only for dweight
    keep_pre = activation != "none" and (need_x or need_weight or need_bias)
    ctx.save_for_backward(x if need_weight else None, weight if need_x else None, output[1] if keep_pre else None)
    # An unused pre (the usual case) then arrives as None rather than a tensor of zeros to add.
    ctx.set_materialize_grads(False)


def _linear_train_fwd_backward(ctx, grad_out, grad_pre):
    x, weight, pre = ctx.saved_tensors
    # for "none", pre is the empty stand-in: a gradient reaching it means nothing
    return _grads(ctx, grad_out, x, weight, pre, grad_pre if ctx.activation != "none" else None)


def _linear_setup_context(ctx, inputs, output):
    x, weight, bias, activation, residual = inputs
    need_x, need_weight = ctx.needs_input_grad[:2]
    ctx.activation, ctx.x_shape = activation, x.shape
    if activation == "none":
        ctx.save_for_backward(x if need_weight else None, weight if need_x else None, None)
    else:  # pre is recomputed from all three
        ctx.save_for_backward(x, weight, bias)


def _linear_backward(ctx, grad_out):
    x, weight, bias = ctx.saved_tensors
    recompute = ctx.activation != "none" and any(ctx.needs_input_grad[:3])  # not for dresidual alone
    pre = F.linear(x, weight, bias) if recompute else None
    return _grads(ctx, grad_out, x, weight, pre)


linear_train_fwd.register_autograd(_linear_train_fwd_backward, setup_context=_linear_train_fwd_setup_context)
torch.library.register_autograd("transfuse::linear", _linear_backward, setup_context=_linear_setup_context)


torch.library.define(
    "transfuse::linear_train",
    "(Tensor x, Tensor weight, Tensor? bias, str activation, Tensor? residual) -> Tensor",
    tags=(torch.Tag.pt2_compliant_tag,),
)


@torch.library.impl("transfuse::linear_train", "CompositeImplicitAutograd")
def _linear_train_composite(x, weight, bias, activation, residual):
    return torch.ops.transfuse.linear_train_fwd(x, weight, bias, activation, residual)[0]


def linear_train(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: str,
    residual: Optional[torch.Tensor],
) -> torch.Tensor:
    """act(x @ weight.T + bias) + residual, differentiable in x, weight, bias and residual, with
    pre kept for the backward: torch.ops.transfuse.linear_train."""
    return torch.ops.transfuse.linear_train(x, weight, bias, activation, residual)
