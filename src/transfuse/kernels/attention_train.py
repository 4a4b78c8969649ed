"""Scaled dot-product attention for training: a forward that saves the log-sum-exp, and its backward.
FlashAttention-2 (Dao 2023, arXiv:2307.08691): Algorithm 1 (forward) and Algorithm 2 (backward), with
dQ in a kernel of its own instead of atomics, so that every gradient is deterministic.

    q: (batch, nheads, seqlen_q, headdim)          any strides (unit stride along headdim, else copied)
    k, v: (batch, nheads_kv, seqlen_k, headdim)    nheads % nheads_kv == 0 (GQA/MQA: query head h reads
                                                   kv head h // (nheads // nheads_kv))
    bias: None or an additive fp16/bf16/fp32 tensor broadcastable to (batch, nheads, seqlen_q, seqlen_k)
          (size-1 dims are read with stride 0); it may hold -inf and finfo.min. A boolean mask must be
          turned into an additive one by the caller: `torch.zeros(shape).masked_fill(~mask, -inf)`.
    out: (batch, nheads, seqlen_q, headdim) laid out as a contiguous (batch, seqlen_q, nheads, headdim)
    lse: (batch, nheads, seqlen_q) fp32, contiguous, natural log
    stats: (batch, nheads, 2, seqlen_q) fp32, contiguous: the row maximum m of s (0 for a row that sees
           no key) and log(l), l = sum_j exp(s_ij - m); what the backward reads instead of lse (below)
    headdim <= 256 (padded to a power of two >= 16 inside, with masks); any seqlen_q, seqlen_k.

Forward:
    s = scale * q @ k^T + bias, and -inf where j > i if is_causal
    lse_i = log(sum_j exp(s_ij)),  P = exp(s - lse),  out = P @ v
Causal is top-left aligned, as in F.scaled_dot_product_attention(is_causal=True): key j is visible to
query i iff j <= i, also when seqlen_q != seqlen_k (not the bottom-right alignment of flash-attn's KV-cache
decoding). A row that sees no key (every score -inf: a -inf bias over the whole row) has out = 0 and
lse = -inf, and its gradients are 0: SDPA's "safe softmax" rather than the NaN of a hand-written softmax.

Backward (dO = grad of out; dlse = grad of lse, optional):
    delta_i = sum_d dO_id * O_id - dlse_i          preprocess kernel, fp32 (FA-2's D_i)
    P = exp((s - m) - log(l))                      recomputed from the saved stats, never stored
    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta)
    dQ = scale * dS K,  dK = scale * dS^T Q,  dbias = dS summed over the dims where bias broadcasts
The dlse term: d lse_i / d s_ij = P_ij, so it only shifts delta (dS = P * (dP - (delta - dlse))).
One kernel runs over key blocks (dK, dV and dS; a kv head's program loops over every query head of its
group, so GQA/MQA sums happen in registers), another over query blocks (dQ). Both recompute P.

dbias: dS is written once per (batch, head) by the dK/dV kernel, in fp32, and torch sums the dims that
bias broadcasts over (batch, heads: T5's (1, nheads, seqlen_q, seqlen_k) position bias costs a
(batch, nheads, seqlen_q, seqlen_k) fp32 buffer for one backward). A bias broadcast over queries
((batch, 1, 1, seqlen_k): padding-style) is summed over queries in the kernel, so its buffer is
(batch, nheads, 1, seqlen_k). A bias of the full shape gets dS stored straight in its own dtype.

Numerics. fp32 accumulation everywhere; fp16/bf16 operands go to tl.dot as they are on a GPU and are
widened to fp32 right after loading under the interpreter (its bf16 arithmetic is wrong otherwise).
Masked scores use exp(s - m) in natural units: folding log2(e) into s would overflow finfo(fp32).min to
-inf (see kernels/attention.py); blocks without bias, causal or bounds tests use FA-2's single FMA per
score with exp2. Why m and log(l) are saved apart, not lse = m + log(l) as in flash-attn: lse rounds at
the magnitude of m. For a row masked entirely by a finite value (Hugging Face's eager attention adds
finfo.min, and left padding leaves queries that see only masked keys) every score is m = -3.4e38, lse
rounds to m, and exp(s - lse) would give every key a weight of 1 instead of eager's 1 / l. exp((s - m) -
log(l)) is exact there; elsewhere it costs one subtraction per masked score (the unmasked blocks fold
m + log(l) once per row, as before).

Not supported: dropout (p = 0 only), a boolean mask (convert it, see above), double backward,
headdim > 256, fp64, a negative scale. Sizes that change every step (the sequence lengths) are not specialised on, and the
autotune keys are bucketed lengths, so a new length neither recompiles nor retunes.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from transfuse.kernels._config import INTERPRET, next_power_of_2, tune_configs

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256

LOG2E = tl.constexpr(1.4426950408889634)


# ----------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel, dtype class and head-dim class (BLOCK_D <= 64,
# 128, 256). BLOCK_M counts query rows and BLOCK_N keys in every kernel. Each tile was compiled for
# sm_90 (Triton 3.8, `ptxas -v`; fp16 and bf16, head dims 64/80/128/256, causal, bias with dS stores,
# query-broadcast bias): each fits the 227 KiB of shared memory of an H100 and spills no registers,
# or under 100 bytes (dK/dV with causal + bias + dS, padded head dims). Tiles marked _NO_BIAS spill
# hundreds of bytes (or do not fit) with a bias and are only tried without one. The autotuner times
# those that fit the sequence. fp32 runs its dots on FMA units ("ieee"): small tiles only.
_NO_BIAS = "no bias"
_TILES = {
    "fwd": {
        "16bit": {
            64: [(128, 128, 8, 3, _NO_BIAS), (128, 64, 8, 3), (128, 32, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2),
                 (32, 32, 4, 2)],
            128: [(128, 64, 8, 3, _NO_BIAS), (128, 32, 8, 2), (64, 64, 4, 3, _NO_BIAS), (64, 32, 4, 2), (32, 32, 4, 2)],
            256: [(128, 32, 8, 2, _NO_BIAS), (64, 32, 8, 2), (32, 32, 4, 2)],
        },
        "fp32": {64: [(32, 32, 4, 2), (16, 16, 4, 2)], 128: [(16, 32, 4, 2), (16, 16, 4, 2)], 256: [(16, 16, 4, 2)]},
    },
    # dK/dV: a program holds BLOCK_N keys with their dK, dV accumulators and streams BLOCK_M queries.
    "dkdv": {
        "16bit": {
            64: [(32, 128, 8, 3), (64, 64, 8, 2, _NO_BIAS), (32, 64, 8, 3), (32, 64, 4, 3, _NO_BIAS), (16, 64, 4, 2),
                 (16, 32, 4, 2)],
            128: [(64, 32, 8, 2), (32, 64, 8, 2, _NO_BIAS), (16, 64, 8, 2), (32, 32, 8, 2), (16, 32, 4, 2)],
            256: [(32, 32, 8, 2), (16, 32, 8, 2), (16, 16, 4, 2)],
        },
        # 128 and 256 spill 30-60 bytes, the least of any tile.
        "fp32": {64: [(32, 32, 4, 2), (16, 16, 4, 2)], 128: [(16, 16, 4, 2)], 256: [(16, 16, 4, 2)]},
    },
    # dQ: a program holds BLOCK_M queries with their dQ accumulator and streams BLOCK_N keys.
    "dq": {
        "16bit": {
            64: [(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2), (32, 32, 4, 2)],
            128: [(128, 64, 8, 3, _NO_BIAS), (128, 32, 8, 3), (64, 64, 4, 3, _NO_BIAS), (64, 32, 4, 2), (32, 32, 4, 2)],
            256: [(128, 32, 8, 2), (64, 32, 8, 2), (32, 32, 4, 2)],
        },
        "fp32": {64: [(32, 32, 4, 2), (16, 16, 4, 2)], 128: [(16, 32, 4, 2), (16, 16, 4, 2)], 256: [(16, 16, 4, 2)]},
    },
}

# Under the interpreter: BLOCK_M != BLOCK_N so that the tests cross the causal diagonal unevenly.
_INTERPRET_TILES = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16)}

# Every (BLOCK_M, BLOCK_N) of the GPU tables: the tests pin each one under the interpreter.
TILE_SHAPES = sorted({t[:2] for kernel in _TILES.values() for by_dim in kernel.values()
                      for tiles in by_dim.values() for t in tiles})


def _configs(kernel: str) -> list[triton.Config]:
    """Every tile of `kernel`'s tables (keep() picks per launch), or the interpreter's one."""
    tiles = sorted({t[:4] for by_dim in _TILES[kernel].values() for ts in by_dim.values() for t in ts}, reverse=True)
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in tiles]
    bm, bn = _INTERPRET_TILES[kernel]
    return tune_configs(configs, triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=1))


def _allowed_tiles(kernel: str, fp32: bool, block_d: int, has_bias: bool) -> set:
    by_dim = _TILES[kernel]["fp32" if fp32 else "16bit"]
    tiles = by_dim[min(d for d in by_dim if d >= block_d)]
    return {t[:4] for t in tiles if not (has_bias and _NO_BIAS in t[4:])}


def _keep(kernel: str):
    """early_config_prune: the tiles of the table for this dtype, head dim and bias, no larger than the
    (bucketed) sequence; the smallest allowed one when the sequence is shorter than all of them."""

    def keep(configs, named_args, **kwargs):
        def arg(name):
            return kwargs[name] if name in kwargs else named_args[name]

        allowed = _allowed_tiles(kernel, named_args["q_ptr"].dtype == torch.float32, arg("BLOCK_D"), arg("HAS_BIAS"))
        bucket_q, bucket_k = named_args["seqlen_q_bucket"], named_args["seqlen_k_bucket"]
        mine = [c for c in configs
                if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in allowed]
        if not mine:  # the interpreter's single config
            return configs
        fits = [c for c in mine if c.kwargs["BLOCK_M"] <= bucket_q and c.kwargs["BLOCK_N"] <= bucket_k]
        return fits or [min(mine, key=lambda c: (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"], c.num_warps))]

    return keep


def _bucket(n: int) -> int:
    """Autotune key for a sequence length: a power of two in [16, 16384] (never 1, which Triton specialises)."""
    return min(max(next_power_of_2(n), 16), 16384)


# ----------------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _load_rows(ptrs, rows, seqlen, d_ok, CHECK_ROWS: tl.constexpr, PAD_D: tl.constexpr,
               LOAD_AS_FP32: tl.constexpr):
    """A (rows, BLOCK_D) tile; out-of-range rows and padded head-dim columns read 0."""
    if CHECK_ROWS:
        ok = (rows < seqlen)[:, None]
        if PAD_D:
            ok = ok & d_ok[None, :]
        x = tl.load(ptrs, mask=ok, other=0.0)
    elif PAD_D:
        x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    if LOAD_AS_FP32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _load_bias(bias_ptrs, rows, cols, seqlen_q, seqlen_k, CHECK_K: tl.constexpr, BIAS_BROADCAST_Q: tl.constexpr):
    """The (queries, keys) bias tile in fp32, or (1, keys) when one row serves every query. Rows are
    always checked (a program's last query block may be partial), keys when CHECK_K; out-of-range
    entries read 0 and the callers mask those scores."""
    if BIAS_BROADCAST_Q:
        if CHECK_K:
            b = tl.load(bias_ptrs, mask=cols < seqlen_k, other=0.0)
        else:
            b = tl.load(bias_ptrs)
        b = b.to(tl.float32)[None, :]
    else:
        if CHECK_K:
            b = tl.load(bias_ptrs, mask=(rows < seqlen_q)[:, None] & (cols < seqlen_k)[None, :], other=0.0)
        else:
            b = tl.load(bias_ptrs, mask=(rows < seqlen_q)[:, None], other=0.0)
        b = b.to(tl.float32)
    return b


# Sizes that change with every batch are not specialised on (value 1, multiple of 16): each
# specialisation is another compile when a new length arrives. Strides stay specialised: their
# divisibility is what proves vector loads aligned.
_SHAPE_ARGS = ["seqlen_q", "seqlen_k", "seqlen_q_bucket", "seqlen_k_bucket"]


# ----------------------------------------------------------------------------------------------------
# Forward kernel
# ----------------------------------------------------------------------------------------------------

@triton.jit
def _attention_train_fwd_inner(
    acc, l_i, m_i, q,
    k_blk, v_blk, bias_blk, k_offs, v_offs, bias_offs, stride_k_seq, stride_v_seq, stride_bias_k,
    lo, hi, rows, offs_n, d_ok, seqlen_q, seqlen_k, scale,
    BLOCK_N: tl.constexpr, PAD_D: tl.constexpr, CHECK_K: tl.constexpr, APPLY_CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_BROADCAST_Q: tl.constexpr, LOAD_AS_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """FA-2's online softmax over key blocks [lo, hi). `*_blk` are scalar pointers at key lo and
    `*_offs` the int32 offsets of one block from there: loop-carried tiles of 64-bit pointers would
    cost registers (ptxas, sm_90)."""
    ELEMENT_MASKED: tl.constexpr = (HAS_BIAS or CHECK_K) or APPLY_CAUSAL
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_rows(k_blk + k_offs, cols, seqlen_k, d_ok, CHECK_K, PAD_D, LOAD_AS_FP32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if ELEMENT_MASKED:
            s = qk * scale
            if HAS_BIAS:
                s = s + _load_bias(bias_blk + bias_offs, rows, cols, seqlen_q, seqlen_k, CHECK_K, BIAS_BROADCAST_Q)
            if CHECK_K:
                s = tl.where((cols < seqlen_k)[None, :], s, float("-inf"))
            if APPLY_CAUSAL:
                s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            # A row with every score -inf so far keeps m_ij = -inf: subtract 0 instead, so that
            # exp(-inf - (-inf)) does not make NaN (its p and l_i stay 0).
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.exp(s - m_sub[:, None])
        else:
            # No -inf or huge values here: scale and log2(e) folded into one FMA per score.
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * scale)
            m_sub = m_ij
            p = tl.math.exp2(qk * (scale * LOG2E) - (m_sub * LOG2E)[:, None])
        alpha = tl.exp(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(v_blk + v_offs, cols, seqlen_k, d_ok, CHECK_K, PAD_D, LOAD_AS_FP32)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_ij
        k_blk += BLOCK_N * stride_k_seq
        v_blk += BLOCK_N * stride_v_seq
        bias_blk += BLOCK_N * stride_bias_k
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _attention_train_fwd_kernel(
    q_ptr, stride_q_batch, stride_q_head, stride_q_seq,
    k_ptr, stride_k_batch, stride_k_head, stride_k_seq,
    v_ptr, stride_v_batch, stride_v_head, stride_v_seq,
    bias_ptr, stride_bias_batch, stride_bias_head, stride_bias_q, stride_bias_k,
    out_ptr, stride_out_batch, stride_out_head, stride_out_seq,
    lse_ptr, stats_ptr,
    nheads, kv_group, seqlen_q, seqlen_k, scale,
    seqlen_q_bucket, seqlen_k_bucket,  # autotune keys only
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BIAS_BROADCAST_Q: tl.constexpr,
    LOAD_AS_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # 1-D grid, query blocks of one (batch, head) adjacent: programs resident together read the same
    # K/V (and the heads of one GQA group are adjacent too), so K/V come from L2.
    num_m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    pid = tl.program_id(0)
    pid_bh = pid // num_m_blocks
    pid_m = pid % num_m_blocks
    if IS_CAUSAL:
        # Causal work grows with the query block: start the longest ones first to shorten the tail.
        pid_m = num_m_blocks - 1 - pid_m
    off_b = (pid_bh // nheads).to(tl.int64)
    off_h = (pid_bh % nheads).to(tl.int64)
    off_h_kv = off_h // kv_group

    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    rows = start_m + offs_m
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    d_ok = offs_d < HEAD_DIM
    rows64 = rows.to(tl.int64)

    q_ptrs = q_ptr + off_b * stride_q_batch + off_h * stride_q_head + rows64[:, None] * stride_q_seq + offs_d[None, :]
    q = _load_rows(q_ptrs, rows, seqlen_q, d_ok, True, PAD_D, LOAD_AS_FP32)

    # Keys [0, mid) are whole blocks below the diagonal: no per-element tests. [mid, hi): the sequence
    # end and the diagonal, with tests.
    hi = seqlen_k
    mid = (seqlen_k // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        # Row i sees keys j <= i; blocks ending at or before start_m + 1 are visible to every row.
        hi = tl.minimum(hi, start_m + BLOCK_M)
        mid = tl.minimum(mid, ((start_m + 1) // BLOCK_N) * BLOCK_N)

    k_blk = k_ptr + off_b * stride_k_batch + off_h_kv * stride_k_head
    v_blk = v_ptr + off_b * stride_v_batch + off_h_kv * stride_v_head
    bias_blk = bias_ptr + off_b * stride_bias_batch + off_h * stride_bias_head + start_m.to(tl.int64) * stride_bias_q
    k_offs = offs_n[:, None] * stride_k_seq + offs_d[None, :]
    v_offs = offs_n[:, None] * stride_v_seq + offs_d[None, :]
    if BIAS_BROADCAST_Q:
        bias_offs = offs_n * stride_bias_k
    else:
        bias_offs = offs_m[:, None] * stride_bias_q + offs_n[None, :] * stride_bias_k

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, l_i, m_i = _attention_train_fwd_inner(
        acc, l_i, m_i, q, k_blk, v_blk, bias_blk, k_offs, v_offs, bias_offs, stride_k_seq, stride_v_seq,
        stride_bias_k, 0, mid, rows, offs_n, d_ok, seqlen_q, seqlen_k, scale,
        BLOCK_N, PAD_D, False, False, HAS_BIAS, BIAS_BROADCAST_Q, LOAD_AS_FP32, DOT_PRECISION,
    )
    mid64 = mid.to(tl.int64)
    acc, l_i, m_i = _attention_train_fwd_inner(
        acc, l_i, m_i, q, k_blk + mid64 * stride_k_seq, v_blk + mid64 * stride_v_seq,
        bias_blk + mid64 * stride_bias_k, k_offs, v_offs, bias_offs, stride_k_seq, stride_v_seq,
        stride_bias_k, mid, hi, rows, offs_n, d_ok, seqlen_q, seqlen_k, scale,
        BLOCK_N, PAD_D, True, IS_CAUSAL, HAS_BIAS, BIAS_BROADCAST_Q, LOAD_AS_FP32, DOT_PRECISION,
    )

    # l_i == 0 exactly when every score of the row is -inf (otherwise the maximum contributes 1): the
    # row gets out = 0 and lse = m_i + log(1) = -inf.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc * (1.0 / l_safe)[:, None]
    log_l = tl.log(l_safe)
    lse = m_i + log_l
    out_ptrs = (out_ptr + off_b * stride_out_batch + off_h * stride_out_head
                + rows64[:, None] * stride_out_seq + offs_d[None, :])
    row_ok = rows < seqlen_q
    if PAD_D:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + pid_bh.to(tl.int64) * seqlen_q + rows, lse, mask=row_ok)
    # The backward's statistics: m and log(l) apart (see the module docstring), m = 0 for a row that
    # sees no key, so that the backward's exp(s - m - log(l)) is exp(-inf) = 0 there.
    stats_row = stats_ptr + pid_bh.to(tl.int64) * (2 * seqlen_q) + rows
    tl.store(stats_row, tl.where(m_i == float("-inf"), 0.0, m_i), mask=row_ok)
    tl.store(stats_row + seqlen_q, log_l, mask=row_ok)


_FWD_KEYS = ["seqlen_q_bucket", "seqlen_k_bucket", "HEAD_DIM", "IS_CAUSAL", "HAS_BIAS", "BIAS_BROADCAST_Q"]
_attention_train_fwd_kernel_autotuned = triton.autotune(
    configs=_configs("fwd"),
    key=_FWD_KEYS,
    prune_configs_by={"early_config_prune": _keep("fwd")},
)(_attention_train_fwd_kernel)


# ----------------------------------------------------------------------------------------------------
# Backward kernels
# ----------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["seqlen_q"])
def _attention_train_bwd_preprocess_kernel(
    out_ptr, stride_out_batch, stride_out_head, stride_out_seq,
    do_ptr, stride_do_batch, stride_do_head, stride_do_seq,
    dlse_ptr, delta_ptr,
    nheads, seqlen_q,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """delta = rowsum(dO * O) - dlse in fp32, (batch, nheads, seqlen_q) contiguous."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // nheads).to(tl.int64)
    off_h = (pid_bh % nheads).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (rows < seqlen_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows64 = rows.to(tl.int64)
    o = tl.load(out_ptr + off_b * stride_out_batch + off_h * stride_out_head + rows64[:, None] * stride_out_seq
                + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + off_b * stride_do_batch + off_h * stride_do_head + rows64[:, None] * stride_do_seq
                 + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    row_offs = pid_bh.to(tl.int64) * seqlen_q + rows
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + row_offs, mask=rows < seqlen_q, other=0.0)
    tl.store(delta_ptr + row_offs, delta, mask=rows < seqlen_q)


@triton.jit
def _recompute_p_t(qk_t, m, log_l, bias_ptrs, rows, cols, col_ok, seqlen_q, scale,
                   CHECK_Q: tl.constexpr, APPLY_CAUSAL: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BIAS_BROADCAST_Q: tl.constexpr):
    """P^T = exp(s^T - m - log(l)) for one (BLOCK_N keys, BLOCK_M queries) tile of the dK/dV kernel.

    Keys past seqlen_k (this program's block may be partial) are only masked in the bias load: their
    P only reaches the dK/dV rows and dS columns of those keys, which are never stored. Queries past
    seqlen_q need no mask either: their q = dO = 0 and m = log(l) = delta = 0 give a finite P and dS = 0."""
    ELEMENT_MASKED: tl.constexpr = HAS_BIAS or APPLY_CAUSAL
    if ELEMENT_MASKED:
        s_t = qk_t * scale
        if HAS_BIAS:
            if BIAS_BROADCAST_Q:
                b = tl.load(bias_ptrs, mask=col_ok, other=0.0).to(tl.float32)[:, None]
            elif CHECK_Q:
                b = tl.load(bias_ptrs, mask=col_ok[:, None] & (rows < seqlen_q)[None, :], other=0.0).to(tl.float32)
            else:
                b = tl.load(bias_ptrs, mask=col_ok[:, None], other=0.0).to(tl.float32)
            s_t = s_t + b
        if APPLY_CAUSAL:
            s_t = tl.where(cols[:, None] <= rows[None, :], s_t, float("-inf"))
        # s - m first: exact where the row's scores are all one huge finite value (finfo.min masks).
        p_t = tl.exp((s_t - m[None, :]) - log_l[None, :])
    else:
        p_t = tl.math.exp2(qk_t * (scale * LOG2E) - ((m + log_l) * LOG2E)[None, :])
    return p_t


@triton.jit
def _attention_train_bwd_dkdv_inner(
    dk, dv, ds_col_sum, k, v,
    q_blk, do_blk, bias_blk, ds_blk, stats_ptr, delta_ptr,
    q_offs, do_offs, bias_offs, ds_offs,
    stride_q_seq, stride_do_seq, stride_bias_q, stride_ds_q,
    lo, hi, offs_m, cols, col_ok, d_ok, seqlen_q, scale,
    BLOCK_M: tl.constexpr, PAD_D: tl.constexpr, CHECK_Q: tl.constexpr, APPLY_CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_BROADCAST_Q: tl.constexpr, STORE_DS: tl.constexpr, DS_SUM_Q: tl.constexpr,
    LOAD_AS_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Query blocks [lo, hi) against this program's keys. `*_blk` are scalar pointers at query lo (bias
    and dS also at this program's first key), `*_offs` the int32 offsets of one block from there, and
    `stats_ptr` / `delta_ptr` point at query 0 of this (batch, head). Scalar pointers plus one offset
    tile, rather than loop-carried tiles of 64-bit pointers, save registers (ptxas, sm_90).

    Tiles are transposed (keys x queries: s^T = k q^T, as in FA-2's backward): P^T and dS^T are then
    the A operands of dV += P^T dO and dK += dS^T Q straight from registers; (queries x keys) tiles
    would need a transpose through shared memory for each, which costs registers and spills."""
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        q = _load_rows(q_blk + q_offs, rows, seqlen_q, d_ok, CHECK_Q, PAD_D, LOAD_AS_FP32)
        do = _load_rows(do_blk + do_offs, rows, seqlen_q, d_ok, CHECK_Q, PAD_D, LOAD_AS_FP32)
        if CHECK_Q:
            m = tl.load(stats_ptr + rows, mask=rows < seqlen_q, other=0.0)
            log_l = tl.load(stats_ptr + seqlen_q + rows, mask=rows < seqlen_q, other=0.0)
            delta = tl.load(delta_ptr + rows, mask=rows < seqlen_q, other=0.0)
        else:
            m = tl.load(stats_ptr + rows)
            log_l = tl.load(stats_ptr + seqlen_q + rows)
            delta = tl.load(delta_ptr + rows)

        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        p_t = _recompute_p_t(qk_t, m, log_l, bias_blk + bias_offs, rows, cols, col_ok, seqlen_q, scale,
                             CHECK_Q, APPLY_CAUSAL, HAS_BIAS, BIAS_BROADCAST_Q)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
        if STORE_DS:
            if DS_SUM_Q:
                # Queries past seqlen_q have dS = 0 (dO = 0, delta = 0): the sum needs no mask.
                ds_col_sum += tl.sum(ds_t, 1)
            elif CHECK_Q:
                tl.store(ds_blk + ds_offs, ds_t.to(ds_blk.dtype.element_ty),
                         mask=col_ok[:, None] & (rows < seqlen_q)[None, :])
            else:
                tl.store(ds_blk + ds_offs, ds_t.to(ds_blk.dtype.element_ty), mask=col_ok[:, None])
        q_blk += BLOCK_M * stride_q_seq
        do_blk += BLOCK_M * stride_do_seq
        bias_blk += BLOCK_M * stride_bias_q  # 0 when the bias broadcasts over queries
        ds_blk += BLOCK_M * stride_ds_q      # unused when dS is summed over queries
    return dk, dv, ds_col_sum


@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _attention_train_bwd_dkdv_kernel(
    q_ptr, stride_q_batch, stride_q_head, stride_q_seq,
    k_ptr, stride_k_batch, stride_k_head, stride_k_seq,
    v_ptr, stride_v_batch, stride_v_head, stride_v_seq,
    bias_ptr, stride_bias_batch, stride_bias_head, stride_bias_q, stride_bias_k,
    do_ptr, stride_do_batch, stride_do_head, stride_do_seq,
    dk_ptr, stride_dk_batch, stride_dk_head, stride_dk_seq,
    dv_ptr, stride_dv_batch, stride_dv_head, stride_dv_seq,
    dk_add_ptr, stride_dk_add_batch, stride_dk_add_head, stride_dk_add_seq,
    dv_add_ptr, stride_dv_add_batch, stride_dv_add_head, stride_dv_add_seq,
    ds_ptr, stride_ds_batch, stride_ds_head, stride_ds_q, stride_ds_k,
    stats_ptr, delta_ptr,
    nheads_kv, kv_group, seqlen_q, seqlen_k, scale,
    seqlen_q_bucket, seqlen_k_bucket,  # autotune keys only
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BIAS_BROADCAST_Q: tl.constexpr,
    STORE_DS: tl.constexpr,
    DS_SUM_Q: tl.constexpr,
    HAS_DK_ADD: tl.constexpr,
    HAS_DV_ADD: tl.constexpr,
    LOAD_AS_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dK, dV (and dS) of BLOCK_N keys of one kv head: loops over the query heads of its group and,
    for each, over the query blocks that can see these keys (FA-2 Algorithm 2's outer loop). With
    HAS_DK_ADD / HAS_DV_ADD a gradient k or v gets from elsewhere (a returned KV cache's) is added
    before the one rounding to the output dtype."""
    num_n_blocks = tl.cdiv(seqlen_k, BLOCK_N)
    pid = tl.program_id(0)
    pid_bh_kv = pid // num_n_blocks
    pid_n = pid % num_n_blocks
    off_b = (pid_bh_kv // nheads_kv).to(tl.int64)
    off_h_kv = (pid_bh_kv % nheads_kv).to(tl.int64)
    nheads = nheads_kv * kv_group

    start_n = pid_n * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    cols = start_n + offs_n
    col_ok = cols < seqlen_k
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    d_ok = offs_d < HEAD_DIM
    cols64 = cols.to(tl.int64)

    k = _load_rows(k_ptr + off_b * stride_k_batch + off_h_kv * stride_k_head + cols64[:, None] * stride_k_seq
                   + offs_d[None, :], cols, seqlen_k, d_ok, True, PAD_D, LOAD_AS_FP32)
    v = _load_rows(v_ptr + off_b * stride_v_batch + off_h_kv * stride_v_head + cols64[:, None] * stride_v_seq
                   + offs_d[None, :], cols, seqlen_k, d_ok, True, PAD_D, LOAD_AS_FP32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query blocks: [lo, diag_end) cross the diagonal (causal tests); [diag_end, full_end) are whole
    # blocks that see every key here (no tests); [full_end, q_end) is the partial last block.
    q_end = tl.cdiv(seqlen_q, BLOCK_M) * BLOCK_M
    lo = 0
    diag_end = 0
    if IS_CAUSAL:
        # Rows i < start_n see none of these keys; rows i >= start_n + BLOCK_N - 1 see all of them.
        lo = tl.minimum((start_n // BLOCK_M) * BLOCK_M, q_end)
        diag_end = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, q_end)
    full_end = tl.maximum((seqlen_q // BLOCK_M) * BLOCK_M, diag_end)

    # One block's offsets (int32: a block spans BLOCK_M rows); bias and dS tiles are (keys, queries)
    # like s^T. A bias broadcast over queries has stride_bias_q = 0 and is read as one vector.
    q_offs = offs_m[:, None] * stride_q_seq + offs_d[None, :]
    do_offs = offs_m[:, None] * stride_do_seq + offs_d[None, :]
    if BIAS_BROADCAST_Q:
        bias_offs = offs_n * stride_bias_k
    else:
        bias_offs = offs_n[:, None] * stride_bias_k + offs_m[None, :] * stride_bias_q
    ds_offs = offs_n[:, None] * stride_ds_k + offs_m[None, :] * stride_ds_q
    lo64 = lo + tl.zeros([], dtype=tl.int64)

    for g in range(0, kv_group):
        off_h = off_h_kv * kv_group + g
        off_bh = off_b * nheads + off_h
        stats_row_ptr = stats_ptr + off_bh * (2 * seqlen_q)
        delta_row_ptr = delta_ptr + off_bh * seqlen_q
        q_blk = q_ptr + off_b * stride_q_batch + off_h * stride_q_head + lo64 * stride_q_seq
        do_blk = do_ptr + off_b * stride_do_batch + off_h * stride_do_head + lo64 * stride_do_seq
        bias_blk = (bias_ptr + off_b * stride_bias_batch + off_h * stride_bias_head
                    + start_n.to(tl.int64) * stride_bias_k + lo64 * stride_bias_q)
        ds_head = ds_ptr + off_b * stride_ds_batch + off_h * stride_ds_head + start_n.to(tl.int64) * stride_ds_k
        ds_blk = ds_head + lo64 * stride_ds_q
        ds_col_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
        if STORE_DS:
            if not DS_SUM_Q:
                if IS_CAUSAL:
                    # Rows that see none of these keys have dS = 0: written here, never computed.
                    zero_blk = ds_head
                    for start_m in range(0, lo, BLOCK_M):
                        tl.store(zero_blk + ds_offs, tl.zeros([BLOCK_N, BLOCK_M], dtype=ds_ptr.dtype.element_ty),
                                 mask=col_ok[:, None] & (start_m + offs_m < seqlen_q)[None, :])
                        zero_blk += BLOCK_M * stride_ds_q

        if IS_CAUSAL:
            dk, dv, ds_col_sum = _attention_train_bwd_dkdv_inner(
                dk, dv, ds_col_sum, k, v, q_blk, do_blk, bias_blk, ds_blk, stats_row_ptr, delta_row_ptr,
                q_offs, do_offs, bias_offs, ds_offs, stride_q_seq, stride_do_seq, stride_bias_q, stride_ds_q,
                lo, diag_end, offs_m, cols, col_ok, d_ok, seqlen_q, scale,
                BLOCK_M, PAD_D, True, True, HAS_BIAS, BIAS_BROADCAST_Q, STORE_DS, DS_SUM_Q,
                LOAD_AS_FP32, DOT_PRECISION,
            )
            step = (diag_end - lo).to(tl.int64)
            q_blk += step * stride_q_seq
            do_blk += step * stride_do_seq
            bias_blk += step * stride_bias_q
            ds_blk += step * stride_ds_q
        dk, dv, ds_col_sum = _attention_train_bwd_dkdv_inner(
            dk, dv, ds_col_sum, k, v, q_blk, do_blk, bias_blk, ds_blk, stats_row_ptr, delta_row_ptr,
            q_offs, do_offs, bias_offs, ds_offs, stride_q_seq, stride_do_seq, stride_bias_q, stride_ds_q,
            diag_end, full_end, offs_m, cols, col_ok, d_ok, seqlen_q, scale,
            BLOCK_M, PAD_D, False, False, HAS_BIAS, BIAS_BROADCAST_Q, STORE_DS, DS_SUM_Q,
            LOAD_AS_FP32, DOT_PRECISION,
        )
        step = (full_end - diag_end).to(tl.int64)
        q_blk += step * stride_q_seq
        do_blk += step * stride_do_seq
        bias_blk += step * stride_bias_q
        ds_blk += step * stride_ds_q
        dk, dv, ds_col_sum = _attention_train_bwd_dkdv_inner(
            dk, dv, ds_col_sum, k, v, q_blk, do_blk, bias_blk, ds_blk, stats_row_ptr, delta_row_ptr,
            q_offs, do_offs, bias_offs, ds_offs, stride_q_seq, stride_do_seq, stride_bias_q, stride_ds_q,
            full_end, q_end, offs_m, cols, col_ok, d_ok, seqlen_q, scale,
            BLOCK_M, PAD_D, True, False, HAS_BIAS, BIAS_BROADCAST_Q, STORE_DS, DS_SUM_Q,
            LOAD_AS_FP32, DOT_PRECISION,
        )
        if STORE_DS:
            if DS_SUM_Q:
                tl.store(ds_head + offs_n * stride_ds_k, ds_col_sum.to(ds_ptr.dtype.element_ty), mask=col_ok)

    dk = dk * scale
    ok = col_ok[:, None] & d_ok[None, :]
    dk_ptrs = (dk_ptr + off_b * stride_dk_batch + off_h_kv * stride_dk_head + cols64[:, None] * stride_dk_seq
               + offs_d[None, :])
    dv_ptrs = (dv_ptr + off_b * stride_dv_batch + off_h_kv * stride_dv_head + cols64[:, None] * stride_dv_seq
               + offs_d[None, :])
    if HAS_DK_ADD:
        dk += tl.load(dk_add_ptr + off_b * stride_dk_add_batch + off_h_kv * stride_dk_add_head
                      + cols64[:, None] * stride_dk_add_seq + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_DV_ADD:
        dv += tl.load(dv_add_ptr + off_b * stride_dv_add_batch + off_h_kv * stride_dv_add_head
                      + cols64[:, None] * stride_dv_add_seq + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(dk_ptrs, dk.to(dk_ptr.dtype.element_ty), mask=ok)
    tl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _recompute_p(qk, m, log_l, bias_ptrs, rows, cols, seqlen_q, seqlen_k, scale,
                 CHECK_K: tl.constexpr, APPLY_CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BIAS_BROADCAST_Q: tl.constexpr):
    """P = exp(s - m - log(l)) for one (BLOCK_M queries, BLOCK_N keys) tile of the dQ kernel (m = 0 for
    rows that see no key). CHECK_K sets P = 0 for keys past seqlen_k: their k is 0, but their P would be
    exp(-m - log(l)), which overflows for a row of very negative scores and makes 0 * inf = NaN in dS @ K.
    Rows past seqlen_q are never stored."""
    ELEMENT_MASKED: tl.constexpr = (HAS_BIAS or CHECK_K) or APPLY_CAUSAL  # no chained bool ops in older Triton
    if ELEMENT_MASKED:
        s = qk * scale
        if HAS_BIAS:
            s = s + _load_bias(bias_ptrs, rows, cols, seqlen_q, seqlen_k, CHECK_K, BIAS_BROADCAST_Q)
        if CHECK_K:
            s = tl.where((cols < seqlen_k)[None, :], s, float("-inf"))
        if APPLY_CAUSAL:
            s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
        p = tl.exp((s - m[:, None]) - log_l[:, None])
    else:
        p = tl.math.exp2(qk * (scale * LOG2E) - ((m + log_l) * LOG2E)[:, None])
    return p


@triton.jit
def _attention_train_bwd_dq_inner(
    dq, q, do, m, log_l, delta,
    k_blk, v_blk, bias_blk, k_offs, v_offs, bias_offs, stride_k_seq, stride_v_seq, stride_bias_k,
    lo, hi, rows, offs_n, d_ok, seqlen_q, seqlen_k, scale,
    BLOCK_N: tl.constexpr, PAD_D: tl.constexpr, CHECK_K: tl.constexpr, APPLY_CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_BROADCAST_Q: tl.constexpr, LOAD_AS_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Key blocks [lo, hi) for this program's queries; scalar `*_blk` pointers at key lo plus one
    block's int32 `*_offs`, as in the forward."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_rows(k_blk + k_offs, cols, seqlen_k, d_ok, CHECK_K, PAD_D, LOAD_AS_FP32)
        v = _load_rows(v_blk + v_offs, cols, seqlen_k, d_ok, CHECK_K, PAD_D, LOAD_AS_FP32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p = _recompute_p(qk, m, log_l, bias_blk + bias_offs, rows, cols, seqlen_q, seqlen_k, scale,
                         CHECK_K, APPLY_CAUSAL, HAS_BIAS, BIAS_BROADCAST_Q)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        k_blk += BLOCK_N * stride_k_seq
        v_blk += BLOCK_N * stride_v_seq
        bias_blk += BLOCK_N * stride_bias_k
    return dq


@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _attention_train_bwd_dq_kernel(
    q_ptr, stride_q_batch, stride_q_head, stride_q_seq,
    k_ptr, stride_k_batch, stride_k_head, stride_k_seq,
    v_ptr, stride_v_batch, stride_v_head, stride_v_seq,
    bias_ptr, stride_bias_batch, stride_bias_head, stride_bias_q, stride_bias_k,
    do_ptr, stride_do_batch, stride_do_head, stride_do_seq,
    dq_ptr, stride_dq_batch, stride_dq_head, stride_dq_seq,
    stats_ptr, delta_ptr,
    nheads, kv_group, seqlen_q, seqlen_k, scale,
    seqlen_q_bucket, seqlen_k_bucket,  # autotune keys only
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BIAS_BROADCAST_Q: tl.constexpr,
    LOAD_AS_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dQ of BLOCK_M queries: the forward's loop structure with dS in place of the online softmax."""
    num_m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    pid = tl.program_id(0)
    pid_bh = pid // num_m_blocks
    pid_m = pid % num_m_blocks
    if IS_CAUSAL:
        pid_m = num_m_blocks - 1 - pid_m  # longest first, as in the forward
    off_b = (pid_bh // nheads).to(tl.int64)
    off_h = (pid_bh % nheads).to(tl.int64)
    off_h_kv = off_h // kv_group

    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    rows = start_m + offs_m
    row_ok = rows < seqlen_q
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    d_ok = offs_d < HEAD_DIM
    rows64 = rows.to(tl.int64)

    q = _load_rows(q_ptr + off_b * stride_q_batch + off_h * stride_q_head + rows64[:, None] * stride_q_seq
                   + offs_d[None, :], rows, seqlen_q, d_ok, True, PAD_D, LOAD_AS_FP32)
    do = _load_rows(do_ptr + off_b * stride_do_batch + off_h * stride_do_head + rows64[:, None] * stride_do_seq
                    + offs_d[None, :], rows, seqlen_q, d_ok, True, PAD_D, LOAD_AS_FP32)
    stats_row = stats_ptr + pid_bh.to(tl.int64) * (2 * seqlen_q) + rows
    m = tl.load(stats_row, mask=row_ok, other=0.0)
    log_l = tl.load(stats_row + seqlen_q, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + pid_bh.to(tl.int64) * seqlen_q + rows, mask=row_ok, other=0.0)

    hi = seqlen_k
    mid = (seqlen_k // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        hi = tl.minimum(hi, start_m + BLOCK_M)
        mid = tl.minimum(mid, ((start_m + 1) // BLOCK_N) * BLOCK_N)

    k_blk = k_ptr + off_b * stride_k_batch + off_h_kv * stride_k_head
    v_blk = v_ptr + off_b * stride_v_batch + off_h_kv * stride_v_head
    bias_blk = bias_ptr + off_b * stride_bias_batch + off_h * stride_bias_head + start_m.to(tl.int64) * stride_bias_q
    k_offs = offs_n[:, None] * stride_k_seq + offs_d[None, :]
    v_offs = offs_n[:, None] * stride_v_seq + offs_d[None, :]
    if BIAS_BROADCAST_Q:
        bias_offs = offs_n * stride_bias_k
    else:
        bias_offs = offs_m[:, None] * stride_bias_q + offs_n[None, :] * stride_bias_k

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dq = _attention_train_bwd_dq_inner(
        dq, q, do, m, log_l, delta, k_blk, v_blk, bias_blk, k_offs, v_offs, bias_offs, stride_k_seq, stride_v_seq,
        stride_bias_k, 0, mid, rows, offs_n, d_ok, seqlen_q, seqlen_k, scale,
        BLOCK_N, PAD_D, False, False, HAS_BIAS, BIAS_BROADCAST_Q, LOAD_AS_FP32, DOT_PRECISION,
    )
    mid64 = mid.to(tl.int64)
    dq = _attention_train_bwd_dq_inner(
        dq, q, do, m, log_l, delta, k_blk + mid64 * stride_k_seq, v_blk + mid64 * stride_v_seq,
        bias_blk + mid64 * stride_bias_k, k_offs, v_offs, bias_offs, stride_k_seq, stride_v_seq,
        stride_bias_k, mid, hi, rows, offs_n, d_ok, seqlen_q, seqlen_k, scale,
        BLOCK_N, PAD_D, True, IS_CAUSAL, HAS_BIAS, BIAS_BROADCAST_Q, LOAD_AS_FP32, DOT_PRECISION,
    )
    dq = dq * scale
    dq_ptrs = (dq_ptr + off_b * stride_dq_batch + off_h * stride_dq_head + rows64[:, None] * stride_dq_seq
               + offs_d[None, :])
    tl.store(dq_ptrs, dq.to(dq_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


_BWD_KEYS = ["seqlen_q_bucket", "seqlen_k_bucket", "HEAD_DIM", "IS_CAUSAL", "HAS_BIAS", "BIAS_BROADCAST_Q"]
_attention_train_bwd_dkdv_kernel_autotuned = triton.autotune(
    configs=_configs("dkdv"),
    key=_BWD_KEYS + ["kv_group", "STORE_DS", "DS_SUM_Q", "HAS_DK_ADD", "HAS_DV_ADD"],
    prune_configs_by={"early_config_prune": _keep("dkdv")},
)(_attention_train_bwd_dkdv_kernel)

_attention_train_bwd_dq_kernel_autotuned = triton.autotune(
    configs=_configs("dq"),
    key=_BWD_KEYS,
    prune_configs_by={"early_config_prune": _keep("dq")},
)(_attention_train_bwd_dq_kernel)


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------

def _bias_shape4(bias: torch.Tensor) -> tuple[int, int, int, int]:
    return (1,) * (4 - bias.dim()) + tuple(bias.shape)


def _bias_strides(bias: torch.Tensor, target: tuple[int, int, int, int]) -> list[int]:
    """Strides of `bias.expand(target)` without building the view (0 where it broadcasts)."""
    shape = _bias_shape4(bias)
    strides = (0,) * (4 - bias.dim()) + tuple(bias.stride())
    out = []
    for size, stride, want in zip(shape, strides, target):
        if size == want and want != 1:
            out.append(stride)
        elif size == 1:
            out.append(0)
        else:
            raise ValueError(f"attention bias of shape {tuple(bias.shape)} does not broadcast to {target}")
    return out


def check_attention_train_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               bias: Optional[torch.Tensor], scale: float) -> None:
    """Raise on shapes, dtypes or devices the kernels do not handle (shared with the fake implementations)."""
    if not scale >= 0:
        # The unmasked blocks take the row maximum of q @ k^T before scaling: right for scale >= 0 only.
        raise ValueError(f"attention_train needs scale >= 0, got {scale}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention_train expects q, k, v of shape (batch, nheads, seqlen, headdim)")
    batch, nheads, seqlen_q, head_dim = q.shape
    batch_k, nheads_kv, seqlen_k, head_dim_k = k.shape
    if batch_k != batch or tuple(v.shape) != tuple(k.shape) or head_dim_k != head_dim:
        raise ValueError(f"attention_train shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})")
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"attention_train supports head dims 1 to {MAX_HEAD_DIM}, got {head_dim}")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"attention_train supports {_DTYPES} with one dtype for q, k, v; "
                        f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if bias is not None:
        if bias.dtype not in _DTYPES:
            raise TypeError(f"attention_train bias must be fp16, bf16 or fp32 (convert a bool mask to an "
                            f"additive one with -inf), got {bias.dtype}")
        if bias.dim() > 4:
            raise ValueError(f"attention_train bias must have at most 4 dims, got shape {tuple(bias.shape)}")
        _bias_strides(bias, (batch, nheads, seqlen_q, seqlen_k))
    for name, t in (("k", k), ("v", v), ("bias", bias)):
        if t is not None and t.device != q.device:
            raise ValueError(f"attention_train: {name} is on {t.device}, q on {q.device}")


def attention_train_empty_out(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, stats) as the forward allocates them: out (batch, nheads, seqlen_q, headdim) with the
    memory of a contiguous (batch, seqlen_q, nheads, headdim), so that
    `out.transpose(1, 2).reshape(batch, seqlen_q, -1)` is a free view; lse (batch, nheads, seqlen_q) and
    stats (batch, nheads, 2, seqlen_q) fp32 contiguous."""
    batch, nheads, seqlen_q, head_dim = q.shape
    out = q.new_empty((batch, seqlen_q, nheads, head_dim)).transpose(1, 2)
    return (out, q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32),
            q.new_empty((batch, nheads, 2, seqlen_q), dtype=torch.float32))


def attention_train_empty_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
                                bias_needs_grad: bool, with_qkv: bool = True):
    """(dq, dk, dv, dbias or None) as the backward allocates them: like q, k, v (torch.empty_like) and a
    contiguous tensor of bias's shape and dtype; (None, None, None, dbias) without with_qkv."""
    dbias = bias.new_empty(bias.shape) if (bias is not None and bias_needs_grad) else None
    if not with_qkv:
        return None, None, None, dbias
    return _grad_like(q), _grad_like(k), _grad_like(v), dbias


def _grad_like(x: torch.Tensor) -> torch.Tensor:
    # empty_like keeps a dense input's strides (a (batch, seqlen, nheads, headdim) buffer seen as
    # (batch, nheads, seqlen, headdim) gives a gradient of that layout); the kernels store with unit
    # stride along the head dim, so anything else is allocated contiguous.
    g = torch.empty_like(x)
    return g if g.stride(-1) == 1 or x.shape[-1] <= 1 else torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _addend(extra: Optional[torch.Tensor], stand_in: torch.Tensor) -> tuple:
    """(pointer, batch, head and seq strides) of an addend, or of a stand-in never read."""
    t = extra if extra is not None else stand_in
    return t, t.stride(0), t.stride(1), t.stride(2)


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    # The kernels assume unit stride along the head dim (vectorised loads); anything else is rare.
    # (The bias is read with its own key stride: Triton specialises a stride of 1 anyway.)
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(autotuned, plain, grid, args, flags, blocks: Optional[tuple[int, int]]):
    """Autotuned launch, or the plain kernel with (BLOCK_M, BLOCK_N) pinned (tests cover every tile shape)."""
    if blocks is None:
        autotuned[grid](*args, **flags)
    else:
        meta = {"BLOCK_M": blocks[0], "BLOCK_N": blocks[1]}
        plain[grid(meta)](*args, **flags, **meta, num_warps=4, num_stages=1)


def _common_flags(q: torch.Tensor, bias: Optional[torch.Tensor], bias_strides, is_causal: bool) -> dict:
    head_dim = q.shape[-1]
    return dict(
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        IS_CAUSAL=bool(is_causal),
        HAS_BIAS=bias is not None,
        # One bias row serves every query (padding-style (batch, 1, 1, seqlen_k)): load a vector, not a tile.
        BIAS_BROADCAST_Q=bias is not None and bias_strides[2] == 0,
        LOAD_AS_FP32=INTERPRET or q.dtype == torch.float32,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,  # fp32 asks for fp32 products, not tf32
    )


def attention_train_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: Optional[torch.Tensor],
    scale: float,
    is_causal: bool,
    *,
    blocks: Optional[tuple[int, int]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, stats) = (softmax(s) @ v, logsumexp(s), the backward's row statistics), s = scale * q @ k^T
    + bias (+ causal); see the module docstring. Autotuned per (bucketed seqlens, head dim, flags, dtype);
    `blocks` pins (BLOCK_M, BLOCK_N)."""
    check_attention_train_args(q, k, v, bias, scale)
    batch, nheads, seqlen_q, head_dim = q.shape
    nheads_kv, seqlen_k = k.shape[1], k.shape[2]
    out, lse, stats = attention_train_empty_out(q)
    if out.numel() == 0:  # no query (seqlen_k == 0 runs: every row gets out 0, lse -inf)
        return out, lse, stats
    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    if bias is not None:
        bias_strides = _bias_strides(bias, (batch, nheads, seqlen_q, seqlen_k))
    else:
        bias_strides = [0, 0, 0, 0]
    args = (
        q, q.stride(0), q.stride(1), q.stride(2),
        k, k.stride(0), k.stride(1), k.stride(2),
        v, v.stride(0), v.stride(1), v.stride(2),
        bias if bias is not None else q, *bias_strides,  # q: never read without HAS_BIAS
        out, out.stride(0), out.stride(1), out.stride(2),
        lse, stats,
        nheads, nheads // nheads_kv, seqlen_q, seqlen_k, float(scale),
        _bucket(seqlen_q), _bucket(seqlen_k),
    )
    flags = _common_flags(q, bias, bias_strides, is_causal)
    grid = lambda meta: (triton.cdiv(seqlen_q, meta["BLOCK_M"]) * batch * nheads,)  # noqa: E731
    _launch(_attention_train_fwd_kernel_autotuned, _attention_train_fwd_kernel, grid, args, flags, blocks)
    return out, lse, stats


def attention_train_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: Optional[torch.Tensor],
    out: torch.Tensor,
    stats: torch.Tensor,
    scale: float,
    is_causal: bool,
    bias_needs_grad: bool,
    dlse: Optional[torch.Tensor] = None,
    *,
    blocks: Optional[tuple[int, int]] = None,
    grads: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    dk_add: Optional[torch.Tensor] = None,
    dv_add: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(dq, dk, dv, dbias or None) from dO = `do` (and dlse = the gradient of lse, if any), with the
    forward's inputs, out and stats. dbias (bias's shape and dtype) only when bias_needs_grad.
    Deterministic: no atomics. `blocks` pins (BLOCK_M, BLOCK_N) of both main kernels. `grads`:
    (dq, dk, dv) to write into, shaped and typed like q, k, v, any strides with a unit last one (the
    three slices of one packed QKV gradient, ops.attention_train.attention_train_bwd_packed).
    dk_add / dv_add: gradients k and v get from elsewhere (k's and v's shapes), added to dk and dv in
    fp32 before they are rounded and stored."""
    check_attention_train_args(q, k, v, bias, scale)
    batch, nheads, seqlen_q, head_dim = q.shape
    nheads_kv, seqlen_k = k.shape[1], k.shape[2]
    if tuple(do.shape) != tuple(q.shape) or tuple(out.shape) != tuple(q.shape):
        raise ValueError(f"attention_train_bwd: do {tuple(do.shape)} and out {tuple(out.shape)} must have q's shape "
                         f"{tuple(q.shape)}")
    if tuple(stats.shape) != (batch, nheads, 2, seqlen_q) or stats.dtype != torch.float32:
        raise ValueError(f"attention_train_bwd: stats must be fp32 of shape {(batch, nheads, 2, seqlen_q)} "
                         f"(the forward's third output), got {stats.dtype} {tuple(stats.shape)}")
    if dlse is not None and tuple(dlse.shape) != (batch, nheads, seqlen_q):
        raise ValueError(f"attention_train_bwd: dlse shape {tuple(dlse.shape)} differs from lse's "
                         f"{(batch, nheads, seqlen_q)}")
    bias_needs_grad = bool(bias_needs_grad) and bias is not None
    dq, dk, dv, dbias = attention_train_empty_grads(q, k, v, bias, bias_needs_grad, with_qkv=grads is None)
    if grads is not None:
        for name, g, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
            if g.shape != like.shape or g.dtype != like.dtype or g.device != like.device or \
                    (g.stride(-1) != 1 and g.shape[-1] > 1):
                raise ValueError(f"attention_train_bwd: {name} must be {like.dtype} {tuple(like.shape)} on "
                                 f"{like.device} with a unit last stride, got {g.dtype} {tuple(g.shape)} "
                                 f"strides {g.stride()}")
        dq, dk, dv = grads
    for name, extra, like in (("dk_add", dk_add, k), ("dv_add", dv_add, v)):
        if extra is not None and extra.shape != like.shape:
            raise ValueError(f"attention_train_bwd: {name} must have the shape {tuple(like.shape)}, got "
                             f"{tuple(extra.shape)}")
    dk_add = _unit_last_stride(dk_add) if dk_add is not None else None
    dv_add = _unit_last_stride(dv_add) if dv_add is not None else None
    if q.numel() == 0 or k.numel() == 0:
        for t in (dq, dk, dv, dbias):
            if t is not None:
                t.zero_()
        return dq, dk, dv, dbias

    q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
    do, out = _unit_last_stride(do), _unit_last_stride(out)
    stats = stats.contiguous()
    target = (batch, nheads, seqlen_q, seqlen_k)
    if bias is not None:
        bias_strides = _bias_strides(bias, target)
    else:
        bias_strides = [0, 0, 0, 0]
    flags = _common_flags(q, bias, bias_strides, is_causal)
    head_flags = dict(HEAD_DIM=flags["HEAD_DIM"], BLOCK_D=flags["BLOCK_D"])

    # delta = rowsum(dO * O) - dlse
    delta = torch.empty((batch, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    dlse_arg = dlse.to(torch.float32).contiguous() if dlse is not None else delta  # never read without HAS_DLSE
    # Memory-bound: small tiles (two of 4096 values over 4 warps, ~90 registers) keep occupancy up.
    pre_block_m = 32 if INTERPRET else max(16, 4096 // flags["BLOCK_D"])
    _attention_train_bwd_preprocess_kernel[(triton.cdiv(seqlen_q, pre_block_m), batch * nheads)](
        out, out.stride(0), out.stride(1), out.stride(2),
        do, do.stride(0), do.stride(1), do.stride(2),
        dlse_arg, delta, nheads, seqlen_q,
        **head_flags, HAS_DLSE=dlse is not None, BLOCK_M=pre_block_m,
        num_warps=4, num_stages=1,
    )

    # dS target: (batch, nheads, 1 or seqlen_q, seqlen_k); the q dim is summed in the kernel when bias
    # broadcasts over queries, the other broadcast dims by torch afterwards.
    ds_sum_q = False
    reduce_dims: list[int] = []
    ds = delta  # never written without STORE_DS
    ds_strides = [0, 0, 0, 0]
    if bias_needs_grad:
        shape4 = _bias_shape4(bias)
        ds_sum_q = shape4[2] == 1
        ds_shape = (batch, nheads, 1 if ds_sum_q else seqlen_q, seqlen_k)
        reduce_dims = [d for d in range(4) if shape4[d] == 1 and ds_shape[d] != 1]
        if reduce_dims:
            ds = torch.empty(ds_shape, dtype=torch.float32, device=q.device)
        else:
            ds = dbias.view(ds_shape)  # no sum left: dS goes straight into dbias, in its dtype
        ds_strides = list(ds.stride())

    dkdv_args = (
        q, q.stride(0), q.stride(1), q.stride(2),
        k, k.stride(0), k.stride(1), k.stride(2),
        v, v.stride(0), v.stride(1), v.stride(2),
        bias if bias is not None else q, *bias_strides,
        do, do.stride(0), do.stride(1), do.stride(2),
        dk, dk.stride(0), dk.stride(1), dk.stride(2),
        dv, dv.stride(0), dv.stride(1), dv.stride(2),
        *(_addend(dk_add, dk)), *(_addend(dv_add, dv)),
        ds, *ds_strides,
        stats, delta,
        nheads_kv, nheads // nheads_kv, seqlen_q, seqlen_k, float(scale),
        _bucket(seqlen_q), _bucket(seqlen_k),
    )
    grid = lambda meta: (triton.cdiv(seqlen_k, meta["BLOCK_N"]) * batch * nheads_kv,)  # noqa: E731
    _launch(_attention_train_bwd_dkdv_kernel_autotuned, _attention_train_bwd_dkdv_kernel, grid, dkdv_args,
            dict(flags, STORE_DS=bias_needs_grad, DS_SUM_Q=ds_sum_q, HAS_DK_ADD=dk_add is not None,
                 HAS_DV_ADD=dv_add is not None), blocks)

    dq_args = (
        q, q.stride(0), q.stride(1), q.stride(2),
        k, k.stride(0), k.stride(1), k.stride(2),
        v, v.stride(0), v.stride(1), v.stride(2),
        bias if bias is not None else q, *bias_strides,
        do, do.stride(0), do.stride(1), do.stride(2),
        dq, dq.stride(0), dq.stride(1), dq.stride(2),
        stats, delta,
        nheads, nheads // nheads_kv, seqlen_q, seqlen_k, float(scale),
        _bucket(seqlen_q), _bucket(seqlen_k),
    )
    grid = lambda meta: (triton.cdiv(seqlen_q, meta["BLOCK_M"]) * batch * nheads,)  # noqa: E731
    _launch(_attention_train_bwd_dq_kernel_autotuned, _attention_train_bwd_dq_kernel, grid, dq_args, flags, blocks)

    if bias_needs_grad and reduce_dims:
        dbias.view(_bias_shape4(bias)).copy_(ds.sum(reduce_dims, keepdim=True))
    return dq, dk, dv, dbias
