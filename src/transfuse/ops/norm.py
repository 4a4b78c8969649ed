"""torch.ops.transfuse.{layer_norm, add_layer_norm, rms_norm, add_rms_norm}: normalisation over
the last dim, optionally fused with the residual add before it. Kernels: transfuse.kernels.norm;
semantics, operation by operation: transfuse.reference.norm.

Every output is a new contiguous tensor of x's shape and dtype (the layer norms' normalised output
in out_dtype where given). The add_ ops return (out, s) with s = x + residual in x's dtype; with
store_sum=False s is never written and an empty (0,) tensor stands in for it, so a graph whose sum
has no other user (BERT's post-norm) saves its traffic.

Under autocast a pre-norm block adds a bf16 branch to an fp32 residual stream, normalises the fp32
sum and casts the result to bf16 for the next linear: add_layer_norm takes the narrower residual
(promoted as eager promotes it) and writes the bf16 output directly (out_dtype), one kernel where
eager runs three, and its backward reads the bf16 gradient as it is (passes/norm.py, training).

The ops take eps as given: where a model passes eps=None to F.rms_norm, the caller resolves it to
torch.finfo(torch.float32).eps, what torch uses for fp16, bf16 and fp32 inputs alike.
Optional[...] rather than `X | None` in the signatures: it is the spelling every torch version's
schema inference reads.

Autograd: each op has a formula (register_autograd) whose backward calls
transfuse::layer_norm_backward or transfuse::rms_norm_backward (kernels in
transfuse.kernels.norm_backward), custom ops themselves, so that torch.compile traces each as one
node with a fake implementation. The backward recomputes the row statistics instead of saving
them. The add_ ops save the sum output when they return it (the row they normalised: one tensor
to read again instead of x and residual), else x and residual; so an in-place change to the
returned sum before the backward is an error (autograd's version check), as it is for any saved
tensor. dx and dresidual are one tensor, ds + dsum. Grads of grads (double backward) are not
supported: the backward ops have no autograd formula, and backpropagating through them raises.
"""

from typing import Optional

import torch

from transfuse.kernels import norm as kernels
from transfuse.kernels import norm_backward as bwd_kernels


@torch.library.custom_op("transfuse::layer_norm", mutates_args=())
def layer_norm(
    x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """F.layer_norm(x, (N,), weight, bias, eps) for x: (..., N); weight, bias: (N,) in x's dtype or fp32.
    out_dtype: the result rounded once to it, `F.layer_norm(...).to(out_dtype)` (autocast's fp32
    norm feeding a bf16 linear), in one pass."""
    return kernels.layer_norm_fwd(x, weight, bias, eps, out_dtype=out_dtype)


@layer_norm.register_fake
def _(x, weight, bias, eps, out_dtype=None):
    out_dtype = kernels.check_layer_norm_args(x, weight, bias, out_dtype=out_dtype)
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("transfuse::add_layer_norm", mutates_args=())
def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    store_sum: bool,
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(x + residual), x + residual); the second is an empty (0,) tensor unless store_sum.
    residual may be narrower than x (promoted, as eager adds them); out_dtype as in layer_norm."""
    return kernels.add_layer_norm_fwd(x, residual, weight, bias, eps, store_sum, out_dtype=out_dtype)


@add_layer_norm.register_fake
def _(x, residual, weight, bias, eps, store_sum, out_dtype=None):
    out_dtype = kernels.check_layer_norm_args(x, weight, bias, residual, out_dtype)
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape if store_sum else (0,))


@torch.library.custom_op("transfuse::rms_norm", mutates_args=())
def rms_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """RMSNorm over the last dim. cast_before_weight=True, weight_offset=0: Llama/Mistral/Qwen2 (and
    T5 with a weight of x's dtype); cast_before_weight=False: F.rms_norm (offset 0) and Gemma
    (offset 1.0). Output dtype is x's or out_dtype; see kernels.norm.check_rms_norm_args for the
    weight dtypes."""
    return kernels.rms_norm_fwd(x, weight, eps, weight_offset, cast_before_weight, out_dtype=out_dtype)


@rms_norm.register_fake
def _(x, weight, eps, weight_offset, cast_before_weight, out_dtype=None):
    out_dtype = kernels.check_rms_norm_args(x, weight, weight_offset, cast_before_weight, out_dtype=out_dtype)
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.custom_op("transfuse::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    store_sum: bool,
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the second is an empty (0,) tensor unless store_sum.
    residual may be narrower than x; out_dtype as in rms_norm."""
    return kernels.add_rms_norm_fwd(x, residual, weight, eps, weight_offset, cast_before_weight, store_sum,
                                    out_dtype=out_dtype)


@add_rms_norm.register_fake
def _(x, residual, weight, eps, weight_offset, cast_before_weight, store_sum, out_dtype=None):
    out_dtype = kernels.check_rms_norm_args(x, weight, weight_offset, cast_before_weight, residual, out_dtype)
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape if store_sum else (0,))


# ---------------------------------------------------------------------------------------------
# Backward ops: what the autograd formulas below call. Gradients not asked for (compute_* False, or
# no parameter) come back as empty (0,) tensors, as the forward's unstored sum does: a custom op
# returns tensors, not None.


def _or_empty(grad: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return grad if grad is not None else like.new_empty((0,))


@torch.library.custom_op("transfuse::layer_norm_backward", mutates_args=())
def layer_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    dsum: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    compute_dx: bool,
    compute_dweight: bool,
    compute_dbias: bool,
    compute_dx_sum: bool = False,
    dx_cast: Optional[torch.dtype] = None,
    dx_sum_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias, dx_sum, dx_cast) of layer_norm(x) (add_layer_norm with a residual) given
    dy and the sum output's gradient dsum. dx_cast: dx.to(dx_cast) from the same pass, the gradient
    of a narrower residual. dx_sum (that tensor, or dx, summed over its rows, in dx_sum_dtype or its
    own) only when compute_dx_sum: passes/backward_bias_grad.py asks for it where the backward graph
    sums it for a linear's bias. See kernels.norm_backward.layer_norm_bwd."""
    dx, dweight, dbias, dx_sum, dx2 = bwd_kernels.layer_norm_bwd(
        dy, x, weight, bias, eps, residual=residual, dsum=dsum, compute_dx=compute_dx,
        compute_dweight=compute_dweight, compute_dbias=compute_dbias, compute_dx_sum=compute_dx_sum,
        dx_cast=dx_cast, dx_sum_dtype=dx_sum_dtype)
    return tuple(_or_empty(t, x) for t in (dx, dweight, dbias, dx_sum, dx2))


@layer_norm_backward.register_fake
def _(dy, x, residual, dsum, weight, bias, eps, compute_dx, compute_dweight, compute_dbias, compute_dx_sum=False,
      dx_cast=None, dx_sum_dtype=None):
    kernels.check_layer_norm_args(x, weight, bias, residual)
    n = x.shape[-1]
    dx = x.new_empty(x.shape if compute_dx else (0,))
    dweight = weight.new_empty((n,)) if compute_dweight and weight is not None else x.new_empty((0,))
    dbias = bias.new_empty((n,)) if compute_dbias and bias is not None else x.new_empty((0,))
    dx_sum = x.new_empty((n,) if compute_dx_sum else (0,), dtype=dx_sum_dtype or dx_cast or x.dtype)
    dx2 = x.new_empty(x.shape, dtype=dx_cast) if dx_cast is not None else x.new_empty((0,))
    return dx, dweight, dbias, dx_sum, dx2


@torch.library.custom_op("transfuse::rms_norm_backward", mutates_args=())
def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    dsum: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    eps: float,
    weight_offset: float,
    cast_before_weight: bool,
    compute_dx: bool,
    compute_dweight: bool,
    dx_cast: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dx_cast) of rms_norm(x) (add_rms_norm with a residual) given dy and the sum
    output's gradient dsum, dx_cast as in layer_norm_backward; see kernels.norm_backward.rms_norm_bwd."""
    dx, dweight, dx2 = bwd_kernels.rms_norm_bwd(
        dy, x, weight, eps, weight_offset, cast_before_weight, residual=residual, dsum=dsum,
        compute_dx=compute_dx, compute_dweight=compute_dweight, dx_cast=dx_cast)
    return _or_empty(dx, x), _or_empty(dweight, x), _or_empty(dx2, x)


@rms_norm_backward.register_fake
def _(dy, x, residual, dsum, weight, eps, weight_offset, cast_before_weight, compute_dx, compute_dweight,
      dx_cast=None):
    kernels.check_rms_norm_args(x, weight, weight_offset, cast_before_weight, residual)
    dx = x.new_empty(x.shape if compute_dx else (0,))
    dweight = weight.new_empty((x.shape[-1],)) if compute_dweight and weight is not None else x.new_empty((0,))
    dx2 = x.new_empty(x.shape, dtype=dx_cast) if dx_cast is not None else x.new_empty((0,))
    return dx, dweight, dx2


# ---------------------------------------------------------------------------------------------
# Autograd formulas of the forward ops. ctx.needs_input_grad follows the inputs in order; None
# is returned for every input that needs no gradient (and for the non-tensor ones).


def _needed(grad: torch.Tensor, needed: bool) -> Optional[torch.Tensor]:
    return grad if needed else None


def _save(ctx, x, residual, s, store_sum, weight, bias=None):
    """Save what the backward re-reads: the sum s when the forward returned it, else x and
    residual (x alone without a residual); then the parameters. All through save_for_backward, so
    version counters catch an in-place change before the backward and saved-tensor hooks
    (offloading, checkpointing) see every tensor."""
    ctx.store_sum = store_sum
    if store_sum:
        ctx.save_for_backward(s, None, weight, bias)
    else:
        ctx.save_for_backward(x, residual, weight, bias)


def _output_grad(grad: Optional[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    # None only where autograd was told not to materialise grads of unused outputs; then the
    # output contributes nothing, which a zero gradient says.
    return grad if grad is not None else torch.zeros_like(rows, memory_format=torch.contiguous_format)


def _layer_norm_setup_context(ctx, inputs, output):
    x, weight, bias, eps = inputs[:4]
    ctx.eps = eps
    _save(ctx, x, None, None, False, weight, bias)


def _layer_norm_backward(ctx, dout):
    x, _, weight, bias = ctx.saved_tensors
    need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
    dx, dweight, dbias, _, _ = torch.ops.transfuse.layer_norm_backward(
        _output_grad(dout, x), x, None, None, weight, bias, ctx.eps, need_x, need_weight, need_bias)
    return _needed(dx, need_x), _needed(dweight, need_weight), _needed(dbias, need_bias), None, None


def _add_layer_norm_setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, store_sum = inputs[:6]
    ctx.eps = eps
    ctx.residual_dtype = residual.dtype
    _save(ctx, x, residual, output[1], store_sum, weight, bias)


def _add_layer_norm_backward(ctx, dout, dsum):
    rows, residual, weight, bias = ctx.saved_tensors
    need_x, need_residual, need_weight, need_bias = ctx.needs_input_grad[:4]
    # without store_sum the second output is an empty stand-in: its gradient means nothing
    dsum = dsum if ctx.store_sum else None
    # d(x + residual)/dx = d(x + residual)/dresidual = 1: both get ds, the residual's in its own
    # dtype (a narrower residual was promoted in the forward; eager's add casts its gradient back),
    # written by the same kernel rather than a copy of ds
    cast = _residual_cast(ctx, rows, need_residual)
    ds, dweight, dbias, _, ds_cast = torch.ops.transfuse.layer_norm_backward(
        _output_grad(dout, rows), rows, residual, dsum, weight, bias, ctx.eps, need_x or need_residual,
        need_weight, need_bias, False, cast)
    dresidual = ds_cast if cast is not None else _needed(ds, need_residual)
    return (_needed(ds, need_x), dresidual, _needed(dweight, need_weight),
            _needed(dbias, need_bias), None, None, None)


def _residual_cast(ctx, rows: torch.Tensor, need_residual: bool) -> Optional[torch.dtype]:
    """The dtype the residual's gradient is cast to in the norm backward kernel, or None (no cast)."""
    return ctx.residual_dtype if need_residual and ctx.residual_dtype != rows.dtype else None


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, eps, weight_offset, cast_before_weight = inputs[:5]
    ctx.args = (eps, weight_offset, cast_before_weight)
    _save(ctx, x, None, None, False, weight)


def _rms_norm_backward(ctx, dout):
    x, _, weight, _ = ctx.saved_tensors
    need_x, need_weight = ctx.needs_input_grad[:2]
    dx, dweight, _ = torch.ops.transfuse.rms_norm_backward(
        _output_grad(dout, x), x, None, None, weight, *ctx.args, need_x, need_weight)
    return _needed(dx, need_x), _needed(dweight, need_weight), None, None, None, None


def _add_rms_norm_setup_context(ctx, inputs, output):
    x, residual, weight, eps, weight_offset, cast_before_weight, store_sum = inputs[:7]
    ctx.args = (eps, weight_offset, cast_before_weight)
    ctx.residual_dtype = residual.dtype
    _save(ctx, x, residual, output[1], store_sum, weight)


def _add_rms_norm_backward(ctx, dout, dsum):
    rows, residual, weight, _ = ctx.saved_tensors
    need_x, need_residual, need_weight = ctx.needs_input_grad[:3]
    dsum = dsum if ctx.store_sum else None
    cast = _residual_cast(ctx, rows, need_residual)  # as in _add_layer_norm_backward
    ds, dweight, ds_cast = torch.ops.transfuse.rms_norm_backward(
        _output_grad(dout, rows), rows, residual, dsum, weight, *ctx.args, need_x or need_residual,
        need_weight, cast)
    dresidual = ds_cast if cast is not None else _needed(ds, need_residual)
    return _needed(ds, need_x), dresidual, _needed(dweight, need_weight), None, None, None, None, None


layer_norm.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup_context)
add_layer_norm.register_autograd(_add_layer_norm_backward, setup_context=_add_layer_norm_setup_context)
rms_norm.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup_context)
add_rms_norm.register_autograd(_add_rms_norm_backward, setup_context=_add_rms_norm_setup_context)
