"""A norm and the linear that reads it, in one launch, for a few rows (3-32: the decode steps of a
batch) on tensor cores:

    s = x + residual (rounded to x's dtype), or s = x
    out = act(norm(s) @ weight.T + bias)           norm: rms_norm or layer_norm, as transfuse's norm ops

Semantics and flags are kernels.gemv.norm_gemv_fwd's (NormPrologue; the sum s and, with `normed`, the
normalised rows are also stored), the linear's are gemm_few_rows's: fp32 products and sums, the
epilogue on fp32, one rounding at the store.

Why: in a batched decode step every norm is a launch of its own that costs about as much as a small
linear (Llama-1.1B at batch 8 on an H200: 2.0 us, twice a layer, plus the gap between kernels), for
2 x 8 x 2048 values. The norm-GEMV (kernels/gemv.py) folds it into its linear for 1-2 rows; from
3 rows the linear runs on tensor cores (kernels/gemm_few_rows.py), and this is that kernel with the
norm folded in the same way.

Program pid owns output columns [pid * BLOCK_N, +BLOCK_N) for all rows, as gemm_few_rows's unsplit
launch (the swap-AB product: weight rows are the MMA's M side). Before its main loop it reads its
rows of s once to get their statistics (x and the residual are a few KB, from L2); the main loop
reads them again, K step by K step, normalises each (BLOCK_K, rows) slice as the norm kernels do
(fp32, the rounding to x's dtype where they round) and feeds it to the dot. Every program computes
the same normalised values; the program of the first column block stores s and the normalised rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transfuse.kernels._config import INTERPRET, next_power_of_2, pdl, wait_for_previous_kernel
from transfuse.kernels.gemm import (_WIDEN_DOT_OPERANDS, EpilogueOperands, _dot_precision, _linear_epilogue,
                                    check_linear_args)
from transfuse.kernels.gemm_few_rows import FEW_ROWS_MAX, default_config, few_rows_applies
from transfuse.kernels.gemv import norm_rows
from transfuse.kernels.norm import _round_to
from transfuse.kernels.norm_prologue import NormPrologue, launch_args

# K elements a step of the statistics pass reads: a Llama-1.1B or GPT-2 row in one step (one wait
# for L2 instead of several), (STATS_K x 16 rows) fp32 values over the launch's warps.
_STATS_K = 2048
_INTERPRET_STATS_K = 16


@triton.jit
def _summed_slice(x_ptr, stride_x_m, nres_ptr, stride_nres_m, rows, offs_k, mask_k,
                  NORM_RESIDUAL: tl.constexpr, BF16_RNE_BY_HAND: tl.constexpr):
    """s = x [+ residual], rounded to x's dtype, for (len(offs_k), BLOCK_M) of the rows, K-major (the
    dot's B operand), as fp32; zero past K."""
    s = tl.load(x_ptr + rows[None, :] * stride_x_m + offs_k[:, None], mask=mask_k[:, None], other=0.0).to(tl.float32)
    if NORM_RESIDUAL:
        r = tl.load(nres_ptr + rows[None, :] * stride_nres_m + offs_k[:, None], mask=mask_k[:, None], other=0.0)
        s = _round_to(s + r.to(tl.float32), x_ptr.dtype.element_ty, BF16_RNE_BY_HAND).to(tl.float32)
    return s


# M unspecialised: a new row count must not compile another kernel.
@triton.jit(do_not_specialize=["M"])
def _norm_few_rows_fwd_kernel(
    x_ptr, stride_x_m,
    w_ptr, stride_w_n, stride_w_k,
    bias_ptr, stride_bias,
    res_ptr, stride_res_m, stride_res_n,  # the epilogue's residual: never read (HAS_RESIDUAL is False)
    out_ptr, stride_out_m,
    nres_ptr, stride_nres_m,  # the norm's residual (NORM_RESIDUAL)
    nw_ptr, nb_ptr,  # its weight (NORM_WEIGHT) and bias (NORM_BIAS)
    sum_ptr, stride_sum_m,  # where s is stored (NORM_RESIDUAL)
    normed_ptr, stride_normed_m,  # where the normalised rows are stored (STORE_NORMED)
    eps, weight_offset,
    M, N, K,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,  # K is whole BLOCK_K steps: no K masks in the main loop
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # 16 or 32: x's rows, padded (rows past M re-read row m % M, never stored)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STATS_K: tl.constexpr,
    NORM: tl.constexpr = True,  # launch_args' flags; always a norm here
    NORM_RESIDUAL: tl.constexpr = False,
    NORM_WEIGHT: tl.constexpr = False,
    NORM_BIAS: tl.constexpr = False,
    LAYER_NORM: tl.constexpr = False,
    CAST_BEFORE_WEIGHT: tl.constexpr = False,
    STORE_NORMED: tl.constexpr = False,
    BF16_RNE_BY_HAND: tl.constexpr = False,
    PDL: tl.constexpr = 0,
):
    GATED: tl.constexpr = ACTIVATION == "silu_mul"
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    stores = ((offs_m < M) & (pid_n == 0))[None, :]
    wait_for_previous_kernel(PDL)

    # The rows' statistics, as kernels.norm's: the mean first for a LayerNorm, then the mean square
    # of the (centred) values.
    offs_s = tl.arange(0, STATS_K)
    mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if LAYER_NORM:
        total = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k in range(0, K, STATS_K):
            mask_s = k + offs_s < K
            total += tl.sum(_summed_slice(x_ptr, stride_x_m, nres_ptr, stride_nres_m, rows, k + offs_s, mask_s,
                                          NORM_RESIDUAL, BF16_RNE_BY_HAND), axis=0)
        mean = total / K
    squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, K, STATS_K):
        mask_s = k + offs_s < K
        s = _summed_slice(x_ptr, stride_x_m, nres_ptr, stride_nres_m, rows, k + offs_s, mask_s,
                          NORM_RESIDUAL, BF16_RNE_BY_HAND)
        if LAYER_NORM:
            s = tl.where(mask_s[:, None], s - mean[None, :], 0.0)
        squares += tl.sum(s * s, axis=0)
    rstd = tl.math.rsqrt(squares / K + eps)

    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[:, None] * stride_w_n + offs_k[None, :] * stride_w_k
    w_up_ptrs = w_ptr + (cols + N)[:, None] * stride_w_n + offs_k[None, :] * stride_w_k
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = acc
    # s of the next K step is loaded one step ahead, by hand: the compiler's pipelining streams only
    # the loads that feed the dot as they are (the weight's), and each step's normalisation would
    # otherwise wait for its own load from L2.
    s_next = _summed_slice(x_ptr, stride_x_m, nres_ptr, stride_nres_m, rows, offs_k, offs_k < K,
                           NORM_RESIDUAL, BF16_RNE_BY_HAND)
    for k in range(0, K, BLOCK_K):
        mask_k = k + offs_k < K
        s = s_next
        mask_next = k + BLOCK_K + offs_k < K
        s_next = _summed_slice(x_ptr, stride_x_m, nres_ptr, stride_nres_m, rows, k + BLOCK_K + offs_k, mask_next,
                               NORM_RESIDUAL, BF16_RNE_BY_HAND)
        if NORM_RESIDUAL:
            tl.store(sum_ptr + rows[None, :] * stride_sum_m + (k + offs_k)[:, None], s.to(DTYPE),
                     mask=mask_k[:, None] & stores)
        if LAYER_NORM:
            s = s - mean[None, :]
        y = s * rstd[None, :]
        if NORM_WEIGHT:
            if CAST_BEFORE_WEIGHT:
                y = _round_to(y, DTYPE, BF16_RNE_BY_HAND).to(tl.float32)
            g = tl.load(nw_ptr + k + offs_k, mask=mask_k, other=0.0).to(tl.float32) + weight_offset
            y = y * g[:, None]
        if NORM_BIAS:
            y = y + tl.load(nb_ptr + k + offs_k, mask=mask_k, other=0.0).to(tl.float32)[:, None]
        yt = _round_to(y, DTYPE, BF16_RNE_BY_HAND)
        if STORE_NORMED:
            tl.store(normed_ptr + rows[None, :] * stride_normed_m + (k + offs_k)[:, None], yt,
                     mask=mask_k[:, None] & stores)
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=mask_k[None, :], other=0.0)
        if _WIDEN_DOT_OPERANDS:
            yt = yt.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(w, yt, acc, input_precision=DOT_PRECISION)
        if GATED:
            if EVEN_K:
                w_up = tl.load(w_up_ptrs)
            else:
                w_up = tl.load(w_up_ptrs, mask=mask_k[None, :], other=0.0)
            if _WIDEN_DOT_OPERANDS:
                w_up = w_up.to(tl.float32)
            acc_up = tl.dot(w_up, yt, acc_up, input_precision=DOT_PRECISION)
            w_up_ptrs += BLOCK_K * stride_w_k
        w_ptrs += BLOCK_K * stride_w_k

    acc = tl.trans(acc)
    acc_up = tl.trans(acc_up) if GATED else acc
    _linear_epilogue(acc, acc_up, offs_m, offs_n, M, N, bias_ptr, stride_bias, res_ptr, stride_res_m, stride_res_n,
                     out_ptr, stride_out_m, ACTIVATION, HAS_BIAS, HAS_RESIDUAL)


def norm_few_rows_applies(x: torch.Tensor, weight: torch.Tensor, norm: NormPrologue) -> bool:
    """Whether norm_few_rows_fwd takes this: gemm_few_rows's x and weight (1-32 rows of fp16 or
    bf16), the norm's residual, weight and bias of x's dtype and device and of x's (resp. (K,)) shape."""
    same = [t for t in (norm.residual, norm.weight, norm.bias) if t is not None]
    return (few_rows_applies(x, weight)
            and all(t.dtype == x.dtype and t.device == x.device for t in same)
            and (norm.residual is None or norm.residual.shape == x.shape)
            and all(t.shape == (x.shape[-1],) for t in (norm.weight, norm.bias) if t is not None))


def norm_few_rows_fwd(
    x: torch.Tensor,
    norm: NormPrologue,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    normed: torch.Tensor | None = None,
    config: tuple[int, int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(norm(s) @ weight.T + bias), s), as kernels.gemv.norm_gemv_fwd for 1-32 rows of fp16 or
    bf16 (see the module docstring). `normed`, a contiguous tensor of x's shape and dtype, also
    receives the normalised rows. `config` is gemm_few_rows's (BLOCK_N, BLOCK_K, 1, num_stages,
    num_warps), its default by default."""
    if not norm_few_rows_applies(x, weight, norm):
        raise ValueError(f"norm_few_rows_fwd takes 1..{FEW_ROWS_MAX} rows of fp16 or bf16 with a norm of their "
                         f"dtype, got {tuple(x.shape)} {x.dtype}: use the norm op and transfuse.linear")
    N = check_linear_args(x, weight, bias, activation, None)
    K = x.shape[-1]
    lead = x.shape[:-1]
    x2, res2 = norm_rows(x, norm)
    M = x2.shape[0]
    if normed is not None and (normed.shape != x.shape or normed.dtype != x.dtype or normed.device != x.device
                               or not normed.is_contiguous()):
        raise ValueError(f"norm_few_rows_fwd: normed must be a contiguous {tuple(x.shape)} {x.dtype} tensor on "
                         f"{x.device}, got {tuple(normed.shape)} {normed.dtype}: allocate it with torch.empty(x.shape, ...)")
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    summed = torch.empty((M, K) if res2 is not None else (0,), device=x.device, dtype=x.dtype)
    summed_out = summed.view(*lead, K) if res2 is not None else summed
    if N == 0:
        return out.view(*lead, N), summed_out
    norm_args, norm_flags = launch_args(norm._replace(residual=res2), x2, summed,
                                        normed.view(M, K) if normed is not None else None)
    gated = activation == "silu_mul"
    block_n, block_k, _, num_stages, num_warps = config if config is not None else default_config(gated)
    if config is None and not INTERPRET:
        num_warps = max(num_warps, 8)  # the statistics pass holds a whole row of each of 16 rows
    epilogue = EpilogueOperands(out, bias, None, activation, 1)
    block_m = 16 if M <= 16 else FEW_ROWS_MAX
    _norm_few_rows_fwd_kernel[(triton.cdiv(N, block_n),)](
        x2, x2.stride(0),
        weight, weight.stride(0), weight.stride(1),
        *epilogue.args,
        *norm_args,
        M, N, K,
        **epilogue.flags,
        EVEN_K=K % block_k == 0,
        DOT_PRECISION=_dot_precision(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        STATS_K=_INTERPRET_STATS_K if INTERPRET else min(_STATS_K * 16 // block_m, next_power_of_2(K)),
        **norm_flags, BF16_RNE_BY_HAND=INTERPRET and x.dtype == torch.bfloat16,
        num_stages=num_stages, num_warps=num_warps, **pdl(x2),
    )
    return out.view(*lead, N), summed_out
