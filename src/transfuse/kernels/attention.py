"""Scaled dot-product attention, forward: FlashAttention-2 (Dao 2023, arXiv:2307.08691).

    q: (batch, nheads, seqlen_q, headdim)        any strides, last one 1
    k: (batch, nheads_kv, seqlen_k, headdim)      nheads % nheads_kv == 0 (GQA/MQA: query head h
                                                  reads kv head h // (nheads // nheads_kv))
    v: (batch, nheads_kv, seqlen_k, headdim_v)    headdim_v may differ from headdim (DeepSeek's
                                                  multi-head latent attention: 192 and 128)
    mask: None, bool (True = attend) or additive float, broadcastable to (batch, nheads, seqlen_q, seqlen_k)
    out: (batch, nheads, seqlen_q, headdim_v) laid out as a contiguous (batch, seqlen_q, nheads, headdim_v),
         so that `out.transpose(1, 2).reshape(batch, seqlen_q, nheads * headdim_v)` is a free view.

    sinks: None or (nheads,) float, one extra logit per query head (GPT-OSS's attention sinks)
    s = scale * q @ k^T (+ mask, or -inf where a bool mask is False; -inf above the diagonal if causal)
    out = softmax(s) @ v, or with sinks softmax([s, sink])[..., :-1] @ v: each row's weights share
          their mass with a key that has no value; a row that sees no key gives 0

One program computes BLOCK_M query rows against all keys, streaming BLOCK_N keys at a time and keeping
the running row maximum m_i, the running sum of exponentials l_i and the unnormalised output acc in
fp32 (the online softmax of FA-2: rescale by alpha = exp(m_old - m_new) when the maximum grows, divide
by l_i once at the end).

Numerics of masked rows (checked against torch 2.13 eager on CPU):
- F.scaled_dot_product_attention turns a bool mask into -inf and, when every score of a row is -inf,
  returns zeros for that row (its "safe softmax"); so does a float mask that is -inf over a whole row.
  A finite mask value (torch.finfo(dtype).min) is plain arithmetic in SDPA as in hand-written eager code.
- softmax(scores + mask) written by hand gives NaN for a row that is all -inf; for a row that is all
  finfo(float32).min it gives uniform weights, because score + min rounds to min for every key.
`masked_rows_zero=True` reproduces the first (a row whose every score is -inf gives 0), False the second
(0 / 0 = NaN). Rows masked with finite values follow the arithmetic in both cases: scores are computed
as fp32 `scale * qk + mask`, the same sum eager computes in fp32. For that reason the running maximum
m_i is kept in natural units and masked scores go through exp(s - m_i): folding log2(e) into s for
exp2 would overflow finfo(float32).min to -inf and turn those rows into NaN. Blocks without masking
keep FA-2's single FMA per score, exp2(qk * scale * log2(e) - m_i * log2(e)).

Block summary (`attention_mask_summary`): an int8 tensor (batch_m, nheads_m, cdiv(seqlen_q, SUMMARY_BLOCK_M),
cdiv(seqlen_k, SUMMARY_BLOCK_N) + 1), batch_m/nheads_m being 1 where the mask broadcasts. Entries
[..., :-1] classify each SUMMARY_BLOCK_M x SUMMARY_BLOCK_N block of the mask:
    SUMMARY_ALL_MASKED = 0  every entry is False / <= finfo(mask dtype).min / -inf: the block is skipped
    SUMMARY_PARTIAL    = 1  the mask tile is loaded and applied
    SUMMARY_NO_MASKING = 2  every entry is True / exactly 0: the mask is not even loaded
The last entry [..., -1] holds per-query-block flags. Skipping a fully masked block is exact for every
row that sees at least one key (its masked entries get weight exp(min - m_i) = 0) and for every row
whose masked entries are all -inf (its l_i stays 0 either way). It is not exact for a row that sees no
key and is masked by finite values: its softmax spreads over all keys. Such a row sets
SUMMARY_FLAG_DENSE_ROW (no key visible at all) or SUMMARY_FLAG_DENSE_ROW_CAUSAL (no key j <= i
visible) and the kernel then visits every block of that query block (the causal range still
applies). Bool masks never set the flags.

Skipping trims the loop range: fully masked blocks before the first and after the last block that is
not fully masked are never visited (padding on either side, causal + padding, sliding windows,
packed sequences). A fully masked block between two visited ones is computed with its mask: the
trimmed range needs no per-block branch around the dots, which keeps the K/V loads software-pipelined;
the only branch in the loop is the scalar test that skips loading a NO_MASKING block's mask.
The kernel uses the summary with its own BLOCK_M dividing SUMMARY_BLOCK_M and any power-of-two
BLOCK_N (several summary columns are merged when BLOCK_N is larger than SUMMARY_BLOCK_N).
"""

import functools

import torch
import triton
import triton.language as tl

from transfuse.kernels._config import INTERPRET, next_power_of_2, num_sms, pdl, tune_configs, wait_for_previous_kernel
from transfuse.kernels.attention_decode import attention_decode_fwd, decode_applies, normalized_rows
from transfuse.kernels.kv_cache import (check_kv_cache_write_args, check_rotary_kv_cache_write_args, kv_cache_write_fwd,
                                       rotary_kv_cache_write_fwd)
from transfuse.kernels.attention_train import _load_rows  # a K or V tile, each with its own head dim

# Block sizes of the mask summary; the attention kernel uses them whenever a summary is given.
SUMMARY_BLOCK_M = 128
SUMMARY_BLOCK_N = 64
SUMMARY_ALL_MASKED = 0
SUMMARY_PARTIAL = 1
SUMMARY_NO_MASKING = 2
SUMMARY_FLAG_DENSE_ROW = 1
SUMMARY_FLAG_DENSE_ROW_CAUSAL = 2

_MASK_DTYPES = (torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The largest head dim: a program holds q, k and v tiles of the padded head dim in shared memory,
# and at 512 and above they no longer fit an SM (an H200 needed 397 KB at 1024).
MAX_HEAD_DIM = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------

def _attention_fwd_configs() -> list[triton.Config]:
    """Search space for the autotuned launcher (the default launch uses `_attention_fwd_heuristic`)."""
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm in (64, 128)
        for bn in (32, 64, 128)
        for w in (4, 8)
        for s in (2, 3, 4)
    ]
    return tune_configs(configs, triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1))


def _keep_config(configs, named_args, **kwargs):
    """Prune: tiles no larger than the (bucketed) sequence, register/shared-memory budget per head dim."""
    block_d = named_args["BLOCK_D"] if "BLOCK_D" in named_args else kwargs["BLOCK_D"]
    bucket_q = named_args["seqlen_q_bucket"]
    bucket_k = named_args["seqlen_k_bucket"]
    kept = []
    for conf in configs:
        bm, bn = conf.kwargs["BLOCK_M"], conf.kwargs["BLOCK_N"]
        if bm > max(64, bucket_q) or bn > max(32, bucket_k):
            continue
        # acc is BLOCK_M x BLOCK_D fp32 in registers: 128 x 256 needs two warpgroups to not spill.
        if block_d >= 256 and (bn > 64 or (bm == 128 and conf.num_warps == 4) or conf.num_stages > 3):
            continue
        # qk is BLOCK_M x BLOCK_N fp32 in registers as well.
        if bm * bn >= 128 * 128 and conf.num_warps == 4 and block_d >= 128:
            continue
        kept.append(conf)
    return kept or configs[:1]


@functools.lru_cache(maxsize=1024)
def _attention_fwd_heuristic(block_d: int, dtype: torch.dtype, has_mask: bool, seqlen_q: int, seqlen_k: int,
                             num_programs_bh: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for Hopper, without autotuning.

    16-bit: 128 query rows per program on two warpgroups (wgmma M = 64 each). Keys per step: as many
    as registers allow without spilling, checked with ptxas for sm_90 on every mask kind, causal and
    summary variant (the mask tile costs registers, and a 2-D mask is pipelined through shared memory
    next to K and V, so masked kernels take 64 keys); head dim 256 takes 32 keys and, masked, 64 rows.
    fp32 runs its dots on FMA units ("ieee"), so small tiles. When the grid would not fill the GPU
    (short sequences, small batch) the query tile halves to double the number of programs.
    """
    if INTERPRET:
        block_m, block_n, warps, stages = 32, 32, 4, 1
    elif dtype == torch.float32:
        block_m, block_n, warps, stages = (32, 16, 4, 2) if block_d <= 64 else (
            (16, 16, 4, 2) if block_d <= 128 else (16, 16, 8, 1))
    elif block_d <= 64:
        block_m, block_n, warps, stages = 128, 64 if has_mask else 128, 8, 3
    elif block_d <= 128:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    else:
        block_m, block_n, warps, stages = 64 if has_mask else 128, 32, 8, 2
    if not INTERPRET and block_m == 128 and device.type == "cuda":
        if triton.cdiv(seqlen_q, 128) * num_programs_bh < num_sms(device):
            block_m, warps = 64, 4 if block_d <= 64 else 8
    # tl.dot needs 16 rows/columns at least; no tile larger than the (padded) sequence. Small tiles
    # keep 4 warps: fewer would hold a whole BLOCK_D-wide accumulator per thread and spill at 256.
    if seqlen_q < block_m or seqlen_k < block_n:
        block_m = min(block_m, max(16, next_power_of_2(seqlen_q)))
        block_n = min(block_n, max(16, next_power_of_2(seqlen_k)))
        if block_m < 64:
            warps = 4
    return block_m, block_n, warps, stages


# ----------------------------------------------------------------------------------------------------
# Forward kernel
# ----------------------------------------------------------------------------------------------------

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _apply_mask(s, mask_ptrs, row_ok, cols, seqlen_k,
                CHECK_K_BOUNDS: tl.constexpr, MASK_IS_BOOL: tl.constexpr, MASK_BROADCAST_Q: tl.constexpr):
    """s with the mask tile applied: -inf where a bool mask is False, + value for an additive mask."""
    if MASK_BROADCAST_Q:
        # One mask row serves every query row: load BLOCK_N values, not a tile.
        if CHECK_K_BOUNDS:
            mvals = tl.load(mask_ptrs, mask=cols < seqlen_k, other=0)
        else:
            mvals = tl.load(mask_ptrs)
        mvals = mvals[None, :]
    else:
        load_ok = row_ok[:, None]
        if CHECK_K_BOUNDS:
            load_ok = load_ok & (cols < seqlen_k)[None, :]
        mvals = tl.load(mask_ptrs, mask=load_ok, other=0)
    # Keys past seqlen_k read `other` here; the caller sets them to -inf afterwards.
    if MASK_IS_BOOL:
        s = tl.where(mvals != 0, s, float("-inf"))
    else:
        s = s + mvals.to(tl.float32)
    return s


@triton.jit
def _attention_fwd_inner(
    acc, l_i, m_i, q,
    k_ptrs, v_ptrs, mask_ptrs, summary_row_ptr,
    stride_k_seq, stride_v_seq, stride_mask_k,
    start_lo, end_hi,
    offs_m, offs_n, row_ok, d_ok, dv_ok,
    seqlen_k, num_summary_k, scale,
    BLOCK_N: tl.constexpr,
    PAD_D: tl.constexpr,
    PAD_DV: tl.constexpr,
    CHECK_K_BOUNDS: tl.constexpr,
    APPLY_CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    MASK_BROADCAST_Q: tl.constexpr,
    HAS_SUMMARY: tl.constexpr,
    SUMMARY_BLOCK_N: tl.constexpr,
    SUMMARY_ENTRIES_PER_BLOCK: tl.constexpr,
    LOAD_AS_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Key blocks [start_lo, end_hi) in steps of BLOCK_N; pointers already point at start_lo.

    CHECK_K_BOUNDS / APPLY_CAUSAL are only set for the last one or two blocks (the sequence end and the
    diagonal), so the bulk of the loop runs without per-element index tests.
    """
    ELEMENT_MASKED: tl.constexpr = (HAS_MASK or CHECK_K_BOUNDS) or APPLY_CAUSAL  # no chained bool ops in older Triton
    qk_scale = scale * LOG2E
    for start_n in range(start_lo, end_hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_rows(k_ptrs, cols, seqlen_k, d_ok, CHECK_K_BOUNDS, PAD_D, LOAD_AS_FP32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)

        if ELEMENT_MASKED:
            s = qk * scale
            if HAS_MASK:
                if HAS_SUMMARY:
                    # Blocks that the summary marks NO_MASKING skip the mask (a branch on a scalar:
                    # predicated-off loads would still issue one instruction per element).
                    offs_e = start_n // SUMMARY_BLOCK_N + tl.arange(0, SUMMARY_ENTRIES_PER_BLOCK)
                    entries = tl.load(summary_row_ptr + offs_e, mask=offs_e < num_summary_k, other=2)
                    if tl.min(entries, axis=0) != 2:
                        s = _apply_mask(s, mask_ptrs, row_ok, cols, seqlen_k,
                                        CHECK_K_BOUNDS, MASK_IS_BOOL, MASK_BROADCAST_Q)
                else:
                    s = _apply_mask(s, mask_ptrs, row_ok, cols, seqlen_k,
                                    CHECK_K_BOUNDS, MASK_IS_BOOL, MASK_BROADCAST_Q)
            if CHECK_K_BOUNDS:
                s = tl.where((cols < seqlen_k)[None, :], s, float("-inf"))
            if APPLY_CAUSAL:
                s = tl.where(cols[None, :] <= offs_m[:, None], s, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            # A row with every score -inf so far keeps m_ij = -inf; subtract 0 instead so that
            # exp(-inf - (-inf)) does not make NaN (its p and l_i stay 0).
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            # exp, not exp2 of a pre-multiplied score: s may be finfo(float32).min (see the module
            # docstring); exp lowers to the same ex2.approx after one multiply.
            p = tl.exp(s - m_sub[:, None])
        else:
            # No -inf or huge negative values can appear here, so the FA-2 trick of one FMA per
            # score (scale and log2(e) folded, maximum pre-multiplied) is safe.
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * scale)
            m_sub = m_ij
            p = tl.math.exp2(qk * qk_scale - (m_sub * LOG2E)[:, None])
        alpha = tl.exp(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]

        v = _load_rows(v_ptrs, cols, seqlen_k, dv_ok, CHECK_K_BOUNDS, PAD_DV, LOAD_AS_FP32)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_ij

        k_ptrs += BLOCK_N * stride_k_seq
        v_ptrs += BLOCK_N * stride_v_seq
        if HAS_MASK:
            mask_ptrs += BLOCK_N * stride_mask_k
    return acc, l_i, m_i


# Sizes that change with every input shape are not specialised on (value 1, multiple of 16): each
# specialisation is another compile (0.6-0.8 s) when a new bucket arrives, and bounds tests do not
# need it. Strides stay specialised: their divisibility is what proves vector loads aligned.
_SHAPE_ARGS = ["seqlen_q", "seqlen_k", "num_summary_k", "seqlen_q_bucket", "seqlen_k_bucket"]


@triton.jit(do_not_specialize=_SHAPE_ARGS)
def _attention_fwd_kernel(
    q_ptr, stride_q_batch, stride_q_head, stride_q_seq,
    k_ptr, stride_k_batch, stride_k_head, stride_k_seq,
    v_ptr, stride_v_batch, stride_v_head, stride_v_seq,
    out_ptr, stride_out_batch, stride_out_head, stride_out_seq,
    mask_ptr, stride_mask_batch, stride_mask_head, stride_mask_q, stride_mask_k,
    summary_ptr, stride_summary_batch, stride_summary_head, stride_summary_qblock,
    key_len_ptr,
    sinks_ptr,
    nheads, kv_group, seqlen_q, seqlen_k, num_summary_k, scale,
    seqlen_q_bucket, seqlen_k_bucket,  # autotune keys only
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    HAS_KEY_LEN: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    MASK_BROADCAST_Q: tl.constexpr,
    HAS_SUMMARY: tl.constexpr,
    SUMMARY_BLOCK_M: tl.constexpr,
    SUMMARY_BLOCK_N: tl.constexpr,
    SUMMARY_K_POW2: tl.constexpr,
    MASKED_ROWS_ZERO: tl.constexpr,
    LOAD_AS_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (_config.pdl)
):
    wait_for_previous_kernel(PDL)
    # 1-D grid, query blocks of one (batch, head) adjacent: the programs resident at the same time
    # read the same K/V (and, with GQA, the heads of one group are adjacent too), so K/V come from L2.
    num_m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    pid = tl.program_id(0)
    pid_bh = pid // num_m_blocks
    pid_m = pid % num_m_blocks
    if IS_CAUSAL:
        # Causal work grows with the query block: start the longest ones first to shorten the tail.
        pid_m = num_m_blocks - 1 - pid_m
    off_b = pid_bh // nheads
    off_h = pid_bh % nheads
    off_h_kv = off_h // kv_group

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    PAD_DV: tl.constexpr = BLOCK_DV != HEAD_DIM_V
    row_ok = offs_m < seqlen_q
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    rows = offs_m.to(tl.int64)

    q_ptrs = (q_ptr + off_b.to(tl.int64) * stride_q_batch + off_h.to(tl.int64) * stride_q_head
              + rows[:, None] * stride_q_seq + offs_d[None, :])
    if PAD_D:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    if LOAD_AS_FP32:
        q = q.to(tl.float32)

    # ---- key range: causal end, whole blocks before the sequence end / diagonal, summary skipping
    if HAS_KEY_LEN:
        # A padded batch (runtime/buckets.py): keys from key_len on are padding, never read.
        seqlen_k = tl.minimum(seqlen_k, tl.load(key_len_ptr))
    hi = seqlen_k
    full_end = (seqlen_k // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        # Row i sees keys j <= i; blocks ending at or before start_m + 1 are visible to every row.
        hi = tl.minimum(hi, start_m + BLOCK_M)
        full_end = tl.minimum(full_end, ((start_m + 1) // BLOCK_N) * BLOCK_N)
    lo = 0
    summary_row_ptr = summary_ptr
    if HAS_SUMMARY:
        summary_row_ptr = (summary_ptr + off_b.to(tl.int64) * stride_summary_batch
                           + off_h.to(tl.int64) * stride_summary_head
                           + (start_m // SUMMARY_BLOCK_M) * stride_summary_qblock)
        offs_s = tl.arange(0, SUMMARY_K_POW2)
        entries = tl.load(summary_row_ptr + offs_s, mask=offs_s < num_summary_k, other=0)
        flags = tl.load(summary_row_ptr + num_summary_k)
        if IS_CAUSAL:
            dense = (flags & 2) != 0
        else:
            dense = (flags & 1) != 0
        first = tl.min(tl.where(entries != 0, offs_s, SUMMARY_K_POW2), axis=0)
        last = tl.max(tl.where(entries != 0, offs_s + 1, 0), axis=0)
        first = tl.where(dense, 0, first)
        last = tl.where(dense, num_summary_k, last)
        lo = ((first * SUMMARY_BLOCK_N) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(hi, last * SUMMARY_BLOCK_N)
    # Blocks [lo, mid) lie inside the sequence and below the diagonal; [mid, hi) need index tests.
    mid = tl.maximum(tl.minimum(full_end, tl.cdiv(hi, BLOCK_N) * BLOCK_N), lo)

    k_base = k_ptr + off_b.to(tl.int64) * stride_k_batch + off_h_kv.to(tl.int64) * stride_k_head
    v_base = v_ptr + off_b.to(tl.int64) * stride_v_batch + off_h_kv.to(tl.int64) * stride_v_head
    cols = (lo + offs_n).to(tl.int64)
    k_ptrs = k_base + cols[:, None] * stride_k_seq + offs_d[None, :]
    v_ptrs = v_base + cols[:, None] * stride_v_seq + offs_dv[None, :]
    mask_ptrs = mask_ptr
    if HAS_MASK:
        mask_base = mask_ptr + off_b.to(tl.int64) * stride_mask_batch + off_h.to(tl.int64) * stride_mask_head
        if MASK_BROADCAST_Q:
            mask_ptrs = mask_base + cols * stride_mask_k
        else:
            mask_ptrs = mask_base + rows[:, None] * stride_mask_q + cols[None, :] * stride_mask_k
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    SUMMARY_ENTRIES_PER_BLOCK: tl.constexpr = BLOCK_N // SUMMARY_BLOCK_N if BLOCK_N > SUMMARY_BLOCK_N else 1

    clear = False
    if HAS_SUMMARY:
        # No mask entry of the bulk [lo, mid) masks anything (a padding mask seen from the real
        # keys): the bulk runs the mask-free loop, FA-2's one FMA per score and no mask loads.
        bulk = (offs_s >= lo // SUMMARY_BLOCK_N) & (offs_s < tl.cdiv(mid, SUMMARY_BLOCK_N))
        clear = tl.min(tl.where(bulk, entries, 2), axis=0) == 2
    if clear:
        acc, l_i, m_i = _attention_fwd_inner(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, summary_row_ptr,
            stride_k_seq, stride_v_seq, stride_mask_k, lo, mid,
            offs_m, offs_n, row_ok, d_ok, dv_ok, seqlen_k, num_summary_k, scale,
            BLOCK_N, PAD_D, PAD_DV, False, False, False, MASK_IS_BOOL, MASK_BROADCAST_Q,
            False, SUMMARY_BLOCK_N, SUMMARY_ENTRIES_PER_BLOCK, LOAD_AS_FP32, DOT_PRECISION,
        )
    else:
        acc, l_i, m_i = _attention_fwd_inner(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, summary_row_ptr,
            stride_k_seq, stride_v_seq, stride_mask_k, lo, mid,
            offs_m, offs_n, row_ok, d_ok, dv_ok, seqlen_k, num_summary_k, scale,
            BLOCK_N, PAD_D, PAD_DV, False, False, HAS_MASK, MASK_IS_BOOL, MASK_BROADCAST_Q,
            HAS_SUMMARY, SUMMARY_BLOCK_N, SUMMARY_ENTRIES_PER_BLOCK, LOAD_AS_FP32, DOT_PRECISION,
        )
    # The sequence end and the diagonal: at most a couple of blocks, with per-element tests.
    step = mid - lo
    k_ptrs += step.to(tl.int64) * stride_k_seq
    v_ptrs += step.to(tl.int64) * stride_v_seq
    if HAS_MASK:
        mask_ptrs += step.to(tl.int64) * stride_mask_k
    acc, l_i, m_i = _attention_fwd_inner(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, mask_ptrs, summary_row_ptr,
        stride_k_seq, stride_v_seq, stride_mask_k, mid, hi,
        offs_m, offs_n, row_ok, d_ok, dv_ok, seqlen_k, num_summary_k, scale,
        BLOCK_N, PAD_D, PAD_DV, True, IS_CAUSAL, HAS_MASK, MASK_IS_BOOL, MASK_BROADCAST_Q,
        HAS_SUMMARY, SUMMARY_BLOCK_N, SUMMARY_ENTRIES_PER_BLOCK, LOAD_AS_FP32, DOT_PRECISION,
    )

    sink = m_i  # not read without sinks
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + off_h).to(tl.float32)
    out = normalized_rows(acc, l_i, m_i, sink, HAS_SINKS, MASKED_ROWS_ZERO)
    out_ptrs = (out_ptr + off_b.to(tl.int64) * stride_out_batch + off_h.to(tl.int64) * stride_out_head
                + rows[:, None] * stride_out_seq + offs_dv[None, :])
    if PAD_DV:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    else:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


_attention_fwd_kernel_autotuned = triton.autotune(
    configs=_attention_fwd_configs(),
    key=["seqlen_q_bucket", "seqlen_k_bucket", "HEAD_DIM", "HEAD_DIM_V", "IS_CAUSAL", "HAS_MASK", "MASK_IS_BOOL",
         "MASK_BROADCAST_Q", "HAS_SUMMARY"],
    prune_configs_by={"early_config_prune": _keep_config},
)(_attention_fwd_kernel)


# ----------------------------------------------------------------------------------------------------
# Mask summary kernel
# ----------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "num_k_blocks"])
def _attention_mask_summary_kernel(
    mask_ptr, stride_mask_batch, stride_mask_head, stride_mask_q, stride_mask_k,
    summary_ptr, stride_summary_batch, stride_summary_head, stride_summary_qblock,
    nheads_mask, seqlen_q, seqlen_k, num_k_blocks, mask_min,
    MASK_IS_BOOL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr = 1,  # key blocks classified per iteration (their loads issued together)
    PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (_config.pdl)
):
    """One program per (batch, head, query block) of the summary: classify each key block, then the flags."""
    wait_for_previous_kernel(PDL)
    num_m_blocks = tl.cdiv(seqlen_q, BLOCK_M)
    pid = tl.program_id(0)
    pid_bh = pid // num_m_blocks
    pid_m = pid % num_m_blocks
    off_b = pid_bh // nheads_mask
    off_h = pid_bh % nheads_mask

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_g = tl.arange(0, GROUP)
    # (BLOCK_M, GROUP, BLOCK_N): row, key block of the group, key within the block
    offs_n = (offs_g[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])[None, :, :]
    row_ok = offs_m < seqlen_q
    mask_ptrs = (mask_ptr + off_b.to(tl.int64) * stride_mask_batch + off_h.to(tl.int64) * stride_mask_head
                 + offs_m.to(tl.int64)[:, None, None] * stride_mask_q + offs_n * stride_mask_k)
    summary_row_ptr = (summary_ptr + off_b.to(tl.int64) * stride_summary_batch
                       + off_h.to(tl.int64) * stride_summary_head + pid_m * stride_summary_qblock)

    # Per row: first key that is visible, first key masked by a finite value (seqlen_k if none).
    first_visible = tl.full([BLOCK_M], seqlen_k, dtype=tl.int32)
    first_finite_masked = tl.full([BLOCK_M], seqlen_k, dtype=tl.int32)
    for kb in range(0, num_k_blocks, GROUP):
        cols = kb * BLOCK_N + offs_n
        ok = row_ok[:, None, None] & (cols < seqlen_k)
        if MASK_IS_BOOL:
            visible = tl.load(mask_ptrs, mask=ok, other=0) != 0
            masked = ~visible
            unmasked = visible
            finite_masked = tl.zeros_like(visible)
        else:
            vals = tl.load(mask_ptrs, mask=ok, other=0.0).to(tl.float32)
            # NaN is neither visible nor masked nor zero: its block stays PARTIAL and NaN propagates.
            visible = vals > mask_min
            masked = vals <= mask_min
            unmasked = vals == 0.0
            finite_masked = masked & (vals > float("-inf"))
        all_masked = tl.min(tl.min(tl.where(ok, masked, True).to(tl.int32), axis=2), axis=0)
        all_unmasked = tl.min(tl.min(tl.where(ok, unmasked, True).to(tl.int32), axis=2), axis=0)
        cls = tl.where(all_masked != 0, 0, tl.where(all_unmasked != 0, 2, 1))
        tl.store(summary_row_ptr + kb + offs_g, cls.to(tl.int8), mask=kb + offs_g < num_k_blocks)
        first_visible = tl.minimum(
            first_visible, tl.min(tl.min(tl.where(visible & ok, cols, seqlen_k), axis=2), axis=1))
        first_finite_masked = tl.minimum(
            first_finite_masked, tl.min(tl.min(tl.where(finite_masked & ok, cols, seqlen_k), axis=2), axis=1))
        mask_ptrs += GROUP * BLOCK_N * stride_mask_k

    dense = row_ok & (first_visible >= seqlen_k) & (first_finite_masked < seqlen_k)
    dense_causal = row_ok & (first_visible > offs_m) & (first_finite_masked <= offs_m)
    flags = tl.max(dense.to(tl.int32), axis=0) * 1 + tl.max(dense_causal.to(tl.int32), axis=0) * 2
    tl.store(summary_row_ptr + num_k_blocks, flags.to(tl.int8))


# ----------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------

def _mask_4d_strides(mask: torch.Tensor, batch: int, nheads: int, seqlen_q: int, seqlen_k: int):
    """Strides of `mask.expand(batch, nheads, seqlen_q, seqlen_k)` without building the view (0 where broadcast)."""
    if mask.dim() > 4:
        raise ValueError(f"attention mask must have at most 4 dims, got shape {tuple(mask.shape)}")
    shape = (1,) * (4 - mask.dim()) + tuple(mask.shape)
    strides = (0,) * (4 - mask.dim()) + tuple(mask.stride())
    target = (batch, nheads, seqlen_q, seqlen_k)
    out = []
    for size, stride, want in zip(shape, strides, target):
        if size == want and want != 1:
            out.append(stride)
        elif size == 1:
            out.append(0)
        else:
            raise ValueError(f"attention mask of shape {tuple(mask.shape)} does not broadcast to {target}")
    return out


def _mask_for_kernel(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype not in _MASK_DTYPES:
        raise TypeError(f"attention mask must be bool or floating point, got {mask.dtype}")
    if mask.dtype == torch.float64:
        # Kernels read at most fp32; clamp first so that finfo(float64).min stays the finite fp32 min.
        mask = mask.clamp(min=torch.finfo(torch.float32).min).to(torch.float32)
    return mask


def attention_summary_shape(mask_shape, seqlen_q: int, seqlen_k: int) -> tuple[int, int, int, int]:
    """Shape of `attention_mask_summary(mask, seqlen_q, seqlen_k)` (shared with the fake implementation)."""
    shape = (1,) * (4 - len(mask_shape)) + tuple(mask_shape)
    return (shape[0], shape[1], triton.cdiv(seqlen_q, SUMMARY_BLOCK_M), triton.cdiv(seqlen_k, SUMMARY_BLOCK_N) + 1)


def attention_mask_summary_fwd(mask: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """int8 block summary of `mask` (see the module docstring); one small launch, no host sync."""
    mask = _mask_for_kernel(mask)
    shape = attention_summary_shape(mask.shape, seqlen_q, seqlen_k)
    batch_m, nheads_m, num_q_blocks, num_cols = shape
    summary = torch.empty(shape, dtype=torch.int8, device=mask.device)
    if summary.numel() == 0:
        return summary
    stride_mb, stride_mh, stride_mq, stride_mk = _mask_4d_strides(mask, batch_m, nheads_m, seqlen_q, seqlen_k)
    mask_min = 0.0 if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
    grid = (batch_m * nheads_m * num_q_blocks,)
    # Fewer query rows than a summary block (a decode step's one): one block, read as a tile of
    # just those rows (the same summary). One warp then holds the tile, so the per-block reductions
    # need no shared memory or barriers: a decode step's summary took 9.4 us at 128 rows, 8 warps.
    decode = seqlen_q < SUMMARY_BLOCK_M
    rows = next_power_of_2(seqlen_q) if decode else SUMMARY_BLOCK_M
    # A decode step's summary walks the whole cache: one round trip to memory per iteration, so up to
    # 4096 mask entries per iteration (a 1,024-key cache in one at one query row). The tile has only
    # the rows that exist: padded to 16, a one-row step's 256-key summary took 9 us (H100, 2026-11-26).
    group = min(64 // rows, next_power_of_2(num_cols - 1)) if decode and rows <= 16 else 1
    _attention_mask_summary_kernel[grid](
        mask, stride_mb, stride_mh, stride_mq, stride_mk,
        summary, summary.stride(0), summary.stride(1), summary.stride(2),
        nheads_m, seqlen_q, seqlen_k, num_cols - 1, mask_min,
        MASK_IS_BOOL=mask.dtype == torch.bool,
        BLOCK_M=rows,
        BLOCK_N=SUMMARY_BLOCK_N,
        GROUP=group,
        # 8 warps: a 128 x 64 tile and its per-row reductions spill at 4 (ptxas, sm_90).
        num_warps=8 if rows == SUMMARY_BLOCK_M else 1 if rows <= 16 else 4,
        num_stages=1,
        **pdl(mask),
    )
    return summary


def attention_empty_out(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(batch, nheads, seqlen_q, headdim_v) with the memory of a contiguous (batch, seqlen_q, nheads, headdim_v)."""
    batch, nheads, seqlen_q, _ = q.shape
    return q.new_empty((batch, seqlen_q, nheads, v.shape[-1])).transpose(1, 2)


def attention_fwd(
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
    autotune: bool = False,
    new_kv: tuple | None = None,
) -> torch.Tensor:
    """softmax(scale * q @ k^T + mask) @ v; see the module docstring for shapes and semantics.

    `autotune=True` searches `_attention_fwd_configs()` once per key (bucketed seqlens, head dim,
    flags, dtype) instead of using the fixed heuristic; never call it for the first time inside
    CUDA-graph capture.

    `new_kv=(new_k, new_v, cos, sin, start)`: first the cache write, k and v being the cache
    (written in place): rotary_kv_cache_write(k, v, q, new_k, new_v, cos, sin, start), q unrotated,
    or with cos = sin = None kv_cache_write(k, v, new_k, new_v, start); then the attention (on the
    rotated q). The decode kernel does both in one launch where it applies (attention_decode.py,
    as many new keys as query rows); elsewhere the write's own kernel runs first.
    """
    if new_kv is not None:
        new_k, new_v, cos, sin, start = new_kv
        fused = all(t.dim() == 4 for t in (q, k, new_k)) and new_k.shape[2] == q.shape[2] and decode_applies(
            q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], is_causal, mask is not None, q.device,
            fused_write=True)
        if fused:  # the decode kernel writes; elsewhere the write kernel's own launcher checks its arguments
            if cos is not None:
                check_rotary_kv_cache_write_args(k, v, q, new_k, new_v, cos, sin, start)
            else:
                check_kv_cache_write_args(k, v, new_k, new_v, start)
        else:
            if cos is not None:
                q = rotary_kv_cache_write_fwd(k, v, q, new_k, new_v, cos, sin, start)
            else:
                kv_cache_write_fwd(k, v, new_k, new_v, start)
            new_kv = None
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("attention expects q, k, v of shape (batch, nheads, seqlen, headdim)")
    batch, nheads, seqlen_q, head_dim = q.shape
    batch_k, nheads_kv, seqlen_k, head_dim_k = k.shape
    head_dim_v = v.shape[-1]
    if batch_k != batch or tuple(v.shape[:-1]) != tuple(k.shape[:-1]) or head_dim_k != head_dim:
        raise ValueError(f"attention shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(f"nheads ({nheads}) must be a multiple of nheads_kv ({nheads_kv})")
    if not (0 < head_dim <= MAX_HEAD_DIM and 0 < head_dim_v <= MAX_HEAD_DIM):
        raise ValueError(f"attention supports head dims 1 to {MAX_HEAD_DIM}, got {head_dim} (values {head_dim_v})")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"attention supports {_DTYPES} with one dtype for q, k, v; got {q.dtype}, {k.dtype}, {v.dtype}")
    if mask_summary is not None and mask is None:
        raise ValueError("mask_summary given without mask")
    if key_len is not None and (key_len.numel() != 1 or key_len.dtype != torch.int32):
        raise ValueError(f"key_len must be one int32 element, got {tuple(key_len.shape)} / {key_len.dtype}")
    if sinks is not None and (tuple(sinks.shape) != (nheads,) or not sinks.dtype.is_floating_point):
        raise ValueError(f"sinks must be one float per query head ({nheads},), got {tuple(sinks.shape)} / {sinks.dtype}")
    for name, t in (("k", k), ("v", v), ("mask", mask), ("mask_summary", mask_summary), ("key_len", key_len),
                    ("sinks", sinks)):
        if t is not None and t.device != q.device:
            raise ValueError(f"attention: {name} is on {t.device}, q on {q.device}")

    out = attention_empty_out(q, v)
    if out.numel() == 0:
        return out
    if seqlen_k == 0:
        raise ValueError("attention needs at least one key")
    # The kernel assumes unit stride along the head dim (vectorised loads); anything else is rare.
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    sinks = sinks.contiguous() if sinks is not None else None  # read as one float per head

    has_mask = mask is not None
    if has_mask:
        mask = _mask_for_kernel(mask)
        stride_mb, stride_mh, stride_mq, stride_mk = _mask_4d_strides(mask, batch, nheads, seqlen_q, seqlen_k)
        mask_arg = mask
    else:
        stride_mb = stride_mh = stride_mq = stride_mk = 0
        mask_arg = q  # never read
    mask_broadcast_q = has_mask and stride_mq == 0
    num_summary_k = triton.cdiv(seqlen_k, SUMMARY_BLOCK_N)
    has_summary = mask_summary is not None
    if has_summary:
        expect = attention_summary_shape(mask.shape, seqlen_q, seqlen_k)
        shape = tuple(mask_summary.shape)
        if (mask_summary.dtype != torch.int8 or len(shape) != 4 or shape[2:] != expect[2:]
                or shape[0] not in (1, batch) or shape[1] not in (1, nheads)):
            raise ValueError(f"mask_summary of shape {shape} / {mask_summary.dtype} does not match "
                             f"seqlen_q={seqlen_q}, seqlen_k={seqlen_k} (expected int8 {expect})")
        if mask_summary.stride(-1) != 1:
            mask_summary = mask_summary.contiguous()
        stride_sb = mask_summary.stride(0) if shape[0] != 1 else 0
        stride_sh = mask_summary.stride(1) if shape[1] != 1 else 0
        stride_sq = mask_summary.stride(2)
        summary_arg = mask_summary
    else:
        stride_sb = stride_sh = stride_sq = 0
        summary_arg = q  # never read

    if new_kv is not None or decode_applies(batch, nheads, nheads_kv, seqlen_q, seqlen_k, is_causal, has_mask, q.device):
        # A few query rows (a decode step): one program per KV group and key split (attention_decode.py).
        return attention_decode_fwd(
            q, k, v, out, mask_arg if has_mask else None, (stride_mb, stride_mh, stride_mq, stride_mk),
            mask_summary if has_summary else None, (stride_sb, stride_sh), SUMMARY_BLOCK_N, num_summary_k,
            key_len, sinks, scale, masked_rows_zero, new_kv=new_kv)

    block_d = max(16, next_power_of_2(head_dim))
    block_dv = max(16, next_power_of_2(head_dim_v))
    # Autotune keys: powers of two in [16, 16384] (never 1, which Triton would specialise on).
    bucket_q = min(max(next_power_of_2(seqlen_q), 16), 16384)
    bucket_k = min(max(next_power_of_2(seqlen_k), 16), 16384)
    args = (
        q, q.stride(0), q.stride(1), q.stride(2),
        k, k.stride(0), k.stride(1), k.stride(2),
        v, v.stride(0), v.stride(1), v.stride(2),
        out, out.stride(0), out.stride(1), out.stride(2),
        mask_arg, stride_mb, stride_mh, stride_mq, stride_mk,
        summary_arg, stride_sb, stride_sh, stride_sq,
        key_len if key_len is not None else q,  # never read without HAS_KEY_LEN
        sinks if sinks is not None else q,  # never read without HAS_SINKS
        nheads, nheads // nheads_kv, seqlen_q, seqlen_k, num_summary_k, float(scale),
        bucket_q, bucket_k,
    )
    flags = dict(
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        HAS_KEY_LEN=key_len is not None,
        HAS_SINKS=sinks is not None,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        IS_CAUSAL=bool(is_causal),
        HAS_MASK=has_mask,
        MASK_IS_BOOL=has_mask and mask.dtype == torch.bool,
        MASK_BROADCAST_Q=mask_broadcast_q,
        HAS_SUMMARY=has_summary,
        SUMMARY_BLOCK_M=SUMMARY_BLOCK_M,
        SUMMARY_BLOCK_N=SUMMARY_BLOCK_N,
        SUMMARY_K_POW2=next_power_of_2(num_summary_k) if has_summary else 1,
        MASKED_ROWS_ZERO=bool(masked_rows_zero),
        LOAD_AS_FP32=INTERPRET or q.dtype == torch.float32,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,  # fp32 inputs ask for fp32 products, not tf32
        **pdl(q),
    )
    if autotune:
        grid = lambda meta: (triton.cdiv(seqlen_q, meta["BLOCK_M"]) * batch * nheads,)  # noqa: E731
        _attention_fwd_kernel_autotuned[grid](*args, **flags)
    else:
        block_m, block_n, warps, stages = _attention_fwd_heuristic(
            max(block_d, block_dv), q.dtype, has_mask, seqlen_q, seqlen_k, batch * nheads, q.device)
        grid = (triton.cdiv(seqlen_q, block_m) * batch * nheads,)
        _attention_fwd_kernel[grid](*args, **flags, BLOCK_M=block_m, BLOCK_N=block_n,
                                    num_warps=warps, num_stages=stages)
    return out
