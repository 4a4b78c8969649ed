"""Weight-streaming GEMV for decode: the linear with epilogue of transfuse.kernels.gemm for 1..16 rows.

    out = act(x @ weight.T + bias) + residual

    x:        (M, K)  rows of the flattened (..., K) input, M <= 16; unit stride along K, any row stride
    weight:   (N, K)  nn.Linear layout: unit stride along K, any row stride (row slices of a fused weight)
    bias:     (N,)
    residual: (M, N)  any strides
    out:      (M, N)  contiguous, dtype of x

Semantics, activations (gated "<act>_mul": weight (2N, K) = [W_gate; W_up], out = act(gate) * up) and
numerics are those of `gemm.linear_fwd`: fp32 products and sums, the epilogue on fp32, one rounding
at the store. The epilogue, the split-K partials' store and reduce kernel, and the launch of
those (EpilogueOperands) are gemm.py's own.

Why a second kernel: a linear of M rows reads N*K weight elements and does M*N*K multiply-adds, so
for M ~ 1 it is bound by reading the weight from HBM once (Llama-7B's (N, K) = (4096, 11008) down
projection: 90 MB, 27 us at 3.35 TB/s). A 16-row tensor-core tile (gemm.py) computes 16 rows for
one, and its loads go through shared memory; here each program streams its weight rows straight
into registers and multiplies on the CUDA cores.

Program (pid_n, pid_k) owns output columns [pid_n * BLOCK_N, +BLOCK_N) for all M rows (M padded to
the power-of-two bucket BLOCK_M) and the pid_k-th of SPLIT_K slices of K. Each BLOCK_K step loads a
(BLOCK_N, BLOCK_K) weight tile, each thread 16 contiguous bytes of every row (so a warp reads
512 contiguous bytes of a row), and the (M, BLOCK_K) x chunk, each thread the same K positions of
every row; the thread multiplies in fp32 and sums its 8 elements in registers (tl.sum). The sums
across the lanes and warps that share a row (tl.sum again) wait until after the loop: a cross-lane
reduction every step would cost 5 shuffles per 8 products. No tl.dot: the data never goes through
shared memory.

Split-K: where N / BLOCK_N gives too few programs to keep every SM's loads in flight, SPLIT_K
programs share a column block's K range; each writes fp32 partials (SPLIT_K, M, N) to a workspace
and gemm.py's reduce kernel sums them in split order (deterministic, no atomics) and applies the
epilogue (which cannot run on partial sums: the activation is not linear).

Where it pays (H100 SXM, torch 2.11, triton 3.6, fp16, weights from HBM, 2026-11-22;
bench/kernels/bench_gemv.py), against cuBLAS (F.linear + eager epilogue ops):
- 1 row: 1.08-1.50x faster on every Llama-1.1B and Llama-7B linear; the large ones (7B qkv,
  gate_up, lm_head, 1.1B lm_head) reach 98-104% of the 2.96 TB/s device-to-device copy bandwidth,
  the small ones (1.1B o-proj, 8 MB: 5.3 us) are bound by launch and ramp-up, not bandwidth;
- 2 rows: 1.00-1.33x;
- 8 rows: ~0.3-0.6x, 16 rows: ~0.15-0.3x. From 4 rows up the CUDA cores, not HBM, set the pace
  (M multiply-adds plus conversions per weight element on 128 fp32 lanes per SM), where
  gemm.linear_fwd's tensor-core tile runs at cuBLAS speed. GEMV_FAST_M_MAX records the crossover;
  gemv_fwd still takes up to 16 rows (correct, not fast).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from transfuse.kernels import gemv_kmajor
from transfuse.kernels._config import INTERPRET, next_power_of_2, num_sms, pdl, tune_configs, wait_for_previous_kernel
from transfuse.kernels.gemm import EpilogueOperands, _finish_tile, check_linear_args, is_gated
from transfuse.kernels.norm import _round_to
from transfuse.kernels.norm_prologue import NormPrologue, check_normed, launch_args, norm_rows, operands_match

GEMV_M_MAX = 16  # rows gemv_fwd takes
GEMV_FAST_M_MAX = 2  # rows up to which it matched or beat cuBLAS on every Llama shape (see above)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class GemvConfig(NamedTuple):
    """One launch configuration: output columns per program, K step, programs per column block
    along K, warps per program."""
    block_n: int
    block_k: int
    split_k: int
    num_warps: int


# -------------------------------------------------------------------------------------------------
# Configs
# -------------------------------------------------------------------------------------------------

# GemvConfig(BLOCK_N, BLOCK_K, SPLIT_K, num_warps) per M bucket, the heuristic's default first; all
# of them are what bench/kernels/bench_gemv.py sweeps. BLOCK_K is 32 lanes * num_warps * 8 elements
# (16-byte loads) * 1 or 2 steps. Narrow column blocks won on every Llama shape (H100, fp16): N / 2
# programs keep enough loads in flight without split-K, and a thread's registers grow as
# BLOCK_M * BLOCK_N accumulators + (BLOCK_M + BLOCK_N) * 8 loaded elements. At 1 row the listed
# configs were within ~5% of each other on every shape but the long-K ones (LONG_K_BLOCK_N). Beyond
# 2 rows see GEMV_FAST_M_MAX.
_CONFIGS = {
    1: [GemvConfig(2, 2048, 1, 4), GemvConfig(4, 2048, 1, 4), GemvConfig(4, 1024, 1, 4),
        GemvConfig(2, 1024, 1, 2), GemvConfig(2, 2048, 2, 4)],
    2: [GemvConfig(4, 1024, 1, 2), GemvConfig(4, 1024, 1, 4), GemvConfig(2, 1024, 1, 4)],
    4: [GemvConfig(4, 512, 1, 2), GemvConfig(4, 1024, 1, 4), GemvConfig(2, 512, 1, 2)],
    8: [GemvConfig(8, 512, 1, 2), GemvConfig(8, 1024, 1, 4), GemvConfig(4, 512, 1, 2)],
    16: [GemvConfig(4, 1024, 1, 4), GemvConfig(4, 512, 1, 2)],
}
# Gated activations: a program streams 2 * BLOCK_N weight rows into two accumulators, so its column blocks
# are narrower from 4 rows up (at most 16 / BLOCK_M columns). Wider ones spill (8 rows x 8 columns,
# gated: ~900 B a thread, ptxas sm_90) and ran 35x slower than the plain linear on an H100. At 2
# rows 4 warps beat 2 by ~15% here, the opposite of the plain linear (measured, not explained).
_GATED_CONFIGS = {
    1: [GemvConfig(2, 2048, 1, 4), GemvConfig(4, 1024, 1, 4), GemvConfig(2, 1024, 1, 2)],
    2: [GemvConfig(2, 1024, 1, 4), GemvConfig(4, 1024, 1, 4), GemvConfig(4, 1024, 1, 2)],
    4: [GemvConfig(4, 512, 1, 2), GemvConfig(2, 512, 1, 2)],
    8: [GemvConfig(2, 512, 1, 2), GemvConfig(2, 1024, 1, 4)],
    16: [GemvConfig(1, 512, 1, 2), GemvConfig(1, 1024, 1, 4)],
}

# Under the interpreter: small blocks so that tiny test shapes cross block edges in N and K.
_INTERPRET_CONFIG = GemvConfig(16, 32, 1, 4)


def gemv_bucket(m: int) -> int:
    """Rows rounded up to a power of two: the row count the kernel is compiled for (BLOCK_M)."""
    return next_power_of_2(max(m, 1))


def gemv_configs(m: int, gated: bool = False) -> list[GemvConfig]:
    """The configs for m rows, `gated` for a gated activation, default first (the interpreter's one config
    under TRITON_INTERPRET)."""
    return tune_configs((_GATED_CONFIGS if gated else _CONFIGS)[gemv_bucket(m)], _INTERPRET_CONFIG)


def keep(conf: GemvConfig, element_size: int = 2) -> bool:
    """Whether a config keeps the kernel's layout free of shared-memory conversions on a GPU: its
    K step must give every lane of every warp a 16-byte vector (see the kernel)."""
    vec = 16 // element_size
    return conf.block_k % (32 * conf.num_warps * vec) == 0


# At 1 row, a linear that streams more than two K steps per column (a down projection: K = ffn) is
# faster with 4-column blocks: Llama-1.1B's down + residual (2048 x 5632) 10.1 us against 11.2 with
# the default 2 columns, the other configs 10.6-11.0 (H100, bench/kernels/bench_gemv.py --m 1,
# bench/results/2026-11-26-*-gemv-sweep-1row-session14.log). Not for a norm prologue (one K step).
LONG_K_BLOCK_N = 4


def default_config(m: int, n: int, k: int, num_sms: int, gated: bool = False, norm: bool = False) -> GemvConfig:
    """The heuristic's config for an (m rows, n columns, k) linear on a GPU of num_sms SMs, `gated`
    for a gated activation, `norm` for a norm prologue (the interpreter's config under TRITON_INTERPRET)."""
    conf = gemv_configs(m, gated)[0]
    if INTERPRET:
        return conf
    if m == 1 and not gated and not norm and k > 2 * conf.block_k:
        conf = conf._replace(block_n=LONG_K_BLOCK_N)
    return _fit(conf, n, k, num_sms)


def _fit(conf: GemvConfig, n: int, k: int, num_sms: int) -> GemvConfig:
    """The M bucket's default fitted to the shape:
    - a shorter K step where K is short, with fewer warps, so that every lane still loads 16 bytes;
    - split-K (2 or 4) where the column blocks give fewer than two programs per SM, as long as
      every split keeps at least two K steps. Checked on a few BERT-size shapes only (N = 768 and
      1024 at 4 rows: 5-7% faster split in two; at 1 row, 2-column blocks unsplit beat any split):
      every Llama shape has N >= 2048 and runs unsplit.
    """
    block_n, block_k, num_warps = conf.block_n, conf.block_k, conf.num_warps
    while num_warps > 1 and block_k >= 2 * next_power_of_2(k):
        block_k, num_warps = block_k // 2, num_warps // 2
    programs = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    split_k = conf.split_k
    while split_k < 4 and programs * split_k < 2 * num_sms and steps >= 4 * split_k:
        split_k *= 2
    return GemvConfig(block_n, block_k, split_k, num_warps)


# -------------------------------------------------------------------------------------------------
# Kernel
# -------------------------------------------------------------------------------------------------


@triton.jit
def _gemv_step(acc, acc_up, x_ptrs, w_ptrs, w_up_ptrs, mask_k, GATED: tl.constexpr, MASKED: tl.constexpr):
    """One BLOCK_K step: acc[m, n, l] += sum_p x[m, l, p] * w[n, l, p] over this thread's VEC
    contiguous K elements p (in registers); the sum over lanes l waits for the end of the loop.
    The weight is read once and evicted first, so that x (re-read by every program) and the
    residual stay in L2. Values are widened to fp32 right after loading: fp32 products and sums,
    and the interpreter's bf16 arithmetic is wrong otherwise."""
    if MASKED:
        x = tl.load(x_ptrs, mask=mask_k, other=0.0, eviction_policy="evict_last")
        w = tl.load(w_ptrs, mask=mask_k, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(x_ptrs, eviction_policy="evict_last")
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    x = x.to(tl.float32)
    acc += tl.sum(x * w.to(tl.float32), axis=3)
    if GATED:
        if MASKED:
            w_up = tl.load(w_up_ptrs, mask=mask_k, other=0.0, eviction_policy="evict_first")
        else:
            w_up = tl.load(w_up_ptrs, eviction_policy="evict_first")
        acc_up += tl.sum(x * w_up.to(tl.float32), axis=3)
    return acc, acc_up


@triton.jit
def _normed_rows(x_ptr, rows, stride_x_m, offs_k, mask_k, row_ok, stores_sum,
                 nres_ptr, stride_nres_m, nw_ptr, nb_ptr, sum_ptr, stride_sum_m, normed_ptr, stride_normed_m,
                 eps, weight_offset, K,
                 NORM_RESIDUAL: tl.constexpr, NORM_WEIGHT: tl.constexpr, NORM_BIAS: tl.constexpr,
                 LAYER_NORM: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr, BF16_RNE_BY_HAND: tl.constexpr,
                 STORE_NORMED: tl.constexpr = False):
    """rms_norm or layer_norm of x or of x + residual, for whole (BLOCK_M, 1, LANES, VEC) rows,
    rounded to x's dtype and widened back to fp32: what transfuse.kernels.norm's kernels store, by
    the same operations (their fp32 sums may associate differently: a last-bit difference in the
    statistics, at most an ulp in a normalised value). With a residual, the rounded sum is also
    stored, and with STORE_NORMED the normalised rows (by the programs for which `stores_sum`,
    rows that exist only)."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    row_offs = rows[:, None, None, None]
    x = tl.load(x_ptr + row_offs * stride_x_m + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    if NORM_RESIDUAL:
        res = tl.load(nres_ptr + row_offs * stride_nres_m + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        s = _round_to(x + res, DTYPE, BF16_RNE_BY_HAND)
        tl.store(sum_ptr + row_offs * stride_sum_m + offs_k, s,
                 mask=mask_k & row_ok[:, None, None, None] & stores_sum)
        x = s.to(tl.float32)
    if LAYER_NORM:
        # two passes over registers, as kernels.norm._layer_norm_rows
        mean = tl.sum(tl.sum(x, axis=3), axis=2) / K
        x = tl.where(mask_k, x - mean[:, :, None, None], 0.0)
    mean_square = tl.sum(tl.sum(x * x, axis=3), axis=2) / K
    y = x * tl.math.rsqrt(mean_square + eps)[:, :, None, None]
    if NORM_WEIGHT:
        if CAST_BEFORE_WEIGHT:
            y = _round_to(y, DTYPE, BF16_RNE_BY_HAND).to(tl.float32)
        g = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32) + weight_offset
        y = y * g
    if NORM_BIAS:
        y = y + tl.load(nb_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    y = _round_to(y, DTYPE, BF16_RNE_BY_HAND)
    if STORE_NORMED:
        tl.store(normed_ptr + row_offs * stride_normed_m + offs_k, y,
                 mask=mask_k & row_ok[:, None, None, None] & stores_sum)
    return y.to(tl.float32)


# M and the workspace strides unspecialised: a new row count within a bucket, or a split launch
# beside an unsplit one, must not compile another kernel.
@triton.jit(do_not_specialize=["M", "SPLIT_K", "stride_part_split", "stride_part_m"])
def _gemv_fwd_kernel(
    x_ptr, stride_x_m,
    w_ptr, stride_w_n,  # unit stride along K
    bias_ptr, stride_bias,
    res_ptr, stride_res_m, stride_res_n,
    out_ptr, stride_out_m,
    part_ptr, stride_part_split, stride_part_m,  # fp32 partials when SPLIT_K > 1
    nres_ptr, stride_nres_m,  # the RMSNorm prologue's residual (NORM_RESIDUAL)
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
    VEC: tl.constexpr,  # contiguous K elements a thread loads at once: 16 bytes
    NORM: tl.constexpr = False,  # x is normalised first (one K step, unsplit: see norm_gemv_fwd)
    NORM_RESIDUAL: tl.constexpr = False,
    NORM_WEIGHT: tl.constexpr = False,
    NORM_BIAS: tl.constexpr = False,
    LAYER_NORM: tl.constexpr = False,  # layer_norm, else rms_norm
    CAST_BEFORE_WEIGHT: tl.constexpr = False,
    STORE_NORMED: tl.constexpr = False,
    BF16_RNE_BY_HAND: tl.constexpr = False,
    PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (_config.pdl)
):
    GATED: tl.constexpr = ((ACTIVATION == "silu_mul" or ACTIVATION == "gelu_mul")
                           or (ACTIVATION == "gelu_tanh_mul" or ACTIVATION == "relu_mul"))
    LANES: tl.constexpr = BLOCK_K // VEC
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Out-of-range rows and columns wrap back into range instead of being masked, so that the main
    # loop's loads need no masks at all (the wrapped ones are never stored).
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)

    # This program's K range: whole BLOCK_K steps per split (the last split with work takes the
    # remainder; splits past K have none and write zero partials).
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = min(K, k_start + k_per_split)
    k_full = max(k_end - k_start, 0) // BLOCK_K * BLOCK_K

    # The K step as (LANES, VEC): 4-d tiles (M, N, LANES, VEC) whose layout Triton derives from the
    # loads: VEC in one thread (16-byte loads), lanes and then warps along LANES. x (M, 1, LANES, VEC)
    # and w (1, N, LANES, VEC) then share that layout, so the product needs no shared-memory layout
    # conversion as long as LANES >= 32 * num_warps (otherwise warps spill onto N for w and onto M
    # for x); each thread reads its x elements once and uses them for all BLOCK_N rows.
    offs_k = tl.arange(0, LANES)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    offs_k = offs_k[None, None, :, :]
    x_ptrs = x_ptr + rows[:, None, None, None] * stride_x_m + (k_start + offs_k)
    w_ptrs = w_ptr + cols[None, :, None, None] * stride_w_n + (k_start + offs_k)
    # the up rows start N rows below the gate rows (int64: N * stride can pass 2**31)
    w_up_ptrs = w_ptr + (cols + N)[None, :, None, None] * stride_w_n + (k_start + offs_k)
    wait_for_previous_kernel(PDL)
    # Partial sums per lane: the cross-lane (and cross-warp) sum runs once, after the loop.
    acc = tl.zeros((BLOCK_M, BLOCK_N, LANES), dtype=tl.float32)
    acc_up = acc

    if NORM:
        # The whole row is in this one step (BLOCK_K >= K), so every program normalises its rows in
        # registers, exactly as the unfused norm kernel would store them, and multiplies those.
        # One weight tile is requested before the norm, so that its HBM latency overlaps the rows'
        # loads and the statistics' sums: 2.57 -> 2.42 us at (768, 768) with a LayerNorm, 40.8 ->
        # 37.7 us for Llama-1.1B's LM head. Two tiles (gated) held through the norm cost registers:
        # its gate-up went 13.2 -> 16.3 us that way, so they are loaded after it (H200, fp16, one
        # row, 20 launches in a CUDA graph, 2026-11-27).
        WEIGHT_FIRST: tl.constexpr = not GATED
        mask_k = offs_k < K
        if WEIGHT_FIRST:
            w = tl.load(w_ptrs, mask=mask_k, other=0.0, eviction_policy="evict_first")
        x = _normed_rows(x_ptr, rows, stride_x_m, offs_k, mask_k, offs_m < M, pid_n == 0,
                         nres_ptr, stride_nres_m, nw_ptr, nb_ptr, sum_ptr, stride_sum_m, normed_ptr, stride_normed_m,
                         eps, weight_offset, K, NORM_RESIDUAL, NORM_WEIGHT, NORM_BIAS, LAYER_NORM, CAST_BEFORE_WEIGHT,
                         BF16_RNE_BY_HAND, STORE_NORMED)
        if not WEIGHT_FIRST:
            w = tl.load(w_ptrs, mask=mask_k, other=0.0, eviction_policy="evict_first")
        acc += tl.sum(x * w.to(tl.float32), axis=3)
        if GATED:
            w_up = tl.load(w_up_ptrs, mask=mask_k, other=0.0, eviction_policy="evict_first")
            acc_up += tl.sum(x * w_up.to(tl.float32), axis=3)
    else:
        for _ in range(0, k_full, BLOCK_K):
            acc, acc_up = _gemv_step(acc, acc_up, x_ptrs, w_ptrs, w_up_ptrs, offs_k, GATED, False)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            w_up_ptrs += BLOCK_K
        if k_full < k_end - k_start:
            # the tail: fewer than BLOCK_K columns left
            mask_k = offs_k < k_end - k_start - k_full
            acc, acc_up = _gemv_step(acc, acc_up, x_ptrs, w_ptrs, w_up_ptrs, mask_k, GATED, True)

    acc = tl.sum(acc, axis=2)
    if GATED:
        acc_up = tl.sum(acc_up, axis=2)
    else:
        acc_up = acc

    # split: fp32 partials in gemm.py's reduce layout, whose reduce kernel runs the epilogue
    _finish_tile(acc, acc_up, offs_m, offs_n, M, N, SPLIT_K, pid_k, bias_ptr, stride_bias,
                 res_ptr, stride_res_m, stride_res_n, out_ptr, stride_out_m,
                 part_ptr, stride_part_split, stride_part_m, ACTIVATION, HAS_BIAS, HAS_RESIDUAL)


# -------------------------------------------------------------------------------------------------
# Launchers
# -------------------------------------------------------------------------------------------------

_REDUCE_BLOCK_N = 256


def _weight_layout_ok(weight: torch.Tensor) -> bool:
    # K contiguous: each thread streams 16-byte row segments. A transposed view (stride 1 along N)
    # read through this kernel's strides would go through a shared-memory layout conversion every
    # step (1.5-2.7x slower, H100, fp16, 1 row): kernels/gemv_kmajor.py streams that layout instead.
    return weight.dim() == 2 and (weight.stride(1) == 1 or weight.shape[1] <= 1 or gemv_kmajor.kmajor_layout(weight))


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, max_rows: int = GEMV_M_MAX) -> bool:
    """Whether gemv_fwd takes this linear: x of at most `max_rows` (<= GEMV_M_MAX) rows, fp16, bf16
    or fp32, the weight of x's dtype and device with unit stride along K, or along N (a transposed
    (K, N) matrix: gemv_kmajor's kernel). (x with a non-unit K
    stride is copied, cheap at 16 rows.) Pass max_rows=GEMV_FAST_M_MAX to ask whether it is also
    the fast choice without measuring."""
    if x.dim() == 0 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return False
    rows = math.prod(x.shape[:-1])
    return (x.dtype in _DTYPES and weight.dtype == x.dtype and weight.device == x.device
            and rows <= min(max_rows, GEMV_M_MAX) and _weight_layout_ok(weight))


NORM_K_MAX = 8192  # the whole row is one K step in registers: 64 fp32 values a thread at 8 warps


def norm_gemv_applies(x: torch.Tensor, weight: torch.Tensor, norm: NormPrologue, max_rows: int = GEMV_FAST_M_MAX) -> bool:
    """Whether norm_gemv_fwd takes this: gemv_applies, a row of at most NORM_K_MAX, 16-bit or fp32
    tensors all of x's dtype (the normalised row is rounded to it, as the unfused op's output)."""
    return gemv_applies(x, weight, max_rows) and x.shape[-1] <= NORM_K_MAX and operands_match(x, norm)


def norm_gemv_step(M: int, N: int, K: int, x: torch.Tensor, gated: bool = False) -> tuple[GemvConfig, int, int, int]:
    """(the heuristic's config, BLOCK_K, VEC, num_warps) of a norm-GEMV launch: one K step holds the
    whole row, with enough warps that a thread keeps at most 64 of its values. Kernels that must
    reproduce norm_gemv_fwd's per-column sums (kernels/qkv_rotary_cache.py) launch with these."""
    conf = default_config(M, N, K, num_sms(x.device), gated, norm=True)
    vec = min(conf.block_k, 16 // x.element_size())
    block_k = max(next_power_of_2(K), conf.block_k)
    num_warps = conf.num_warps if INTERPRET else max(conf.num_warps, min(8, block_k // (64 * 32)))
    return conf, block_k, vec, num_warps


def norm_gemv_fwd(
    x: torch.Tensor,
    norm: NormPrologue,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    config: tuple[int, int] | None = None,
    normed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(norm(s) @ weight.T + bias), s) with s = x + norm.residual (rounded to x's dtype), or
    s = x and an empty (0,) second output without a residual: the RMSNorm or LayerNorm that feeds a
    linear, in the GEMV's own launch. Every program normalises the rows itself (they are K <= NORM_K_MAX wide
    and few), so the normalised activation need not reach memory and the norm costs no launch.
    `normed`, a contiguous tensor of x's shape and dtype, also receives the normalised rows (a
    post-norm layer adds them again as its next residual: still no launch of its own).
    `config=(BLOCK_N, num_warps)` overrides the heuristic (benchmarks)."""
    if not norm_gemv_applies(x, weight, norm, GEMV_M_MAX):
        raise ValueError("norm_gemv_fwd: x, the norm's residual and weight must share a dtype and device, "
                         f"with at most {GEMV_M_MAX} rows of at most {NORM_K_MAX}: use the norm op and gemv_fwd")
    N = check_linear_args(x, weight, bias, activation, None)
    K = x.shape[-1]
    lead = x.shape[:-1]
    x2, res2 = norm_rows(x, norm)
    M = x2.shape[0]
    check_normed(normed, x, "norm_gemv_fwd")
    normed2 = normed.view(M, K) if normed is not None else None
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    summed = torch.empty((M, K) if res2 is not None else (0,), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:  # (no program runs: ops/norm_linear.py sends N == 0 to the unfused path)
        return out.view(*lead, N), summed.view(*lead, K) if res2 is not None else summed
    prologue = norm._replace(residual=res2)
    if gemv_kmajor.kmajor_layout(weight):
        gemv_kmajor.gemv_kmajor_fwd(x2, weight, bias, activation, None, out, gemv_bucket(M), num_sms(x.device),
                                    prologue, summed, normed=normed2)
        return out.view(*lead, N), summed.view(*lead, K) if res2 is not None else summed
    norm_args, norm_flags = launch_args(prologue, x2, summed, normed2)
    conf, block_k, vec, num_warps = norm_gemv_step(M, N, K, x, is_gated(activation))
    if config is not None:
        conf, num_warps = conf._replace(block_n=config[0]), config[1]
    epilogue = EpilogueOperands(out, bias, None, activation, 1)
    bucket = gemv_bucket(M)
    _gemv_fwd_kernel[(triton.cdiv(N, conf.block_n), 1)](
        x2, x2.stride(0),
        weight, weight.stride(0),
        *epilogue.args,
        *epilogue.part_args,
        *norm_args,
        M, N, K, 1,
        **epilogue.flags, BLOCK_M=bucket, BLOCK_N=conf.block_n, BLOCK_K=block_k, VEC=vec, **norm_flags,
        BF16_RNE_BY_HAND=INTERPRET and x.dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=1, **pdl(x2),
    )
    return out.view(*lead, N), summed.view(*lead, K) if res2 is not None else summed


def gemv_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    residual: torch.Tensor | None = None,
    config: GemvConfig | tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """act(x @ weight.T + bias) + residual for x of at most 16 rows, streaming the weight once.

    x: (..., K) with prod(...) <= 16; weight: (N, K), or (2N, K) for a gated activation; bias: (N,) or
    (2N,); residual: (..., N). Returns (..., N), contiguous, dtype of x.
    A weight with unit stride along N (a transposed (K, N) matrix) runs gemv_kmajor's kernel.
    `config=(BLOCK_N, BLOCK_K, SPLIT_K, num_warps)` overrides the heuristic (tests, benchmarks).
    """
    N = check_linear_args(x, weight, bias, activation, residual)
    if x.dtype not in _DTYPES:
        raise ValueError(f"gemv_fwd takes fp16, bf16 or fp32, got {x.dtype}")
    if not _weight_layout_ok(weight):
        raise ValueError(f"gemv_fwd streams weights with unit stride along K (nn.Linear's layout) or along N, "
                         f"got strides {tuple(weight.stride())}: pass weight.contiguous(), or use "
                         f"gemm.linear_fwd, which reads any strides")
    K = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if M > GEMV_M_MAX:
        raise ValueError(f"gemv_fwd takes at most {GEMV_M_MAX} rows, got {M}: use gemm.linear_fwd")
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return out.view(*lead, N)
    res2 = residual.reshape(-1, N) if residual is not None else None
    if gemv_kmajor.kmajor_layout(weight):
        gemv_kmajor.gemv_kmajor_fwd(x2, weight, bias, activation, res2, out, gemv_bucket(M), num_sms(x.device),
                                    config=config)
        return out.view(*lead, N)

    gated = is_gated(activation)
    conf = GemvConfig(*config) if config is not None else default_config(M, N, K, num_sms(x.device), gated)
    bucket = gemv_bucket(M)
    split_k = max(1, min(conf.split_k, triton.cdiv(max(K, 1), conf.block_k)))
    epilogue = EpilogueOperands(out, bias, res2, activation, split_k)
    grid = (triton.cdiv(N, conf.block_n), split_k)
    _gemv_fwd_kernel[grid](
        x2, x2.stride(0),
        weight, weight.stride(0),
        *epilogue.args,
        *epilogue.part_args,
        *launch_args(None, x2)[0],  # no norm prologue: stand-ins, never read
        M, N, K, split_k,
        **epilogue.flags, BLOCK_M=bucket, BLOCK_N=conf.block_n, BLOCK_K=conf.block_k,
        VEC=min(conf.block_k, 16 // x.element_size()),
        num_warps=conf.num_warps, num_stages=1, **pdl(x2),
    )
    # all M rows in one row block (BLOCK_M = the bucket), as the GEMV kernel's programs hold them
    epilogue.reduce(bucket, _REDUCE_BLOCK_N)
    return out.view(*lead, N)
