"""Weight-streaming GEMV for weights stored (K, N): gemv.py's decode linear for x @ W layouts.

    out = act(norm(x) @ weight.T + bias) + residual

    x:        (M, K)  M <= 16 rows, unit stride along K, any row stride
    weight:   (N, K)  a view with unit stride along N: the transpose of a contiguous (K, N) matrix,
              as GPT-2's Conv1D stores its weights (the Conv1D pass makes them F.linear(x, W.t()))
    the rest as gemv.gemv_fwd (bias, residual, activations incl. the gated ones, the split-K partials)

Why a second GEMV: gemv.py's kernel streams weight rows along K, 16 bytes a thread; on this layout
those loads would be 2-byte gathers N elements apart. Here a program owns BLOCK_N adjacent output
columns and walks K: each (BLOCK_K, BLOCK_N) tile is BLOCK_K row segments of BLOCK_N contiguous
elements, each thread loading 16 bytes of a segment and accumulating its products in registers; the
sum over the tile's K axis (across lanes and warps) runs once, after the loop. Measured before this kernel (H100, fp16, 1 row, in a CUDA graph,
bench/kernels/bench_gemv_kmajor.py): cuBLAS on the (K, N) layout took 4.7 / 4.1 / 5.0 / 7.7 us on
GPT-2's four linears where gemv.py's kernel on an (N, K) copy took 3.2 / 2.3 / 3.7 / 4.1 us; this
kernel's best configs take 4.2 / 3.2 / 4.4 / 5.6 us (the weight tile's sum over K crosses warps;
gemv.py's crosses only lanes). A first version that loaded x before the weight and summed over K
every step took 4.6 / 3.0 / 4.8 / 6.4 at its best.

Norm prologue (NORM, the same NormPrologue as gemv.norm_gemv_fwd: RMSNorm or LayerNorm, with the
residual add before it): every program first loads its rows whole (K <= gemv.NORM_K_MAX, so the
statistics are a register reduction, as in kernels/norm.py), then normalises each K step's chunk
before multiplying, rounded to x's dtype where the unfused norm kernel rounds its output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from transfuse.kernels._config import INTERPRET, next_power_of_2, pdl, wait_for_previous_kernel
from transfuse.kernels.gemm import EpilogueOperands, _finish_tile
from transfuse.kernels.norm import _round_to
from transfuse.kernels.norm_prologue import launch_args

_REDUCE_BLOCK_N = 256


class KMajorConfig(NamedTuple):
    """Output columns per program, K rows per step, programs per column block along K, warps."""
    block_n: int
    block_k: int
    split_k: int
    num_warps: int


# Under the interpreter: small blocks so that tiny test shapes cross block edges in N and K.
_INTERPRET_CONFIG = KMajorConfig(16, 16, 1, 4)


def kmajor_layout(weight: torch.Tensor) -> bool:
    """Whether `weight` (N, K) has unit stride along N (and not along K): this kernel's layout."""
    return weight.dim() == 2 and weight.stride(0) == 1 and weight.stride(1) != 1 and weight.shape[0] > 1


def default_config(m: int, n: int, k: int, num_sms: int) -> KMajorConfig:
    """16 columns (two 16-byte loads of one 32-byte sector per row) by 256 rows a step for one
    row (128 for more: the accumulators grow with the rows), 4 warps, so each thread holds 4 (2)
    row segments; split along K while the column blocks give fewer programs than SMs and every
    split keeps at least four steps. Fitted on GPT-2's and GPT-2-XL's shapes at 1 row (H100,
    bench/kernels/bench_gemv_kmajor.py --sweep): this is the sweep's best config for c_attn, c_fc and
    GPT-2-XL's c_fc, within 1% of it for the MLP's c_proj (split 4); for the 768x768 attention
    c_proj the sweep's best was 512-row steps with 8 warps (3.2 us), and this config's time there
    was not among the three it logged."""
    if INTERPRET:
        return _INTERPRET_CONFIG
    block_n, num_warps = 16, 4
    block_k = min(256 if m <= 1 else 128, max(next_power_of_2(k), 16))
    programs, steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    split_k = 1
    while split_k < 8 and programs * split_k < num_sms and steps >= 4 * split_k:
        split_k *= 2
    return KMajorConfig(block_n, block_k, split_k, num_warps)


@triton.jit
def _row_statistics(x_ptr, rows, stride_x_m, nres_ptr, stride_nres_m, K, eps,
                    NORM_RESIDUAL: tl.constexpr, LAYER_NORM: tl.constexpr, NORM_BLOCK: tl.constexpr,
                    BF16_RNE_BY_HAND: tl.constexpr):
    """(mean, rstd) of each of the BLOCK_M rows of x (or of x + residual rounded to x's dtype), in
    fp32 from the whole row in registers; mean is 0 for an RMSNorm."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    cols = tl.arange(0, NORM_BLOCK)[None, :]
    mask = cols < K
    x = tl.load(x_ptr + rows[:, None] * stride_x_m + cols, mask=mask, other=0.0).to(tl.float32)
    if NORM_RESIDUAL:
        res = tl.load(nres_ptr + rows[:, None] * stride_nres_m + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round_to(x + res, DTYPE, BF16_RNE_BY_HAND).to(tl.float32)
    mean = tl.zeros((x.shape[0],), dtype=tl.float32)
    if LAYER_NORM:
        mean = tl.sum(x, axis=1) / K
        x = tl.where(mask, x - mean[:, None], 0.0)
    return mean, tl.math.rsqrt(tl.sum(x * x, axis=1) / K + eps)


@triton.jit
def _normed_chunk(x, offs_k, mask, mean, rstd, nw_ptr, nb_ptr, weight_offset,
                  NORM_WEIGHT: tl.constexpr, NORM_BIAS: tl.constexpr, LAYER_NORM: tl.constexpr,
                  CAST_BEFORE_WEIGHT: tl.constexpr, DTYPE: tl.constexpr, BF16_RNE_BY_HAND: tl.constexpr):
    """The (BLOCK_M, BLOCK_K) chunk x (fp32, already x + residual) normalised with its rows'
    statistics, in kernels/norm.py's order of operations, rounded to DTYPE and widened to fp32."""
    if LAYER_NORM:
        x = x - mean[:, None]
    y = x * rstd[:, None]
    if NORM_WEIGHT:
        if CAST_BEFORE_WEIGHT:
            y = _round_to(y, DTYPE, BF16_RNE_BY_HAND).to(tl.float32)
        y = y * (tl.load(nw_ptr + offs_k, mask=mask, other=0.0).to(tl.float32) + weight_offset)[None, :]
    if NORM_BIAS:
        y = y + tl.load(nb_ptr + offs_k, mask=mask, other=0.0).to(tl.float32)[None, :]
    return _round_to(y, DTYPE, BF16_RNE_BY_HAND).to(tl.float32)


@triton.jit
def _weight_tiles(w_ptrs, mask_k, mask_n2, N, GATED: tl.constexpr):
    """One step's (BLOCK_K, BLOCK_N) weight tile, and the up tile N columns right of it when GATED
    (else the same tile again, unused), in the weight's dtype. Read once: evicted first."""
    mask = mask_k[:, None] & mask_n2
    w = tl.load(w_ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    w_up = w
    if GATED:
        w_up = tl.load(w_ptrs + N, mask=mask, other=0.0, eviction_policy="evict_first")
    return w, w_up


@triton.jit
def _x_chunk(x_ptr, rows, stride_x_m, offs_k, mask_k, row_ok, stores_sum, mean, rstd,
             nres_ptr, stride_nres_m, nw_ptr, nb_ptr, sum_ptr, stride_sum_m, normed_ptr, stride_normed_m,
             weight_offset,
             NORM: tl.constexpr, NORM_RESIDUAL: tl.constexpr, NORM_WEIGHT: tl.constexpr, NORM_BIAS: tl.constexpr,
             LAYER_NORM: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr, BF16_RNE_BY_HAND: tl.constexpr,
             STORE_NORMED: tl.constexpr):
    """x's (BLOCK_M, BLOCK_K) chunk in fp32: as stored, or normalised (NORM) with the rows'
    statistics after the residual add, whose rounded sum (and with STORE_NORMED the normalised
    chunk) the `stores_sum` programs store."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + rows[:, None] * stride_x_m + offs_k[None, :], mask=mask_k[None, :], other=0.0,
                eviction_policy="evict_last").to(tl.float32)
    if NORM:
        if NORM_RESIDUAL:
            res = tl.load(nres_ptr + rows[:, None] * stride_nres_m + offs_k[None, :], mask=mask_k[None, :],
                          other=0.0).to(tl.float32)
            s = _round_to(x + res, DTYPE, BF16_RNE_BY_HAND)
            tl.store(sum_ptr + rows[:, None] * stride_sum_m + offs_k[None, :], s,
                     mask=mask_k[None, :] & row_ok[:, None] & stores_sum)
            x = s.to(tl.float32)
        x = _normed_chunk(x, offs_k, mask_k, mean, rstd, nw_ptr, nb_ptr, weight_offset,
                          NORM_WEIGHT, NORM_BIAS, LAYER_NORM, CAST_BEFORE_WEIGHT, DTYPE, BF16_RNE_BY_HAND)
        if STORE_NORMED:
            tl.store(normed_ptr + rows[:, None] * stride_normed_m + offs_k[None, :], x.to(DTYPE),
                     mask=mask_k[None, :] & row_ok[:, None] & stores_sum)
    return x


# M and the workspace strides unspecialised: a new row count within a bucket, or a split launch
# beside an unsplit one, must not compile another kernel.
@triton.jit(do_not_specialize=["M", "SPLIT_K", "stride_part_split", "stride_part_m"])
def _gemv_kmajor_kernel(
    x_ptr, stride_x_m,
    w_ptr, stride_w_k,  # unit stride along N
    bias_ptr, stride_bias,
    res_ptr, stride_res_m, stride_res_n,
    out_ptr, stride_out_m,
    part_ptr, stride_part_split, stride_part_m,  # fp32 partials when SPLIT_K > 1
    nres_ptr, stride_nres_m,  # the norm prologue's residual (NORM_RESIDUAL)
    nw_ptr, nb_ptr,  # its weight (NORM_WEIGHT) and bias (NORM_BIAS)
    sum_ptr, stride_sum_m,  # where x + residual is stored (NORM_RESIDUAL)
    normed_ptr, stride_normed_m,  # where the normalised rows are stored (STORE_NORMED)
    eps, weight_offset,
    M, N, K,
    SPLIT_K,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,  # M's power-of-two bucket; rows past M re-read row m % M, never stored
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr = False,
    NORM_RESIDUAL: tl.constexpr = False,
    NORM_WEIGHT: tl.constexpr = False,
    NORM_BIAS: tl.constexpr = False,
    LAYER_NORM: tl.constexpr = False,
    CAST_BEFORE_WEIGHT: tl.constexpr = False,
    NORM_BLOCK: tl.constexpr = 1,  # K's power of two, for the row statistics
    STORE_NORMED: tl.constexpr = False,
    BF16_RNE_BY_HAND: tl.constexpr = False,
    PDL: tl.constexpr = 0,
):
    GATED: tl.constexpr = ((ACTIVATION == "silu_mul" or ACTIVATION == "gelu_mul")
                           or (ACTIVATION == "gelu_tanh_mul" or ACTIVATION == "relu_mul"))
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)

    offs_m = tl.arange(0, BLOCK_M)
    rows = (offs_m % M).to(tl.int64)
    # Columns are masked, not wrapped: the weight loads need offs_n's contiguity to be 16 bytes wide.
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N

    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = min(K, k_start + k_per_split)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_k.to(tl.int64)[:, None] * stride_w_k + offs_n[None, :]
    wait_for_previous_kernel(PDL)

    # The first step's weight tile is requested before anything else (the norm's statistics, x's
    # chunk and its layout conversion, which waits at a barrier), and every step requests the next
    # step's tile before it multiplies: the weight stream, the only large read, never waits on x.
    mask_n2 = mask_n[None, :]
    w, w_up = _weight_tiles(w_ptrs, offs_k < k_end, mask_n2, N, GATED)
    mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
    rstd = mean
    if NORM:
        mean, rstd = _row_statistics(x_ptr, rows, stride_x_m, nres_ptr, stride_nres_m, K, eps,
                                     NORM_RESIDUAL, LAYER_NORM, NORM_BLOCK, BF16_RNE_BY_HAND)
    # Partial sums per K lane and column: the sum over the tile's K axis, which crosses warps, runs
    # once after the loop. One or two rows (decode) keep a (BLOCK_K, BLOCK_N) accumulator per row
    # in the weight tile's own layout, so only x's short chunk changes layout (x[:, None]); more
    # rows keep one (BLOCK_M, BLOCK_K, BLOCK_N) accumulator.
    FEW: tl.constexpr = BLOCK_M <= 2
    if FEW:
        acc0 = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    else:
        acc0 = tl.zeros((BLOCK_M, BLOCK_K, BLOCK_N), dtype=tl.float32)
    acc1, acc0_up, acc1_up = acc0, acc0, acc0
    for _ in range(k_start, k_end, BLOCK_K):
        mask_k = offs_k < k_end
        x = _x_chunk(x_ptr, rows, stride_x_m, offs_k, mask_k, offs_m < M, pid_n == 0, mean, rstd,
                     nres_ptr, stride_nres_m, nw_ptr, nb_ptr, sum_ptr, stride_sum_m, normed_ptr, stride_normed_m,
                     weight_offset, NORM, NORM_RESIDUAL, NORM_WEIGHT, NORM_BIAS, LAYER_NORM, CAST_BEFORE_WEIGHT,
                     BF16_RNE_BY_HAND, STORE_NORMED)
        w_now, w_up_now = w.to(tl.float32), w_up.to(tl.float32)
        offs_k += BLOCK_K
        w_ptrs += BLOCK_K * stride_w_k
        w, w_up = _weight_tiles(w_ptrs, offs_k < k_end, mask_n2, N, GATED)  # masked off past the range
        if FEW:
            x0 = tl.sum(tl.where(offs_m[:, None] == 0, x, 0.0), axis=0)[:, None]
            acc0 += x0 * w_now
            if GATED:
                acc0_up += x0 * w_up_now
            if BLOCK_M == 2:
                x1 = tl.sum(tl.where(offs_m[:, None] == 1, x, 0.0), axis=0)[:, None]
                acc1 += x1 * w_now
                if GATED:
                    acc1_up += x1 * w_up_now
        else:
            acc0 += x[:, :, None] * w_now[None, :, :]
            if GATED:
                acc0_up += x[:, :, None] * w_up_now[None, :, :]
    if FEW:
        first = offs_m[:, None] == 0
        acc = tl.where(first, tl.sum(acc0, axis=0)[None, :], tl.sum(acc1, axis=0)[None, :])
        acc_up = acc
        if GATED:
            acc_up = tl.where(first, tl.sum(acc0_up, axis=0)[None, :], tl.sum(acc1_up, axis=0)[None, :])
    else:
        acc = tl.sum(acc0, axis=1)
        acc_up = acc
        if GATED:
            acc_up = tl.sum(acc0_up, axis=1)

    _finish_tile(acc, acc_up, offs_m, offs_n, M, N, SPLIT_K, pid_k, bias_ptr, stride_bias,
                 res_ptr, stride_res_m, stride_res_n, out_ptr, stride_out_m,
                 part_ptr, stride_part_split, stride_part_m, ACTIVATION, HAS_BIAS, HAS_RESIDUAL)


def gemv_kmajor_fwd(
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    res2: torch.Tensor | None,
    out: torch.Tensor,
    bucket: int,
    num_sms: int,
    norm=None,
    summed: torch.Tensor | None = None,
    config: KMajorConfig | tuple[int, int, int, int] | None = None,
    normed: torch.Tensor | None = None,
) -> None:
    """Writes act(norm(x2) @ weight.T + bias) + res2 into out (M, N), with a norm residual the sum
    into summed (M, K), and the normalised rows into normed (M, K) if given. Called by
    gemv.gemv_fwd and gemv.norm_gemv_fwd, which check the arguments, flatten the rows and allocate
    the outputs; `norm` is their NormPrologue or None."""
    M, K = x2.shape
    N = out.shape[1]
    conf = KMajorConfig(*config) if config is not None else default_config(M, N, K, num_sms)
    split_k = max(1, min(conf.split_k, triton.cdiv(K, conf.block_k)))
    epilogue = EpilogueOperands(out, bias, res2, activation, split_k)
    norm_args, norm_flags = launch_args(norm, x2, summed, normed)
    if norm is not None:
        norm_flags["NORM_BLOCK"] = next_power_of_2(K)
    _gemv_kmajor_kernel[(triton.cdiv(N, conf.block_n), split_k)](
        x2, x2.stride(0),
        weight, weight.stride(1),
        *epilogue.args,
        *epilogue.part_args,
        *norm_args,
        M, N, K, split_k,
        **epilogue.flags, BLOCK_M=bucket, BLOCK_N=conf.block_n, BLOCK_K=conf.block_k, **norm_flags,
        BF16_RNE_BY_HAND=INTERPRET and x2.dtype == torch.bfloat16,
        num_warps=conf.num_warps, num_stages=1, **pdl(x2),
    )
    epilogue.reduce(bucket, _REDUCE_BLOCK_N)
