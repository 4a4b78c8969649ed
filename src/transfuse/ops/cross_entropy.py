"""torch.ops.transfuse.{linear_cross_entropy, linear_cross_entropy_fused, linear_cross_entropy_backward}:
a language model's head and loss, F.cross_entropy(F.linear(x, weight, bias).float(), target, ...),
without the (rows, V) logits ever materialised whole. Kernels and the math:
transfuse.kernels.cross_entropy; semantics: transfuse.reference.cross_entropy.

    linear_cross_entropy(Tensor x, Tensor weight, Tensor? bias, Tensor target, int ignore_index,
        float label_smoothing, str reduction, int pad_vocab_to, int chunk_rows=0) -> Tensor

x: (rows, H) in the compute dtype (fp16, bf16 or fp32: cast it first, as torch.autocast would);
weight: (V, H) and bias: (V,) in x's dtype or fp32 (then cast to x's dtype for the matmuls, which is
autocast's rule for F.linear, and their gradients come back in fp32); target: (rows,) int64. The loss
is fp32: 0-dim for 'mean' and 'sum', (rows,) for 'none'. pad_vocab_to=P > 0 runs the matmuls on a
zero-padded copy of the weight with a multiple of P rows (cuBLAS prefers N % 64 == 0); the result is
the same. chunk_rows bounds the rows whose logits exist at once (0: sized by
kernels.cross_entropy.LOGITS_CHUNK_BYTES).

Two ways to train, one result:

- linear_cross_entropy (this op) computes only the loss in its forward; its backward
  (linear_cross_entropy_backward) recomputes the logits chunk by chunk and applies grad_output.
  Nothing is held between forward and backward but the inputs; one GEMM more (4 instead of 3). It is
  the only way for reduction='none', whose grad_output is per row, and costs nothing extra for
  evaluation (no gradient GEMM in the forward).
- linear_cross_entropy_fused returns (loss, grad_x, grad_weight, grad_bias), the gradients computed in
  the same pass as the loss (Liger-Kernel's idea: a chunk's logits buffer is overwritten by its own
  gradient, which is immediately multiplied into grad_x and grad_weight); its backward only scales
  them by grad_output. 3 GEMMs, but grad_x and grad_weight are held from forward to backward.
  'mean' and 'sum' only; needs_grad_* say which gradients to compute (the rest come back as empty
  (0,) tensors), and its gradient outputs are not differentiable.

linear_cross_entropy() below is the entry point for model code: it takes the fused op when a
gradient will be needed and the reduction is scalar, the loss-only op otherwise, and accepts x with
any leading dims. Double backward is not supported. Optional[...] rather than `X | None` in the
signatures: it is the spelling every torch version's schema inference reads.
"""

from typing import Optional

import torch

from transfuse.kernels import cross_entropy as kernels


def _fake_loss(x, reduction):
    return x.new_empty((x.shape[0],) if reduction == "none" else (), dtype=torch.float32)


def _fake_grads(x, weight, bias, needs_grad_x, needs_grad_weight, needs_grad_bias):
    grad_x = x.new_empty(x.shape) if needs_grad_x else x.new_empty((0,))
    grad_weight = weight.new_empty(weight.shape) if needs_grad_weight else x.new_empty((0,))
    grad_bias = bias.new_empty(bias.shape) if needs_grad_bias and bias is not None else x.new_empty((0,))
    return grad_x, grad_weight, grad_bias


# ---------------------------------------------------------------------------------------------
# linear_cross_entropy: loss in the forward, gradients recomputed in the backward


@torch.library.custom_op("transfuse::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    pad_vocab_to: int,
    chunk_rows: int = 0,
) -> torch.Tensor:
    """F.cross_entropy(F.linear(x, weight, bias).float(), target, ...) in fp32, chunked over rows."""
    loss, _, _, _ = kernels.linear_cross_entropy_fwd(
        x, weight, bias, target, ignore_index, label_smoothing, reduction, pad_vocab_to, chunk_rows)
    return loss


@linear_cross_entropy_op.register_fake
def _(x, weight, bias, target, ignore_index, label_smoothing, reduction, pad_vocab_to, chunk_rows=0):
    kernels.check_linear_cross_entropy_args(x, weight, bias, target, ignore_index, label_smoothing, reduction,
                                            pad_vocab_to, chunk_rows)
    return _fake_loss(x, reduction)


@torch.library.custom_op("transfuse::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    pad_vocab_to: int,
    chunk_rows: int,
    needs_grad_x: bool,
    needs_grad_weight: bool,
    needs_grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight, grad_bias) of linear_cross_entropy for grad_output (0-dim, or (rows,)
    for 'none'), recomputing the logits; an empty (0,) tensor for each gradient not asked for."""
    return kernels.linear_cross_entropy_bwd(
        grad_output, x, weight, bias, target, ignore_index, label_smoothing, reduction, pad_vocab_to,
        chunk_rows, needs_grad_x, needs_grad_weight, needs_grad_bias)


@linear_cross_entropy_backward.register_fake
def _(grad_output, x, weight, bias, target, ignore_index, label_smoothing, reduction, pad_vocab_to, chunk_rows,
      needs_grad_x, needs_grad_weight, needs_grad_bias):
    kernels.check_linear_cross_entropy_args(x, weight, bias, target, ignore_index, label_smoothing, reduction,
                                            pad_vocab_to, chunk_rows)
    return _fake_grads(x, weight, bias, needs_grad_x, needs_grad_weight, needs_grad_bias)


def _setup_context_recompute(ctx, inputs, output):
    x, weight, bias, target, ignore_index, label_smoothing, reduction, pad_vocab_to, *rest = inputs
    ctx.save_for_backward(x, weight, bias, target)
    ctx.args = (ignore_index, label_smoothing, reduction, pad_vocab_to, rest[0] if rest else 0)


def _backward_recompute(ctx, grad_output):
    x, weight, bias, target = ctx.saved_tensors
    needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
    needs_bias = needs_bias and bias is not None
    if not (needs_x or needs_weight or needs_bias):
        return None, None, None, None, None, None, None, None, None
    grad_x, grad_weight, grad_bias = torch.ops.transfuse.linear_cross_entropy_backward(
        grad_output, x, weight, bias, target, *ctx.args, needs_x, needs_weight, needs_bias)
    return (grad_x if needs_x else None, grad_weight if needs_weight else None, grad_bias if needs_bias else None,
            None, None, None, None, None, None)


linear_cross_entropy_op.register_autograd(_backward_recompute, setup_context=_setup_context_recompute)


# ---------------------------------------------------------------------------------------------
# linear_cross_entropy_fused: gradients in the forward, scaled in the backward


@torch.library.custom_op("transfuse::linear_cross_entropy_fused", mutates_args=())
def linear_cross_entropy_fused(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    pad_vocab_to: int,
    chunk_rows: int,
    needs_grad_x: bool,
    needs_grad_weight: bool,
    needs_grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, d loss/dx, d loss/dweight, d loss/dbias) for reduction 'mean' or 'sum', all in one
    chunked pass; an empty (0,) tensor for each gradient not asked for."""
    return kernels.linear_cross_entropy_fwd(
        x, weight, bias, target, ignore_index, label_smoothing, reduction, pad_vocab_to, chunk_rows,
        needs_grad_x, needs_grad_weight, needs_grad_bias)


@linear_cross_entropy_fused.register_fake
def _(x, weight, bias, target, ignore_index, label_smoothing, reduction, pad_vocab_to, chunk_rows, needs_grad_x,
      needs_grad_weight, needs_grad_bias):
    kernels.check_linear_cross_entropy_args(x, weight, bias, target, ignore_index, label_smoothing, reduction,
                                            pad_vocab_to, chunk_rows)
    if reduction == "none" and (needs_grad_x or needs_grad_weight or (needs_grad_bias and bias is not None)):
        raise ValueError("transfuse linear_cross_entropy_fused: gradients need reduction 'mean' or 'sum'")
    return (_fake_loss(x, reduction),
            *_fake_grads(x, weight, bias, needs_grad_x, needs_grad_weight, needs_grad_bias))


def _setup_context_fused(ctx, inputs, output):
    _, grad_x, grad_weight, grad_bias = output
    ctx.save_for_backward(grad_x, grad_weight, grad_bias)
    ctx.computed = inputs[9:12]  # needs_grad_x, needs_grad_weight, needs_grad_bias
    ctx.has_bias = inputs[2] is not None
    # The gradient outputs are results, not functions of the inputs autograd could differentiate.
    ctx.mark_non_differentiable(grad_x, grad_weight, grad_bias)


def _backward_fused(ctx, grad_loss, *_grads_of_grads):
    grads = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:3])
    needs[2] = needs[2] and ctx.has_bias
    result = []
    for name, need, computed, grad in zip(("x", "weight", "bias"), needs, ctx.computed, grads):
        if not need:
            result.append(None)
            continue
        if not computed:
            raise RuntimeError(f"transfuse linear_cross_entropy_fused: a gradient for {name} is needed but was "
                               f"not computed in the forward pass (needs_grad_{name}=False)")
        # 0-dim fp32 grad_loss does not promote: the gradient keeps its input's dtype
        result.append(grad * grad_loss)
    return (*result, None, None, None, None, None, None, None, None, None)


linear_cross_entropy_fused.register_autograd(_backward_fused, setup_context=_setup_context_fused)


# ---------------------------------------------------------------------------------------------
# Entry points for model code


def _grads_wanted(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> tuple[bool, bool, bool]:
    """Which of x, weight, bias autograd will ask a gradient for: none outside grad mode."""
    if not torch.is_grad_enabled():
        return False, False, False
    return x.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    pad_vocab_to: int = 0,
    chunk_rows: int = 0,
) -> torch.Tensor:
    """F.cross_entropy(F.linear(x, weight, bias).float(), target, ...) for x: (..., H) and
    target: (...) int64; 'none' returns target's shape. Gradients come from the fused op (computed
    in the forward) when the loss is a scalar and one of x, weight, bias requires grad under grad
    mode, from the recomputing backward for reduction='none'."""
    hidden = x.shape[-1]
    x_rows = x.reshape(-1, hidden)
    target_rows = target.reshape(-1)
    needs = _grads_wanted(x, weight, bias)
    if any(needs) and reduction != "none":
        loss, _, _, _ = torch.ops.transfuse.linear_cross_entropy_fused(
            x_rows, weight, bias, target_rows, ignore_index, label_smoothing, reduction, pad_vocab_to, chunk_rows,
            *needs)
        return loss
    loss = torch.ops.transfuse.linear_cross_entropy(
        x_rows, weight, bias, target_rows, ignore_index, label_smoothing, reduction, pad_vocab_to, chunk_rows)
    return loss.reshape(target.shape) if reduction == "none" else loss


# ---------------------------------------------------------------------------------------------
# Cross-entropy over logits that exist anyway (a model that returns them next to its loss).


@torch.library.custom_op("transfuse::cross_entropy", mutates_args=())
def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                  reduction: str) -> torch.Tensor:
    """F.cross_entropy(logits.float(), target, ...) for logits (rows, V) of any float dtype, computed in
    fp32 without an fp32 copy. The loss is fp32: 0-dim for mean/sum, (rows,) for none."""
    rows = kernels.cross_entropy_fwd_inplace_grad(_unit_stride(logits), target, logits.shape[1], ignore_index,
                                                  label_smoothing, None)
    return _reduce(rows, target, ignore_index, reduction)


def _unit_stride(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def _reduce(rows: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    n_valid = kernels.count_valid(target, ignore_index) if reduction == "mean" else None
    return kernels.reduce_loss_rows(rows, reduction, n_valid)


@cross_entropy.register_fake
def _(logits, target, ignore_index, label_smoothing, reduction):
    if reduction not in kernels.REDUCTIONS:
        raise ValueError(f"transfuse cross_entropy: reduction must be one of {kernels.REDUCTIONS}, got {reduction!r}")
    return logits.new_empty((logits.shape[0],) if reduction == "none" else (), dtype=torch.float32)


@torch.library.custom_op("transfuse::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(grad_output: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                           label_smoothing: float, reduction: str) -> torch.Tensor:
    """d loss / d logits, in the logits' dtype: the kernel recomputes the row's softmax from the saved
    logits and writes the gradient over a copy of them (nothing but the logits is kept for backward)."""
    grad = logits.clone(memory_format=torch.contiguous_format)
    scale = grad_output.float()
    if reduction == "mean":
        scale = scale / kernels.count_valid(target, ignore_index)
    kernels.cross_entropy_fwd_inplace_grad(grad, target, logits.shape[1], ignore_index, label_smoothing,
                                           scale.contiguous())
    return grad


@cross_entropy_backward.register_fake
def _(grad_output, logits, target, ignore_index, label_smoothing, reduction):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _cross_entropy_setup(ctx, inputs, output):
    logits, target, ignore_index, label_smoothing, reduction = inputs
    ctx.save_for_backward(logits, target)
    ctx.settings = (ignore_index, label_smoothing, reduction)


def _cross_entropy_grad(ctx, grad_output):
    logits, target = ctx.saved_tensors
    grad = torch.ops.transfuse.cross_entropy_backward(grad_output, logits, target, *ctx.settings)
    return grad, None, None, None, None


cross_entropy.register_autograd(_cross_entropy_grad, setup_context=_cross_entropy_setup)


# ---------------------------------------------------------------------------------------------
# The LM head and its loss when the logits are returned too (nanoGPT's `return logits, loss`).


@torch.library.custom_op("transfuse::linear_logits_cross_entropy", mutates_args=())
def linear_logits_cross_entropy_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    pad_vocab_to: int,
    needs_grad: bool,
    logits_differentiable: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, loss, lse): logits = F.linear(x, weight, bias) as (rows, V) contiguous in x's dtype,
    loss = F.cross_entropy(logits.float(), target, ...) in fp32, and lse (rows,) fp32 the rows'
    log-sum-exp for the backward (an empty (0,) tensor without needs_grad), not differentiable.
    logits_differentiable=False: the logits are not differentiable either (their gradient is
    attached outside the graph, ReturnedLogits). See kernels.cross_entropy.linear_logits_cross_entropy_fwd."""
    return kernels.linear_logits_cross_entropy_fwd(x, weight, bias, target, ignore_index, label_smoothing, reduction,
                                                   pad_vocab_to, needs_grad)


@linear_logits_cross_entropy_op.register_fake
def _(x, weight, bias, target, ignore_index, label_smoothing, reduction, pad_vocab_to, needs_grad,
      logits_differentiable=True):
    kernels.check_linear_cross_entropy_args(x, weight, bias, target, ignore_index, label_smoothing, reduction,
                                            pad_vocab_to, 0)
    lse = x.new_empty((x.shape[0],), dtype=torch.float32) if needs_grad else x.new_empty((0,))
    return x.new_empty((x.shape[0], weight.shape[0])), _fake_loss(x, reduction), lse


@torch.library.custom_op("transfuse::linear_logits_cross_entropy_backward", mutates_args=())
def linear_logits_cross_entropy_backward(
    grad_loss: Optional[torch.Tensor],
    grad_logits: Optional[torch.Tensor],
    logits: torch.Tensor,
    lse: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    pad_vocab_to: int,
    needs_grad_x: bool,
    needs_grad_weight: bool,
    needs_grad_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight, grad_bias) of linear_logits_cross_entropy for the gradients its loss and
    logits received (None: none), from its returned logits and saved lse; an empty (0,) tensor for
    each gradient not asked for."""
    return kernels.linear_logits_cross_entropy_bwd(grad_loss, grad_logits, logits, lse, x, weight, bias, target,
                                                   ignore_index, label_smoothing, reduction, pad_vocab_to,
                                                   needs_grad_x, needs_grad_weight, needs_grad_bias)


@linear_logits_cross_entropy_backward.register_fake
def _(grad_loss, grad_logits, logits, lse, x, weight, bias, target, ignore_index, label_smoothing, reduction,
      pad_vocab_to, needs_grad_x, needs_grad_weight, needs_grad_bias):
    return _fake_grads(x, weight, bias, needs_grad_x, needs_grad_weight, needs_grad_bias)


def _setup_context_logits(ctx, inputs, output):
    (x, weight, bias, target, ignore_index, label_smoothing, reduction, pad_vocab_to, needs_grad,
     logits_differentiable) = inputs  # defaults included
    logits, _, lse = output
    # The returned logits, not the padded buffer they were copied from: that buffer is freed after the
    # forward, and the user holds the logits anyway. Modifying them in place before backward() is then
    # autograd's usual error, never a silently wrong gradient.
    ctx.save_for_backward(x, weight, bias, target, logits, lse)
    ctx.settings = (ignore_index, label_smoothing, reduction, pad_vocab_to)
    ctx.has_bias = bias is not None
    ctx.computed = needs_grad
    ctx.mark_non_differentiable(lse)
    if not logits_differentiable:
        ctx.mark_non_differentiable(logits)
    # A logits output that nothing differentiates (the usual case: the loss alone is backpropagated)
    # arrives as None, not as a (rows, V) tensor of zeros to be read. (AOTAutograd's compiled
    # backward still receives zeros there: its autograd.Function materialises every tangent.)
    ctx.set_materialize_grads(False)


def _backward_logits(ctx, grad_logits, grad_loss, _grad_of_lse):
    x, weight, bias, target, logits, lse = ctx.saved_tensors
    needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
    needs_bias = needs_bias and ctx.has_bias
    nones = (None,) * 7  # target, the four settings, the two flags
    if not (needs_x or needs_weight or needs_bias) or (grad_logits is None and grad_loss is None):
        return None, None, None, *nones
    if grad_loss is not None and not ctx.computed:
        raise RuntimeError("transfuse linear_logits_cross_entropy: the loss needs a gradient but the forward ran "
                           "with needs_grad=False")
    grad_x, grad_weight, grad_bias = torch.ops.transfuse.linear_logits_cross_entropy_backward(
        grad_loss, grad_logits, logits, lse, x, weight, bias, target, *ctx.settings, needs_x, needs_weight, needs_bias)
    return (grad_x if needs_x else None, grad_weight if needs_weight else None, grad_bias if needs_bias else None,
            *nones)


linear_logits_cross_entropy_op.register_autograd(_backward_logits, setup_context=_setup_context_logits)


def linear_logits_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    pad_vocab_to: int = 0,
    logits_differentiable: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(x, weight, bias), F.cross_entropy(that.float() viewed as (rows, V), target, ...)) for
    x: (..., H) and target with as many elements as x has rows: the logits come back (..., V) and
    contiguous, the loss fp32 ('none': target's shape). The loss's gradient w.r.t. the logits is
    computed in the forward pass only when grad mode is on and x, weight or bias requires grad.
    logits_differentiable=False returns logits that do not require grad (ReturnedLogits gives them
    their gradient outside a compiled graph)."""
    hidden = x.shape[-1]
    needs_grad = any(_grads_wanted(x, weight, bias))
    logits, loss, _ = torch.ops.transfuse.linear_logits_cross_entropy(
        x.reshape(-1, hidden), weight, bias, target.reshape(-1), ignore_index, label_smoothing, reduction,
        pad_vocab_to, needs_grad, logits_differentiable)
    logits = logits.view(*x.shape[:-1], weight.shape[0])
    return logits, (loss.reshape(target.shape) if reduction == "none" else loss)


class ReturnedLogits(torch.autograd.Function):
    """The gradient of logits returned by a training graph whose loss is computed inside it, attached
    outside the graph: ReturnedLogits.apply(logits, x, weight, bias) is `logits` (a view) with
    F.linear(x, weight, bias)'s backward (autocast's rule: x's dtype for the products, each
    gradient cast to its input's dtype).

    Why outside: AOTAutograd's compiled backward takes a gradient for every differentiable output and
    materialises the missing ones as zeros. The usual step backpropagates the loss alone, and the
    returned logits' zeros were a (rows, V) tensor filled, copied into the CUDA graph's input and read
    every step (GPT-2 at 8 x 1024 tokens: 0.8 GB each). Returned from the graph without a gradient
    and given one here, they cost nothing unless the user differentiates them; then autograd runs
    this backward, and its grad_x joins the graph's own backward through x, a graph output."""

    @staticmethod
    def forward(ctx, logits, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        return logits

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1]).to(x.dtype)
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_x = (rows @ weight.to(x.dtype)).view(x.shape)
        if ctx.needs_input_grad[2]:
            grad_weight = (rows.t() @ x2).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[3]:
            grad_bias = rows.sum(0).to(bias.dtype)
        return None, grad_x, grad_weight, grad_bias


def attach_returned_logits(outputs, args, heads: list) -> tuple | list:
    """A training graph's outputs with each (logits position, x position, weight index, bias index)
    of `heads` applied (ReturnedLogits; weight and bias are the graph's inputs `args`), and the x
    outputs, which the pass appended after the graph's own, dropped."""
    out = list(outputs)
    for logits_at, x_at, weight_at, bias_at in heads:
        bias = args[bias_at] if bias_at is not None else None
        out[logits_at] = ReturnedLogits.apply(out[logits_at], out[x_at], args[weight_at], bias)
    out = out[:len(out) - len(heads)]
    return tuple(out) if isinstance(outputs, tuple) else out
