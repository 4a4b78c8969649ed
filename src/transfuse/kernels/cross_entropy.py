"""Cross-entropy over a language model's vocabulary, fused with the LM-head linear that produces
the logits, for training: the full (rows, V) logits tensor is never materialised at once.

x: (rows, H), weight: (V, H), bias: (V,) or None, target: (rows,) int64. Logits z = x @ weight.T + bias
are formed chunk by chunk of rows with cuBLAS (torch.mm) in x's dtype, the way F.linear computes them
under torch.autocast, and each chunk's logits buffer is handed to one Triton kernel that, per row and
in fp32 whatever the logits' dtype,

    1. runs the online softmax normaliser over the vocab in blocks (Milakov & Gimelshein 2018,
       "Online normalizer calculation for softmax"): m_i = running max, l_i = running sum of
       exp(z_j - m_i), rescaled by exp(m_old - m_new) when the max grows; lse = m_i + log(l_i);
    2. writes the row's loss, torch's definition with label smoothing eps (Szegedy et al. 2016):

           loss = (1 - eps) * (lse - z_t) + eps * (lse - mean_j z_j)

       which is (1 - eps) * NLL + (eps / V) * sum_j -log_softmax_j; a row whose target is
       ignore_index contributes 0 and is left out of the 'mean' denominator (torch divides both
       terms by the number of non-ignored rows);
    3. overwrites the logits, in place, with the gradient of the reduced loss w.r.t. them:

           dloss/dz_j = scale * (softmax_j - (1 - eps) * [j == t] - eps / V)

       scale = 1/n_valid for 'mean' (n_valid counted over all rows, not the chunk), 1 for 'sum',
       grad_output[row] when a backward pass recomputes for reduction='none'; 0 on ignored rows.

Then grad_x[chunk] = dz @ weight and grad_weight += dz.T @ x[chunk] (grad_bias += dz.sum(0)), the
latter accumulated over chunks in fp32 and cast to the parameter's dtype once at the end. The
logits buffer is thus reused for its own gradient (Liger-Kernel's fused linear cross-entropy idea),
and the peak memory is one chunk of logits, not rows * V.

Vocabulary padding (pad_vocab_to=P): cuBLAS is markedly slower when the GEMM's N (here V, e.g.
GPT-2's 50257) is not a multiple of 64/128, so the matmuls may run on a zero-padded copy of the
weight with Vp = ceil(V / P) * P rows. The kernel knows the true V: padded columns are excluded
from max, sum and mean (as if their logits were -inf) and get a zero gradient, so the padded rows of
grad_weight are zero and are cut off; the caller's weight is never modified and grad_weight has
shape (V, H).

A model that returns its logits (linear_logits_cross_entropy_fwd/_bwd, at the end of this file)
cannot chunk them: one padded GEMM, then one kernel pass that copies the real columns out
(COPY_LOGITS) and keeps each row's log-sum-exp; the padded buffer is freed. The backward's one
elementwise pass recomputes the gradient from the returned logits and adds the logits' own gradient
(AOTAutograd hands a tensor of zeros there even when nothing differentiated them), into the padded
buffer the backward's GEMMs read.

Compute dtype: x's. weight and bias may be x's dtype or fp32; an fp32 parameter with a half-precision
x is cast to x's dtype for the matmuls, which is what torch.autocast does to F.linear's arguments
(both operands in the autocast dtype), and its gradient is returned in fp32. The loss is fp32.
"""

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from transfuse.kernels._config import INTERPRET, next_power_of_2
from transfuse.kernels.norm import _round_to

# Default bound on one chunk's logits buffer. 256 MiB holds 2560 rows of GPT-2's padded vocab in
# bf16 (GEMMs of M = 2560 keep an H100 busy) and is small next to the activations of a training step.
LOGITS_CHUNK_BYTES = 256 << 20

REDUCTIONS = ("mean", "sum", "none")
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class CrossEntropyConfig:
    BLOCK_V: int  # vocab columns per step of the two passes over a row
    ROWS_PER_PROGRAM: int  # rows streamed together; > 1 only for short rows and the interpreter
    num_warps: int


def cross_entropy_config(n_rows: int, n_cols_padded: int) -> CrossEntropyConfig:
    """Each program streams ROWS_PER_PROGRAM rows through BLOCK_V-column tiles. No autotuning: the
    kernel is bound by memory bandwidth (a row is read twice and written once), and a tile of 4096
    fp32 values over 8 warps is 16 per thread, a few 16-byte vectors in flight and no spills. An LM
    head's rows (V ~ 32k-256k) take one program each; short rows are grouped until a tile holds
    4096 values. Under the interpreter every program costs milliseconds of Python whatever its size,
    so there it takes up to 16 rows, which is what keeps the CPU tests fast."""
    block_v = min(max(next_power_of_2(n_cols_padded), 16), 4096)
    rows = 4096 // block_v
    if INTERPRET:
        block_v = min(block_v, 1024)
        rows = 16
    rows = max(min(rows, next_power_of_2(max(n_rows, 1))), 1)
    num_warps = 8 if rows * block_v >= 2048 else 4
    return CrossEntropyConfig(BLOCK_V=block_v, ROWS_PER_PROGRAM=rows, num_warps=num_warps)


@triton.jit(do_not_specialize=["n_rows", "ignore_index", "stride_grad_scale_row"])
def _cross_entropy_fwd_kernel(
    logits_ptr, stride_logits_row,
    target_ptr,
    loss_ptr,
    grad_scale_ptr, stride_grad_scale_row,
    copy_ptr, stride_copy_row,
    lse_ptr,
    n_rows, n_cols, n_cols_padded, ignore_index, label_smoothing,
    BLOCK_V: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    STORE_GRAD: tl.constexpr,
    COPY_LOGITS: tl.constexpr,
    STORE_LSE: tl.constexpr,
    BF16_RNE_BY_HAND: tl.constexpr,
):
    # n_cols is the true vocab V, n_cols_padded >= V the buffer's width: the columns in between
    # are padding and take part in nothing but get a zero gradient. COPY_LOGITS: pass 1 also
    # writes the first V columns of every row (ignored rows included) to copy_ptr, the contiguous
    # (rows, V) logits a model returns, from the same loads the softmax statistics use.
    pid = tl.program_id(0)
    rows = pid * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    row_mask = rows < n_rows
    rows = rows.to(tl.int64)
    row_ptrs = logits_ptr + rows * stride_logits_row
    cols = tl.arange(0, BLOCK_V)
    target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index)
    # Ignored rows (and rows past the end) are never read: their loads are masked off, which on a
    # GPU issues no memory traffic, and their loss and gradient are zeros.
    valid = row_mask & (target != ignore_index)

    # Pass 1: online max and normaliser (Milakov & Gimelshein 2018), everything in fp32: the
    # interpreter computes bf16 arithmetic wrongly and an fp16 sum of exps loses its low bits.
    # Every block holds at least one real column, so for a valid row m_new is finite and masked
    # lanes (-inf) add exp(-inf) = 0. An invalid row, all -inf, keeps m_i = 0 and l_i = 0 (no NaN
    # from -inf - -inf) and gets lse = 0, never used.
    m_i = tl.where(valid, float("-inf"), 0.0)
    l_i = tl.zeros((ROWS_PER_PROGRAM,), dtype=tl.float32)
    z_sum = tl.zeros((ROWS_PER_PROGRAM,), dtype=tl.float32)  # sum_j z_j, for the smoothing term's mean
    for start in range(0, n_cols, BLOCK_V):
        offs = start + cols
        col_mask = offs < n_cols
        mask = valid[:, None] & col_mask[None, :]
        if COPY_LOGITS:
            # every row is copied, so every row is read; ignored rows then count as all -inf
            copy_mask = row_mask[:, None] & col_mask[None, :]
            z_raw = tl.load(row_ptrs[:, None] + offs[None, :], mask=copy_mask, other=float("-inf"))
            tl.store(copy_ptr + rows[:, None] * stride_copy_row + offs[None, :], z_raw, mask=copy_mask)
            z = tl.where(mask, z_raw.to(tl.float32), float("-inf"))
        else:
            z = tl.load(row_ptrs[:, None] + offs[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        m_i = m_new
        if HAS_SMOOTHING:
            z_sum += tl.sum(tl.where(mask, z, 0.0), axis=1)
    lse = m_i + tl.log(tl.where(valid, l_i, 1.0))
    if STORE_LSE:  # for a backward that recomputes the gradient (_cross_entropy_logits_grad_kernel)
        tl.store(lse_ptr + rows, lse, mask=row_mask)

    # A target outside [0, V) is an error torch reports with a device-side assert; here it asserts
    # under TRITON_DEBUG / the interpreter and otherwise turns the row's loss into NaN (never a read
    # of another row, nor of a padded column's logit).
    in_range = (target >= 0) & (target < n_cols)
    tl.device_assert(in_range | (target == ignore_index),
                     "transfuse cross_entropy: target out of [0, V) and not ignore_index")
    z_target = tl.load(row_ptrs + tl.where(in_range, target, 0), mask=valid & in_range, other=0.0).to(tl.float32)
    loss = lse - z_target
    if HAS_SMOOTHING:
        # (eps / V) * sum_j (lse - z_j) = eps * (lse - mean_j z_j)
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - z_sum / n_cols)
    loss = tl.where(in_range, loss, float("nan"))
    loss = tl.where(valid, loss, 0.0)
    tl.store(loss_ptr + rows, loss, mask=row_mask)

    if STORE_GRAD:
        # Pass 2: d loss / d z_j = scale * (softmax_j - (1 - eps) [j == t] - eps / V), written over
        # the logits just read (a program owns its rows: no other program reads them). Padded
        # columns get softmax = exp(-inf) = 0 and no smoothing share: 0; ignored rows 0.
        scale = tl.load(grad_scale_ptr + rows * stride_grad_scale_row, mask=valid, other=0.0).to(tl.float32)
        on_target = 1.0 - label_smoothing
        smooth_share = label_smoothing / n_cols
        for start in range(0, n_cols_padded, BLOCK_V):
            offs = start + cols
            col_mask = offs < n_cols
            mask = valid[:, None] & col_mask[None, :]
            z = tl.load(row_ptrs[:, None] + offs[None, :], mask=mask, other=float("-inf")).to(tl.float32)
            grad = tl.exp(z - lse[:, None]) - tl.where(offs[None, :] == target[:, None], on_target, 0.0)
            if HAS_SMOOTHING:
                grad = grad - tl.where(col_mask[None, :], smooth_share, 0.0)
            grad = tl.where(mask, grad * scale[:, None], 0.0)
            if BF16_RNE_BY_HAND:  # only then: a nested jit call costs the interpreter a millisecond
                grad = _round_to(grad, logits_ptr.dtype.element_ty, BF16_RNE_BY_HAND)
            store_mask = row_mask[:, None] & (offs < n_cols_padded)[None, :]
            tl.store(row_ptrs[:, None] + offs[None, :], grad.to(logits_ptr.dtype.element_ty), mask=store_mask)


def logits_grad_config(n_rows: int, n_cols_padded: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_V, num_warps) of _cross_entropy_logits_grad_kernel: an elementwise pass, 2048
    values a program over 4 warps (16 a thread: two 16-byte bf16 vectors per operand)."""
    if INTERPRET:
        return min(next_power_of_2(max(n_rows, 1)), 16), min(max(next_power_of_2(n_cols_padded), 16), 1024), 4
    return 1, min(max(next_power_of_2(n_cols_padded), 16), 2048), 4


@triton.jit(do_not_specialize=["n_rows", "ignore_index", "stride_grad_scale_row"])
def _cross_entropy_logits_grad_kernel(
    logits_ptr, stride_logits_row,
    lse_ptr,
    target_ptr,
    grad_scale_ptr, stride_grad_scale_row,
    grad_logits_ptr, stride_grad_logits_row,
    out_ptr, stride_out_row,
    n_rows, n_vocab, n_real, n_out, col_start, ignore_index, label_smoothing,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_LOSS_GRAD: tl.constexpr,
    HAS_GRAD_LOGITS: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    BF16_RNE_BY_HAND: tl.constexpr,
):
    # Columns [col_start, col_start + n_out) of the gradient, written to out's columns [0, n_out);
    # logits_ptr and grad_logits_ptr point at column col_start, of which n_real are real (< V).
    # The backward of the LM head + loss whose logits were returned too, for j < Vp:
    #     out[r, j] = grad_scale[r] * d loss_r / d z_rj  +  (grad_logits[r, j] if j < V else 0)
    #     d loss_r / d z_j = softmax_j - (1 - eps) [j == t] - eps / V   (0 on ignored rows, padding)
    # with softmax_j = exp(z_j - lse_r) from the forward's saved logits and lse: one read of the
    # logits here instead of a second forward pass that wrote the gradient for a later pass to add
    # the logits' own gradient to. fp32 arithmetic, one rounding.
    pid_m = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    rows = rows.to(tl.int64)
    offs = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    real = row_mask[:, None] & (offs < n_real)[None, :]
    out = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    if HAS_LOSS_GRAD:
        target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index)
        valid = row_mask & (target != ignore_index)
        mask = valid[:, None] & (offs < n_real)[None, :]
        lse = tl.load(lse_ptr + rows, mask=valid, other=0.0)
        scale = tl.load(grad_scale_ptr + rows * stride_grad_scale_row, mask=valid, other=0.0).to(tl.float32)
        z = tl.load(logits_ptr + rows[:, None] * stride_logits_row + offs[None, :], mask=mask,
                    other=float("-inf")).to(tl.float32)
        hit = (offs + col_start)[None, :] == target[:, None]
        grad = tl.exp(z - lse[:, None]) - tl.where(hit, 1.0 - label_smoothing, 0.0)
        if HAS_SMOOTHING:
            grad = grad - label_smoothing / n_vocab
        out += tl.where(mask, grad * scale[:, None], 0.0)
    if HAS_GRAD_LOGITS:
        out += tl.load(grad_logits_ptr + rows[:, None] * stride_grad_logits_row + offs[None, :], mask=real,
                       other=0.0).to(tl.float32)
    if BF16_RNE_BY_HAND:
        out = _round_to(out, out_ptr.dtype.element_ty, BF16_RNE_BY_HAND)
    store_mask = row_mask[:, None] & (offs < n_out)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out_row + offs[None, :], out.to(out_ptr.dtype.element_ty),
             mask=store_mask)


# ---------------------------------------------------------------------------------------------
# Launchers: check, allocate, pick the grid, launch.


def _device_guard(t: torch.Tensor):
    # Triton launches on the current device; make it the tensor's.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _check_runnable(t: torch.Tensor) -> None:
    if not t.is_cuda and not INTERPRET:
        raise RuntimeError(
            "transfuse cross_entropy kernels run on CUDA tensors (or anywhere under TRITON_INTERPRET=1); "
            f"the logits are on {t.device}"
        )


def _check_targets_on_host(target: torch.Tensor, n_cols: int, ignore_index: int) -> None:
    # Off the GPU the check costs no synchronisation, and the interpreter's device_assert would
    # otherwise report a bad target from inside a kernel with less context.
    if target.is_cuda or target.numel() == 0:
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= n_cols))
    if bool(bad.any()):
        value = target[bad][0].item()
        raise IndexError(f"transfuse cross_entropy: target {value} is out of [0, {n_cols}) and not ignore_index")


def cross_entropy_fwd_inplace_grad(
    logits: torch.Tensor,
    target: torch.Tensor,
    n_cols: int,
    ignore_index: int,
    label_smoothing: float,
    grad_scale: Optional[torch.Tensor],
    *,
    copy_to: Optional[torch.Tensor] = None,
    lse_out: Optional[torch.Tensor] = None,
    config: Optional[CrossEntropyConfig] = None,
) -> torch.Tensor:
    """Per-row cross-entropy of logits: (rows, Vp), columns [0, n_cols) real, [n_cols, Vp) padding;
    target: (rows,) int64. Returns the unreduced loss (rows,) in fp32 (0 on ignored rows).

    grad_scale None: logits are only read. Otherwise grad_scale is fp32, 0-dim (one scale for every
    row) or (rows,) (one per row), and the logits are overwritten with scale * d loss_row / d logits
    in their own dtype, padding columns and ignored rows included (zeros there).

    copy_to: (rows, n_cols) in the logits' dtype with a unit column stride, or None: receives the
    real columns of the logits (before they are overwritten), in the same pass that reads them.
    lse_out: (rows,) fp32 or None: receives each row's log-sum-exp over the real columns (0 on
    ignored rows), what cross_entropy_logits_grad needs to recompute the gradient."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError("transfuse cross_entropy: logits must be 2-D with a unit column stride")
    if logits.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"transfuse cross_entropy: logits must be float16, bfloat16 or float32, got {logits.dtype}")
    n_rows, n_cols_padded = logits.shape
    if target.shape != (n_rows,) or target.dtype != torch.int64:
        raise ValueError(f"transfuse cross_entropy: target must be int64 of shape ({n_rows},), "
                         f"got {target.dtype} {tuple(target.shape)}")
    if not 0 < n_cols <= n_cols_padded:
        raise ValueError(f"transfuse cross_entropy: n_cols={n_cols} must be in (0, {n_cols_padded}]")
    if grad_scale is not None and (grad_scale.dtype != torch.float32 or grad_scale.shape not in ((), (n_rows,))):
        raise ValueError("transfuse cross_entropy: grad_scale must be fp32, 0-dim or (rows,)")
    if copy_to is not None and (copy_to.shape != (n_rows, n_cols) or copy_to.dtype != logits.dtype
                                or copy_to.stride(-1) != 1 or copy_to.device != logits.device):
        raise ValueError(f"transfuse cross_entropy: copy_to must be ({n_rows}, {n_cols}) {logits.dtype} with a unit "
                         f"column stride on the logits' device")
    if lse_out is not None and (lse_out.shape != (n_rows,) or lse_out.dtype != torch.float32
                                or not lse_out.is_contiguous() or lse_out.device != logits.device):
        raise ValueError(f"transfuse cross_entropy: lse_out must be contiguous ({n_rows},) float32 on the logits' device")
    loss = torch.empty((n_rows,), dtype=torch.float32, device=logits.device)
    if n_rows == 0:
        return loss
    _check_runnable(logits)
    _check_targets_on_host(target, n_cols, ignore_index)
    target = target.contiguous()
    config = config or cross_entropy_config(n_rows, n_cols_padded)
    store_grad = grad_scale is not None
    if store_grad:
        grad_scale = grad_scale.contiguous()
        stride_grad_scale_row = 0 if grad_scale.dim() == 0 else 1
    else:
        grad_scale, stride_grad_scale_row = loss, 0  # a valid address, never read (STORE_GRAD=False)
    grid = (triton.cdiv(n_rows, config.ROWS_PER_PROGRAM),)
    with _device_guard(logits):
        _cross_entropy_fwd_kernel[grid](
            logits, logits.stride(0),
            target,
            loss,
            grad_scale, stride_grad_scale_row,
            logits if copy_to is None else copy_to, 0 if copy_to is None else copy_to.stride(0),
            loss if lse_out is None else lse_out,
            n_rows, n_cols, n_cols_padded, ignore_index, float(label_smoothing),
            BLOCK_V=config.BLOCK_V,
            ROWS_PER_PROGRAM=config.ROWS_PER_PROGRAM,
            HAS_SMOOTHING=label_smoothing != 0.0,
            STORE_GRAD=store_grad,
            COPY_LOGITS=copy_to is not None,
            STORE_LSE=lse_out is not None,
            BF16_RNE_BY_HAND=INTERPRET and logits.dtype == torch.bfloat16,
            num_warps=config.num_warps,
        )
    return loss


# ---------------------------------------------------------------------------------------------
# The chunked linear + cross-entropy around the kernel.


def check_linear_cross_entropy_args(x, weight, bias, target, ignore_index, label_smoothing, reduction,
                                    pad_vocab_to, chunk_rows) -> None:
    """Raise on arguments the fused op does not take (module docstring for the dtype rules)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"transfuse linear_cross_entropy: x must be (rows, H) and weight (V, H), got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"transfuse linear_cross_entropy: x must be float16, bfloat16 or float32, got {x.dtype}")
    for name, param in (("weight", weight), ("bias", bias)):
        if param is None:
            continue
        if param.dtype not in (x.dtype, torch.float32):
            raise TypeError(
                f"transfuse linear_cross_entropy: {name} must be x's dtype ({x.dtype}) or float32, got "
                f"{param.dtype}; cast x to the compute dtype first, as torch.autocast would")
        if param.device != x.device:
            raise ValueError(f"transfuse linear_cross_entropy: {name} is on {param.device}, x on {x.device}")
    if weight.shape[0] == 0:
        raise ValueError("transfuse linear_cross_entropy: the vocabulary is empty")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"transfuse linear_cross_entropy: bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    if target.shape != (x.shape[0],) or target.dtype != torch.int64 or target.device != x.device:
        raise ValueError(f"transfuse linear_cross_entropy: target must be int64 of shape ({x.shape[0]},) on "
                         f"x's device, got {target.dtype} {tuple(target.shape)} on {target.device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"transfuse linear_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"transfuse linear_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    if pad_vocab_to < 0 or chunk_rows < 0:
        raise ValueError("transfuse linear_cross_entropy: pad_vocab_to and chunk_rows must be >= 0 (0: off / auto)")


def padded_vocab(n_vocab: int, pad_vocab_to: int) -> int:
    return n_vocab if pad_vocab_to <= 1 else math.ceil(n_vocab / pad_vocab_to) * pad_vocab_to


def default_chunk_rows(n_rows: int, n_cols_padded: int, element_size: int,
                       chunk_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """Rows per chunk so that one chunk's logits take at most chunk_bytes, rounded down to a
    multiple of 128 when that many fit (full GEMM tiles along M), never more than there are rows."""
    rows = max(chunk_bytes // (n_cols_padded * element_size), 1)
    if rows >= 128:
        rows -= rows % 128
    return max(min(rows, n_rows), 1)


def _compute_params(weight, bias, dtype, n_cols_padded):
    """weight (and bias) in the compute dtype, zero-padded to n_cols_padded rows: a new tensor when
    a cast or padding is needed, the caller's own otherwise (which is then only read)."""
    n_vocab = weight.shape[0]
    if n_cols_padded == n_vocab:
        weight = weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        return weight, bias
    weight_padded = weight.new_zeros((n_cols_padded, weight.shape[1]), dtype=dtype)
    weight_padded[:n_vocab].copy_(weight)
    bias_padded = None
    if bias is not None:
        bias_padded = bias.new_zeros((n_cols_padded,), dtype=dtype)
        bias_padded[:n_vocab].copy_(bias)
    return weight_padded, bias_padded


def _add_mm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b with products accumulated in fp32 even for half-precision a and b.

    On CUDA, torch.mm(..., out_dtype=float32) keeps cuBLAS's fp32 accumulator instead of rounding a
    chunk's partial gradient to half precision before it is summed over chunks. Elsewhere (the CPU
    interpreter tests, a torch without out_dtype) the operands are widened, which is the same
    arithmetic (a product of two fp16/bf16 numbers is exact in fp32) unless TF32 matmuls are allowed."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif a.is_cuda and hasattr(torch.ops.aten.mm, "dtype"):
        acc.add_(torch.mm(a, b, out_dtype=torch.float32))
    else:
        acc.addmm_(a.float(), b.float())


def linear_cross_entropy_chunked(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    pad_vocab_to: int,
    chunk_rows: int,
    grad_scale: Optional[torch.Tensor],
    needs_grad_x: bool,
    needs_grad_weight: bool,
    needs_grad_bias: bool,
    *,
    config: Optional[CrossEntropyConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk loop shared by the forward and the recomputing backward.

    Returns (loss_rows (rows,) fp32, grad_x, grad_weight, grad_bias). With grad_scale None no
    gradient is computed and the three are empty (0,) tensors; otherwise the gradient of
    sum_rows(grad_scale[row] * loss_row) (grad_scale 0-dim or (rows,), fp32) for each input whose
    needs_grad_* is set, in that input's dtype and shape, and empty (0,) tensors for the others."""
    n_rows, hidden = x.shape
    n_vocab = weight.shape[0]
    dtype = x.dtype
    n_cols_padded = padded_vocab(n_vocab, pad_vocab_to)
    store_grad = grad_scale is not None
    needs_grad_x = needs_grad_x and store_grad
    needs_grad_weight = needs_grad_weight and store_grad
    needs_grad_bias = needs_grad_bias and store_grad and bias is not None

    def empty():  # a new one for each output: outputs of an op may not alias one another
        return x.new_empty((0,))

    loss = torch.empty((n_rows,), dtype=torch.float32, device=x.device)
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format) if needs_grad_x else empty()
    # fp32 accumulators over the chunks, cast to the parameters' dtypes at the end
    grad_weight_acc = (torch.zeros((n_cols_padded, hidden), dtype=torch.float32, device=x.device)
                       if needs_grad_weight else None)
    grad_bias_acc = torch.zeros((n_cols_padded,), dtype=torch.float32, device=x.device) if needs_grad_bias else None

    if n_rows > 0:
        weight_c, bias_c = _compute_params(weight, bias, dtype, n_cols_padded)
        chunk = chunk_rows or default_chunk_rows(n_rows, n_cols_padded, x.element_size())
        chunk = min(chunk, n_rows)
        # One buffer for every chunk's logits, then their gradient: the peak is one chunk.
        logits_buffer = torch.empty((chunk, n_cols_padded), dtype=dtype, device=x.device)
        for start in range(0, n_rows, chunk):
            end = min(start + chunk, n_rows)
            x_chunk = x[start:end]
            logits = logits_buffer[: end - start]
            if bias_c is None:
                torch.mm(x_chunk, weight_c.t(), out=logits)
            else:
                torch.addmm(bias_c, x_chunk, weight_c.t(), out=logits)
            scale = None
            if store_grad:
                scale = grad_scale if grad_scale.dim() == 0 else grad_scale[start:end]
            loss[start:end] = cross_entropy_fwd_inplace_grad(
                logits, target[start:end], n_vocab, ignore_index, label_smoothing, scale, config=config)
            if not store_grad:
                continue
            grad_logits = logits  # overwritten in place by the kernel
            if needs_grad_x:
                torch.mm(grad_logits, weight_c, out=grad_x[start:end])
            if needs_grad_weight:
                _add_mm_fp32(grad_weight_acc, grad_logits.t(), x_chunk)
            if needs_grad_bias:
                grad_bias_acc.add_(grad_logits.sum(0, dtype=torch.float32))

    grad_weight = grad_weight_acc[:n_vocab].to(weight.dtype) if needs_grad_weight else empty()
    grad_bias = grad_bias_acc[:n_vocab].to(bias.dtype) if needs_grad_bias else empty()
    return loss, grad_x, grad_weight, grad_bias


def count_valid(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """The rows whose target is not ignore_index, as an fp32 device scalar (the mean's denominator)."""
    # A device tensor, not a Python int: counting must not synchronise with the GPU.
    return (target != ignore_index).sum(dtype=torch.float32)


def forward_grad_scale(reduction: str, n_valid: torch.Tensor) -> torch.Tensor:
    """The fp32 scale of d loss_row / d logits for a grad_output of 1: 1/n_valid for 'mean' (clamped,
    so that zero valid rows, whose gradients are all zero, give 0 rather than inf), else 1."""
    if reduction == "mean":
        return 1.0 / n_valid.clamp(min=1.0)
    return torch.ones((), dtype=torch.float32, device=n_valid.device)


def reduce_loss_rows(loss_rows: torch.Tensor, reduction: str, n_valid: Optional[torch.Tensor]) -> torch.Tensor:
    """torch's reduction of per-row losses; 'mean' divides by n_valid (count_valid: 0 / 0 = NaN when
    every row is ignored, as torch gives), which the other reductions do not read."""
    if reduction == "mean":
        return loss_rows.sum() / n_valid
    if reduction == "sum":
        return loss_rows.sum()
    return loss_rows


def linear_cross_entropy_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    pad_vocab_to: int = 0,
    chunk_rows: int = 0,
    needs_grad_x: bool = False,
    needs_grad_weight: bool = False,
    needs_grad_bias: bool = False,
    *,
    config: Optional[CrossEntropyConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """F.cross_entropy(F.linear(x, weight, bias).float(), target, ignore_index=, label_smoothing=,
    reduction=) with x: (rows, H), weight: (V, H), bias: (V,) or None, target: (rows,) int64.

    Returns (loss, grad_x, grad_weight, grad_bias): loss fp32, 0-dim for 'mean'/'sum' ('mean' over
    zero valid rows is NaN, as in torch), (rows,) for 'none'; each grad_* is d loss / d input for a
    grad_output of 1, computed in this same pass when needs_grad_* is set, else an empty (0,) tensor.
    Gradients need a scalar loss, so reduction='none' takes no needs_grad_* (see
    linear_cross_entropy_bwd). chunk_rows=0 sizes chunks by LOGITS_CHUNK_BYTES."""
    check_linear_cross_entropy_args(x, weight, bias, target, ignore_index, label_smoothing, reduction,
                                    pad_vocab_to, chunk_rows)
    wants_grad = needs_grad_x or needs_grad_weight or (needs_grad_bias and bias is not None)
    if wants_grad and reduction == "none":
        raise ValueError("transfuse linear_cross_entropy: gradients in the forward pass need reduction "
                         "'mean' or 'sum'; for 'none' use linear_cross_entropy_bwd with the grad_output")
    n_valid = count_valid(target, ignore_index)
    grad_scale = forward_grad_scale(reduction, n_valid) if wants_grad else None
    loss_rows, grad_x, grad_weight, grad_bias = linear_cross_entropy_chunked(
        x, weight, bias, target, ignore_index, label_smoothing, pad_vocab_to, chunk_rows, grad_scale,
        needs_grad_x, needs_grad_weight, needs_grad_bias, config=config)
    return reduce_loss_rows(loss_rows, reduction, n_valid), grad_x, grad_weight, grad_bias


def linear_cross_entropy_bwd(
    grad_output: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    pad_vocab_to: int = 0,
    chunk_rows: int = 0,
    needs_grad_x: bool = True,
    needs_grad_weight: bool = True,
    needs_grad_bias: bool = True,
    *,
    config: Optional[CrossEntropyConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of linear_cross_entropy_fwd's loss for any reduction, recomputing the logits
    chunk by chunk (one GEMM more than computing them in the forward pass, nothing held in between).
    grad_output: 0-dim for 'mean'/'sum', (rows,) for 'none'. Returns (grad_x, grad_weight,
    grad_bias), an empty (0,) tensor for each one not asked for."""
    check_linear_cross_entropy_args(x, weight, bias, target, ignore_index, label_smoothing, reduction,
                                    pad_vocab_to, chunk_rows)
    expected = (x.shape[0],) if reduction == "none" else ()
    if grad_output.shape != expected:
        raise ValueError(f"transfuse linear_cross_entropy: grad_output must have shape {expected} for "
                         f"reduction {reduction!r}, got {tuple(grad_output.shape)}")
    grad_scale = grad_output.float()
    if reduction == "mean":
        grad_scale = grad_scale / count_valid(target, ignore_index).clamp(min=1.0)
    _, grad_x, grad_weight, grad_bias = linear_cross_entropy_chunked(
        x, weight, bias, target, ignore_index, label_smoothing, pad_vocab_to, chunk_rows, grad_scale,
        needs_grad_x, needs_grad_weight, needs_grad_bias, config=config)
    return grad_x, grad_weight, grad_bias


# ---------------------------------------------------------------------------------------------
# The LM head + loss of a model that also returns its logits (nanoGPT: `return logits, loss`).


def cross_entropy_logits_grad(
    logits: torch.Tensor,
    lse: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    grad_scale: Optional[torch.Tensor],
    grad_logits: Optional[torch.Tensor],
    n_cols_padded: int,
    col_start: int = 0,
    col_end: Optional[int] = None,
) -> torch.Tensor:
    """out: (rows, Vp) in the logits' dtype = grad_scale[row] * d loss_row / d logits, recomputed from
    the logits (rows, V) and the forward's lse (rows,) fp32, plus grad_logits (rows, V); zero in the
    columns [V, Vp) that the backward's padded GEMMs read. grad_scale: fp32, 0-dim or (rows,); None
    leaves the loss's term out (the loss got no gradient). grad_logits None: the logits got none.
    col_start / col_end: only those columns of it, (rows, col_end - col_start); col_start < V."""
    n_rows, n_cols = logits.shape
    dtype = logits.dtype
    col_end = n_cols_padded if col_end is None else col_end
    n_out = col_end - col_start
    out = torch.empty((n_rows, n_out), dtype=dtype, device=logits.device)
    if n_rows == 0 or n_out == 0:
        return out
    _check_runnable(out)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if grad_logits is not None and grad_logits.stride(-1) != 1:
        grad_logits = grad_logits.contiguous()
    if col_start:  # the kernel reads from column col_start on: a view that starts there
        logits = logits[:, col_start:]
        grad_logits = None if grad_logits is None else grad_logits[:, col_start:]
    n_real = min(n_cols, col_end) - col_start
    if grad_scale is not None:
        grad_scale = grad_scale.float().contiguous()
        stride_grad_scale_row = 0 if grad_scale.dim() == 0 else 1
    else:
        stride_grad_scale_row = 0
    block_m, block_v, num_warps = logits_grad_config(n_rows, n_out)
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n_out, block_v))
    with _device_guard(out):
        _cross_entropy_logits_grad_kernel[grid](
            logits, logits.stride(0),
            lse,
            target.contiguous(),
            out if grad_scale is None else grad_scale, stride_grad_scale_row,  # never read without a scale
            out if grad_logits is None else grad_logits, 0 if grad_logits is None else grad_logits.stride(0),
            out, out.stride(0),
            n_rows, n_cols, n_real, n_out, col_start, ignore_index, float(label_smoothing),
            BLOCK_M=block_m,
            BLOCK_V=block_v,
            HAS_LOSS_GRAD=grad_scale is not None,
            HAS_GRAD_LOGITS=grad_logits is not None,
            HAS_SMOOTHING=label_smoothing != 0.0,
            BF16_RNE_BY_HAND=INTERPRET and dtype == torch.bfloat16,
            num_warps=num_warps,
        )
    return out


def linear_logits_cross_entropy_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    pad_vocab_to: int,
    needs_grad: bool,
    *,
    chunk_rows: int = 0,
    config: Optional[CrossEntropyConfig] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, loss, lse) for the LM head F.linear(x, weight, bias) and its loss, when the logits are
    returned too. x: (rows, H) in the compute dtype; weight, bias as for linear_cross_entropy_fwd.
    Per call, for rows x V logits (Vp = V padded to pad_vocab_to):

      1. one GEMM into a (rows, Vp) buffer (padded: cuBLAS's fast tiles);
      2. one kernel pass over it that writes the contiguous (rows, V) logits (the copy the user gets),
         the per-row loss and, when needs_grad, the per-row log-sum-exp. The backward recomputes the
         gradient from the returned logits and lse (linear_logits_cross_entropy_bwd), adding the
         logits' own gradient in the same pass.

    Both steps go chunk_rows rows at a time (0: LOGITS_CHUNK_BYTES of padded logits a chunk) through
    one reused buffer: next to the returned logits, the padded ones never exist whole (GPT-2 at
    8 x 1024 tokens: 0.26 GB instead of 0.82 at the forward's end, where training peaks).

    logits: (rows, V) x.dtype, contiguous; loss fp32, 0-dim ('mean', 'sum') or (rows,) ('none');
    lse: (rows,) fp32, or an empty (0,) tensor without needs_grad."""
    check_linear_cross_entropy_args(x, weight, bias, target, ignore_index, label_smoothing, reduction,
                                    pad_vocab_to, chunk_rows)
    n_rows, n_vocab = x.shape[0], weight.shape[0]
    n_cols_padded = padded_vocab(n_vocab, pad_vocab_to)
    weight_c, bias_c = _compute_params(weight, bias, x.dtype, n_cols_padded)
    logits = torch.empty((n_rows, n_vocab), dtype=x.dtype, device=x.device)
    lse = torch.empty((n_rows,), dtype=torch.float32, device=x.device) if needs_grad else None
    loss_rows = torch.empty((n_rows,), dtype=torch.float32, device=x.device)
    n_valid = count_valid(target, ignore_index)
    chunk = min(chunk_rows or default_chunk_rows(n_rows, n_cols_padded, x.element_size()), max(n_rows, 1))
    buffer = torch.empty((chunk, n_cols_padded), dtype=x.dtype, device=x.device) if n_rows else None
    for start in range(0, n_rows, chunk):
        end = min(start + chunk, n_rows)
        padded = buffer[: end - start]
        if bias_c is None:
            torch.mm(x[start:end], weight_c.t(), out=padded)
        else:
            torch.addmm(bias_c, x[start:end], weight_c.t(), out=padded)
        loss_rows[start:end] = cross_entropy_fwd_inplace_grad(
            padded, target[start:end], n_vocab, ignore_index, label_smoothing, None, copy_to=logits[start:end],
            lse_out=None if lse is None else lse[start:end], config=config)
    return logits, reduce_loss_rows(loss_rows, reduction, n_valid), lse if needs_grad else x.new_empty((0,))


def logits_grad_scale(grad_loss: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """The fp32 factor of each row's d loss_row / d logits for the loss's grad_output: divided by the
    valid rows for 'mean' (none valid: every row's gradient is zero anyway), per row for 'none'."""
    scale = grad_loss.float()
    if reduction == "mean":
        scale = scale / count_valid(target, ignore_index).clamp(min=1.0)
    return scale


def linear_logits_cross_entropy_bwd(
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
    *,
    chunk_cols: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight, grad_bias) of linear_logits_cross_entropy_fwd's outputs, for grad_loss
    (0-dim, or (rows,) for 'none'; None: the loss got no gradient) and grad_logits ((rows, V); None:
    the logits got none), from the returned logits (rows, V) and the saved lse. An empty (0,) tensor
    for each gradient not asked for.

    One elementwise pass (cross_entropy_logits_grad) forms the (rows, Vp) gradient w.r.t. the padded
    logits, the loss's term and the logits' own together, then the GEMMs read it:
    grad_x = total @ W_p, grad_weight = (total^T @ x)[:V], grad_bias = total.sum(0)[:V].

    By column chunks of chunk_cols (0: LOGITS_CHUNK_BYTES of gradient a chunk, a multiple of 128):
    each chunk's grad_weight and grad_bias rows are its own, and grad_x sums the chunks' products in
    fp32, rounded once. The gradient never exists whole next to the returned logits."""
    n_vocab = weight.shape[0]
    n_cols_padded = padded_vocab(n_vocab, pad_vocab_to)
    needs_grad_bias = needs_grad_bias and bias is not None
    n_rows = x.shape[0]

    def empty():
        return x.new_empty((0,))

    if (grad_loss is None and grad_logits is None) or not (needs_grad_x or needs_grad_weight or needs_grad_bias):
        return (x.new_zeros(x.shape) if needs_grad_x else empty(),
                weight.new_zeros(weight.shape) if needs_grad_weight else empty(),
                bias.new_zeros(bias.shape) if needs_grad_bias else empty())
    scale = None if grad_loss is None else logits_grad_scale(grad_loss, target, ignore_index, reduction)
    # default_chunk_rows with rows and columns swapped: as many columns as fit, a multiple of 128
    chunk = chunk_cols or default_chunk_rows(n_cols_padded, max(n_rows, 1), x.element_size())
    bounds = [(start, min(start + chunk, n_cols_padded)) for start in range(0, n_cols_padded, chunk)]
    weight_c = _compute_params(weight, None, x.dtype, n_cols_padded)[0] if needs_grad_x else None
    grad_x_acc = (torch.zeros(x.shape, dtype=torch.float32, device=x.device)
                  if needs_grad_x and len(bounds) > 1 else None)
    grad_x = None
    grad_weight = torch.empty_like(weight) if needs_grad_weight else None
    grad_bias = torch.empty_like(bias) if needs_grad_bias else None
    for start, end in bounds:
        total = cross_entropy_logits_grad(logits, lse, target, ignore_index, label_smoothing, scale, grad_logits,
                                          n_cols_padded, start, end)
        real = min(end, n_vocab) - start  # columns [V, Vp) are the padding's zero gradient: dropped
        if grad_x_acc is not None:
            _add_mm_fp32(grad_x_acc, total, weight_c[start:end])
        elif needs_grad_x:
            grad_x = torch.mm(total, weight_c).to(x.dtype)
        if needs_grad_weight:
            grad_weight[start:start + real] = torch.mm(total.t(), x)[:real]
        if needs_grad_bias:
            grad_bias[start:start + real] = total.sum(0, dtype=torch.float32)[:real]
    if grad_x_acc is not None:
        grad_x = grad_x_acc.to(x.dtype)
    return (grad_x if needs_grad_x else empty(), grad_weight if needs_grad_weight else empty(),
            grad_bias if needs_grad_bias else empty())
