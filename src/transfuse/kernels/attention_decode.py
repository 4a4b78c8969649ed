"""Attention for a few query rows over a long key axis (decode steps): flash-decoding with GQA packing.

Same function as attention.py's kernel (see its docstring for shapes, masks, sinks and the numerics
of masked rows); this file only changes how the work is laid out, for calls where the query side is
tiny: a decode step's one row per head against a KV cache.

The prefill kernel gives each (batch, query head) a program of at least 16 query rows. At one row
that program does 1/16 of useful dot work, every query head of a GQA group reads the same K/V again,
and one program walks the whole key axis: a 4k-key cache at batch 1 runs on as many programs as the
model has query heads, a fraction of the GPU, each looping over 64 key blocks.

Here one program takes every query row of one KV head's group (kv_group heads x seqlen_q positions,
stacked on the MMA's M side), so K and V are read once per group, and one split of the key axis.
The splits of a row set write their unnormalised partial output with the row maximum and sum of
exponentials in fp32, and a second small kernel combines them, in split order (deterministic). One
split (short caches) writes the output directly and launches nothing else.

The key range is [0, key_len) (the runtime's filled length, when given), trimmed by the mask summary
when given (a static cache's mask hides the unfilled tail), and cut into equal splits at run time,
so a graph captured for a 4k-key cache does work in proportion to the keys in use. Masked scores
follow attention.py exactly: fp32 `scale * qk + mask`, exp in natural units, so rows masked with
finfo.min everywhere give eager's uniform weights and rows of -inf give 0 or NaN as asked.

Fused cache write (`new_kv=`, ops/cache_write_attention.py): a decode step's new keys and values
arrive from the Q/K/V linear with their position `start` (a device int), instead of written into the
cache by a kernel of their own (kv_cache_write, or rotary_kv_cache_write: ~3 us a layer at batch 8).
With rotary tables each program rotates its query rows on loading (kernels/rotary.py's fp32 helper,
rounded once to q's dtype, as the separate kernel rounds them) and the group's new keys in
registers. Split 0 stores the new keys and values into the cache at start..start+n-1 (positions
< L), the split whose share holds a new position attends to it from registers, and the cache loop
skips those positions (no program reads a row another one writes). The key set is the unfused one;
only the order in which the new keys join the online softmax differs (fp32 rounding).
"""

import os

import torch
import triton
import triton.language as tl

from transfuse.kernels._config import INTERPRET, next_power_of_2, num_sms, pdl, wait_for_previous_kernel
from transfuse.kernels.rotary import _broadcast_strides, _rotate

# The query rows one program stacks (kv_group x seqlen_q), and the most per head (a decode step has
# one; speculative decoding a few): beyond these the prefill kernel's tiles and mask skipping win.
MAX_ROWS = 64
MAX_QUERY_ROWS = 8
# Fewest keys worth a split of their own: below this the combine costs more than the split saves.
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 64
# Rows of the new-keys block of a fused cache write: its n <= MAX_QUERY_ROWS keys (decode_applies), and a
# tl.dot side is at least 16.
_NEW_ROWS = max(16, next_power_of_2(MAX_QUERY_ROWS))


@triton.jit
def normalized_rows(acc, l_i, m_i, sink, HAS_SINKS: tl.constexpr, MASKED_ROWS_ZERO: tl.constexpr):
    """The output rows acc / l_i once every key is in (this kernel's and attention.py's).

    A sink is one more score with no value: it joins each row's maximum and sum of exponentials
    once, after the keys (the same online-softmax step as a key block). l_i == 0 exactly when every
    score of a row was -inf (otherwise the maximum contributes 1): 0 / 0 = NaN as eager's softmax
    gives, or 0 with MASKED_ROWS_ZERO as SDPA gives."""
    if HAS_SINKS:
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
    if MASKED_ROWS_ZERO:
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
    return acc * (1.0 / l_i)[:, None]


@triton.jit
def _softmax_step(acc, l_i, m_i, s, v, DOT_PRECISION: tl.constexpr):
    """One key block's scores s (-inf where masked) and values v into the running (acc, l_i, m_i)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with every score -inf so far subtracts 0, not -inf: its p and l_i stay 0, not NaN.
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_sub[:, None])
    alpha = tl.exp(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _masked_scores(s, mask_rows, cols64, row_ok, col_ok, stride_mask_k, APPLY_MASK: tl.constexpr,
                   MASK_IS_BOOL: tl.constexpr):
    """fp32 scale * qk (s) with the mask's columns cols64 applied, -inf where a column is not in."""
    if APPLY_MASK:
        mvals = tl.load(mask_rows[:, None] + cols64[None, :] * stride_mask_k,
                        mask=row_ok[:, None] & col_ok[None, :], other=0)
        if MASK_IS_BOOL:
            s = tl.where(mvals != 0, s, float("-inf"))
        else:
            s = s + mvals.to(tl.float32)
    return tl.where(col_ok[None, :], s, float("-inf"))


@triton.jit
def _decode_blocks(acc, l_i, m_i, q, k_base, v_base, mask_rows, start, end, skip_lo, skip_hi, offs_n, offs_d,
                   offs_dv, row_ok, d_ok, dv_ok, stride_k_seq, stride_v_seq, stride_mask_k, scale,
                   APPLY_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, LOAD_AS_FP32: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [start, end) but [skip_lo, skip_hi) (the new keys of a fused write, attended from
    registers) in blocks of BLOCK_N into the running (acc, l_i, m_i): scores in natural units,
    fp32 `scale * qk + mask` (attention.py's numerics for finfo.min masks)."""
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        col_ok = (cols < end) & ((cols < skip_lo) | (cols >= skip_hi))
        cols64 = cols.to(tl.int64)
        k = tl.load(k_base + cols64[:, None] * stride_k_seq + offs_d[None, :],
                    mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        if LOAD_AS_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        s = _masked_scores(s, mask_rows, cols64, row_ok, col_ok, stride_mask_k, APPLY_MASK, MASK_IS_BOOL)
        v = tl.load(v_base + cols64[:, None] * stride_v_seq + offs_dv[None, :],
                    mask=col_ok[:, None] & dv_ok[None, :], other=0.0)
        if LOAD_AS_FP32:
            v = v.to(tl.float32)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v, DOT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _new_keys(acc, l_i, m_i, q, k_base, v_base, mask_rows, new_k_ptr, new_v_ptr, cos_ptr, sin_ptr, b64, hk64, first,
              start, end, split, n, L, offs_d, offs_dv, row_ok, d_ok, dv_ok, stride_k_seq, stride_v_seq,
              stride_mask_k, stride_nk_b, stride_nk_h, stride_nk_s, stride_nv_b, stride_nv_h, stride_nv_s,
              stride_cb, stride_ch, stride_cs, stride_sb, stride_sh, stride_ss, scale, HEAD_DIM: tl.constexpr,
              ROTARY: tl.constexpr, APPLY_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, LOAD_AS_FP32: tl.constexpr,
              DOT_PRECISION: tl.constexpr, BLOCK_D: tl.constexpr, NEW_ROWS: tl.constexpr):
    """A fused write's n new keys of one (batch, KV head), at cache positions first..first+n-1: rotated
    (ROTARY) as kernels/kv_cache.py rotates them (fp32, one rounding to the cache's dtype), stored with
    their values by split 0 (positions < L), and attended by this program where they fall in
    [start, end)."""
    j = tl.arange(0, NEW_ROWS)
    j64 = j.to(tl.int64)
    pos = first + j
    exists = (j < n) & (pos < L)
    k_ok = exists[:, None] & d_ok[None, :]
    if ROTARY:
        k_new = _rotate(new_k_ptr, cos_ptr, sin_ptr, tl.full([NEW_ROWS], 0, tl.int64) + b64,
                        tl.full([NEW_ROWS], 0, tl.int64) + hk64, j64, k_ok, stride_nk_b, stride_nk_h, stride_nk_s,
                        stride_cb, stride_ch, stride_cs, stride_sb, stride_sh, stride_ss,
                        HEAD_DIM // 2, BLOCK_D).to(k_base.dtype.element_ty)
    else:
        k_new = tl.load(new_k_ptr + b64 * stride_nk_b + hk64 * stride_nk_h + j64[:, None] * stride_nk_s + offs_d[None, :],
                        mask=k_ok, other=0.0).to(k_base.dtype.element_ty)
    v_ok = exists[:, None] & dv_ok[None, :]
    v_new = tl.load(new_v_ptr + b64 * stride_nv_b + hk64 * stride_nv_h + j64[:, None] * stride_nv_s + offs_dv[None, :],
                    mask=v_ok, other=0.0).to(v_base.dtype.element_ty)
    pos64 = pos.to(tl.int64)
    if split == 0:
        tl.store(k_base + pos64[:, None] * stride_k_seq + offs_d[None, :], k_new, mask=k_ok)
        tl.store(v_base + pos64[:, None] * stride_v_seq + offs_dv[None, :], v_new, mask=v_ok)
    if LOAD_AS_FP32:
        k_new = k_new.to(tl.float32)
        v_new = v_new.to(tl.float32)
    col_ok = exists & (pos >= start) & (pos < end)
    s = tl.dot(q, tl.trans(k_new), input_precision=DOT_PRECISION) * scale
    s = _masked_scores(s, mask_rows, pos64, row_ok, col_ok, stride_mask_k, APPLY_MASK, MASK_IS_BOOL)
    return _softmax_step(acc, l_i, m_i, s, v_new, DOT_PRECISION)


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "num_summary_k", "nheads", "kv_group", "nheads_kv"])
def _attention_decode_kernel(
    q_ptr, stride_q_batch, stride_q_head, stride_q_seq,
    k_ptr, stride_k_batch, stride_k_head, stride_k_seq,
    v_ptr, stride_v_batch, stride_v_head, stride_v_seq,
    out_ptr, stride_out_batch, stride_out_head, stride_out_seq,
    part_ptr, ml_ptr,
    mask_ptr, stride_mask_batch, stride_mask_head, stride_mask_q, stride_mask_k,
    summary_ptr, stride_summary_batch, stride_summary_head,
    key_len_ptr, sinks_ptr,
    # NEW_KV (a fused cache write): the new keys and values (batch, kv heads, seqlen_q, D), the rotary
    # tables broadcast to q's and to the new keys' shapes (ROTARY), the position of the first new key
    new_k_ptr, stride_nk_batch, stride_nk_head, stride_nk_seq,
    new_v_ptr, stride_nv_batch, stride_nv_head, stride_nv_seq,
    cos_q_ptr, stride_cq_batch, stride_cq_head, stride_cq_seq, sin_q_ptr, stride_sq_batch, stride_sq_head, stride_sq_seq,
    cos_k_ptr, stride_ck_batch, stride_ck_head, stride_ck_seq, sin_k_ptr, stride_sk_batch, stride_sk_head, stride_sk_seq,
    start_ptr,
    nheads, nheads_kv, kv_group, seqlen_q, seqlen_k, num_summary_k, scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_KEY_LEN: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
    HAS_SUMMARY: tl.constexpr, SUMMARY_BLOCK_N: tl.constexpr, SUMMARY_K_POW2: tl.constexpr,
    GROUP_POW2: tl.constexpr, MASKED_ROWS_ZERO: tl.constexpr, LOAD_AS_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NEW_KV: tl.constexpr = False, ROTARY: tl.constexpr = False, NEW_ROWS: tl.constexpr = 16,
    PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (_config.pdl)
):
    """Program (batch x kv head, split): rows r = g * seqlen_q + i are query head kv_head * kv_group + g
    at position i; keys of this split's share of the (trimmed) key range (with NEW_KV, the new keys
    of that share from registers; see the module docstring)."""
    wait_for_previous_kernel(PDL)
    pid_bk = tl.program_id(0)
    split = tl.program_id(1)
    off_b = pid_bk // nheads_kv
    off_hk = pid_bk % nheads_kv

    offs_m = tl.arange(0, BLOCK_M)
    row_ok = offs_m < kv_group * seqlen_q
    head = off_hk * kv_group + offs_m // seqlen_q
    pos = offs_m % seqlen_q
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_DIM
    dv_ok = offs_dv < HEAD_DIM_V
    b64 = off_b.to(tl.int64)
    head64 = head.to(tl.int64)
    pos64 = pos.to(tl.int64)

    if ROTARY:
        # rotary(q) as kernels/rotary.py computes it (fp32), rounded once to q's dtype
        q = _rotate(q_ptr, cos_q_ptr, sin_q_ptr, tl.full([BLOCK_M], 0, tl.int64) + b64, head64, pos64,
                    row_ok[:, None] & d_ok[None, :], stride_q_batch, stride_q_head, stride_q_seq,
                    stride_cq_batch, stride_cq_head, stride_cq_seq, stride_sq_batch, stride_sq_head, stride_sq_seq,
                    HEAD_DIM // 2, BLOCK_D).to(q_ptr.dtype.element_ty)
    else:
        q = tl.load(q_ptr + b64 * stride_q_batch + head64[:, None] * stride_q_head + pos64[:, None] * stride_q_seq
                    + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if LOAD_AS_FP32:
        q = q.to(tl.float32)

    # ---- this split's keys: [0, key_len), trimmed by the summary, cut into SPLITS equal shares
    hi = seqlen_k
    if HAS_KEY_LEN:
        hi = tl.minimum(hi, tl.load(key_len_ptr))
    lo = 0
    if HAS_SUMMARY:
        # The summary's one query block (seqlen_q < its block rows) of every head in the group:
        # the union of their visible blocks, or every block if a row sees no key (dense flag).
        offs_g = tl.arange(0, GROUP_POW2)
        offs_s = tl.arange(0, SUMMARY_K_POW2)
        g_ok = offs_g < kv_group
        group_rows = (summary_ptr + b64 * stride_summary_batch
                      + (off_hk * kv_group + offs_g).to(tl.int64) * stride_summary_head)
        row_base = group_rows[:, None]
        entries = tl.load(row_base + offs_s[None, :], mask=g_ok[:, None] & (offs_s < num_summary_k)[None, :], other=0)
        flags = tl.load(row_base + num_summary_k, mask=g_ok[:, None], other=0)
        dense = tl.max(tl.max(flags & 1, axis=1), axis=0) != 0
        first = tl.min(tl.min(tl.where(entries != 0, offs_s[None, :], SUMMARY_K_POW2), axis=1), axis=0)
        last = tl.max(tl.max(tl.where(entries != 0, offs_s[None, :] + 1, 0), axis=1), axis=0)
        first = tl.where(dense, 0, first)
        last = tl.where(dense, num_summary_k, last)
        lo = first * SUMMARY_BLOCK_N
        hi = tl.minimum(hi, last * SUMMARY_BLOCK_N)
    share = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * share
    end = tl.minimum(start + share, hi)

    k_base = k_ptr + b64 * stride_k_batch + off_hk.to(tl.int64) * stride_k_head
    v_base = v_ptr + b64 * stride_v_batch + off_hk.to(tl.int64) * stride_v_head
    mask_rows = mask_ptr
    if HAS_MASK:
        mask_rows = mask_ptr + b64 * stride_mask_batch + head64 * stride_mask_head + pos64 * stride_mask_q
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    skip_lo = 0
    skip_hi = 0
    if NEW_KV:
        # The new keys: rotated here (ROTARY), stored by split 0, attended by the split whose share holds them.
        skip_lo = tl.load(start_ptr).to(tl.int32)
        skip_hi = skip_lo + seqlen_q
        acc, l_i, m_i = _new_keys(
            acc, l_i, m_i, q, k_base, v_base, mask_rows, new_k_ptr, new_v_ptr, cos_k_ptr, sin_k_ptr,
            b64, off_hk.to(tl.int64), skip_lo, start, end, split, seqlen_q, seqlen_k, offs_d, offs_dv, row_ok, d_ok,
            dv_ok, stride_k_seq, stride_v_seq, stride_mask_k, stride_nk_batch, stride_nk_head, stride_nk_seq,
            stride_nv_batch, stride_nv_head, stride_nv_seq, stride_ck_batch, stride_ck_head, stride_ck_seq,
            stride_sk_batch, stride_sk_head, stride_sk_seq, scale, HEAD_DIM, ROTARY, HAS_MASK, MASK_IS_BOOL, LOAD_AS_FP32,
            DOT_PRECISION, BLOCK_D, NEW_ROWS)
    acc, l_i, m_i = _decode_blocks(
        acc, l_i, m_i, q, k_base, v_base, mask_rows, start, end, skip_lo, skip_hi, offs_n, offs_d, offs_dv, row_ok,
        d_ok, dv_ok, stride_k_seq, stride_v_seq, stride_mask_k, scale, HAS_MASK, MASK_IS_BOOL, LOAD_AS_FP32,
        DOT_PRECISION, BLOCK_N)

    if SPLITS == 1:
        sink = m_i  # not read without sinks
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        out = normalized_rows(acc, l_i, m_i, sink, HAS_SINKS, MASKED_ROWS_ZERO)
        tl.store(out_ptr + b64 * stride_out_batch + head64[:, None] * stride_out_head
                 + pos64[:, None] * stride_out_seq + offs_dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    else:
        # Partials of output row (b * nheads + head) * seqlen_q + pos, split `split`: acc, then (m, l).
        prow = ((b64 * nheads + head64) * seqlen_q + pos64) * SPLITS + split
        tl.store(part_ptr + prow[:, None] * BLOCK_DV + offs_dv[None, :], acc, mask=row_ok[:, None])
        tl.store(ml_ptr + prow * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + prow * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["nheads", "seqlen_q"])
def _attention_decode_combine_kernel(
    out_ptr, stride_out_batch, stride_out_head, stride_out_seq,
    part_ptr, ml_ptr, sinks_ptr, nheads, seqlen_q,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr,
    HAS_SINKS: tl.constexpr, MASKED_ROWS_ZERO: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """One output row: the splits' partials rescaled to their common maximum and summed in split order."""
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)  # (b * nheads + head) * seqlen_q + pos
    pos = row % seqlen_q
    head = (row // seqlen_q) % nheads
    b = row // (seqlen_q * nheads)
    offs_s = tl.arange(0, SPLITS_POW2)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_ok = offs_s < SPLITS
    base = row * SPLITS + offs_s
    m = tl.load(ml_ptr + base * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(ml_ptr + base * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(part_ptr + base[:, None] * BLOCK_DV + offs_dv[None, :], mask=s_ok[:, None], other=0.0)
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    m_sub = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_sub)  # 0 for a split that saw no key (m = -inf)
    l_sum = tl.sum(l * w, 0)
    if HAS_SINKS:
        l_sum += tl.exp(sink - m_sub)
    if MASKED_ROWS_ZERO:
        l_sum = tl.where(l_sum == 0.0, 1.0, l_sum)
    out = tl.sum(acc * w[:, None], 0) * (1.0 / l_sum)
    tl.store(out_ptr + b * stride_out_batch + head * stride_out_head + pos * stride_out_seq + offs_dv,
             out.to(out_ptr.dtype.element_ty), mask=offs_dv < HEAD_DIM_V)


def decode_applies(batch: int, nheads: int, nheads_kv: int, seqlen_q: int, seqlen_k: int, is_causal: bool,
                   has_mask: bool, device: torch.device, fused_write: bool = False) -> bool:
    """Whether attention_fwd takes this kernel: a few query rows per KV group and no causal triangle
    (a decode step's causality is in its mask or key_len; top-left causal at one row sees key 0 only).

    With a mask, on a GPU, only where the prefill kernel would need more than one wave of programs
    or the key axis is split: over a short cache with its mask summary (Hugging Face's StaticCache)
    the prefill kernel skips the mask of the filled blocks and took 4.3 us against 4.4 here at batch
    1 (Llama-1.1B, GPT-2: 4.2 / 4.8), while at batch 8 it took 5.5 against 4.7 and over 2k keys
    24.8 against 7.5 (H200, bench/kernels/bench_attention_decode.py, 2026-11-28). A per-block
    branch on the summary here, or a mask-free loop over the leading blocks, made long caches slower.
    Under the interpreter every such call comes here (CPU tests cover this kernel). With
    `fused_write` (a cache write this kernel does, saving that kernel's launch) masked calls
    come here too. TRANSFUSE_DECODE_ATTENTION=0 sends every call to the prefill kernel (A/B runs)."""
    if os.environ.get("TRANSFUSE_DECODE_ATTENTION", "1") == "0":
        return False
    if is_causal or seqlen_q > MAX_QUERY_ROWS or seqlen_q * (nheads // nheads_kv) > MAX_ROWS:
        return False
    if not has_mask or fused_write or INTERPRET or device.type != "cuda":
        return True
    return num_splits(batch * nheads_kv, seqlen_k, device) > 1 or batch * nheads > num_sms(device)


def num_splits(programs: int, seqlen_k: int, device: torch.device) -> int:
    """Splits of the key axis: none when the (batch x KV head) programs fill the GPU already, else
    enough to fill it twice, at least _MIN_KEYS_PER_SPLIT keys each."""
    if INTERPRET or device.type != "cuda":
        # Each program is a pass of Python: split only the longer caches of CPU tests (kernel tests
        # force their splits), so that model tests stay quick.
        return 2 if seqlen_k >= 512 else 1
    sms = num_sms(device)
    if programs >= sms:
        # Already a wave: splitting only adds partials and the combine (llama-7B geometry at batch 8
        # over 2k keys: 65.7 us unsplit at the copy bandwidth, 77.1 us in two splits; H200, 2026-11-28).
        return 1
    return max(1, min(triton.cdiv(seqlen_k, _MIN_KEYS_PER_SPLIT), triton.cdiv(2 * sms, programs), _MAX_SPLITS))


def attention_decode_fwd(q, k, v, out, mask, mask_strides, summary, summary_strides, summary_block_n, num_summary_k,
                         key_len, sinks, scale, masked_rows_zero, splits=None, new_kv=None):
    """Fills `out` (attention_empty_out's layout); arguments already checked by attention.attention_fwd.

    mask_strides: the mask's strides broadcast to (batch, nheads, seqlen_q, seqlen_k) (0 where broadcast);
    summary_strides: (batch, head) strides of the int8 summary (0 where broadcast), whose blocks are
    summary_block_n keys wide (a multiple of this kernel's key block). `splits` overrides num_splits (tests).
    `new_kv`: (new_k, new_v, cos, sin, start) of a fused cache write (cos, sin None: no rotary), checked
    by the caller (kernels.kv_cache's checks); q is then unrotated and k, v are the cache.
    """
    batch, nheads, seqlen_q, head_dim = q.shape
    nheads_kv, seqlen_k = k.shape[1], k.shape[2]
    head_dim_v = v.shape[-1]
    kv_group = nheads // nheads_kv
    block_d, block_dv = max(16, next_power_of_2(head_dim)), max(16, next_power_of_2(head_dim_v))
    block_m = max(16, next_power_of_2(kv_group * seqlen_q))
    if INTERPRET:
        block_n = 32 if seqlen_k <= 64 else 64  # test caches cross block edges; model tests loop less
    else:
        block_n = 64 if max(block_d, block_dv) <= 128 else 32
    programs = batch * nheads_kv
    splits = splits or num_splits(programs, seqlen_k, q.device)
    rows = batch * nheads * seqlen_q
    if splits > 1:
        part = torch.empty((rows, splits, block_dv), dtype=torch.float32, device=q.device)
        ml = torch.empty((rows, splits, 2), dtype=torch.float32, device=q.device)
    else:
        part = ml = out  # never read
    smb, smh, smq, smk = mask_strides
    ssb, ssh = summary_strides
    rotary = new_kv is not None and new_kv[2] is not None
    if new_kv is not None:
        new_k, new_v, cos, sin, start = new_kv
        new_k = new_k if new_k.stride(-1) == 1 else new_k.contiguous()
        new_v = new_v if new_v.stride(-1) == 1 else new_v.contiguous()
        tables = (q, 0, 0, 0) * 4  # never read without rotary
        if rotary:
            (cos_q, cq), (sin_q, sq) = _broadcast_strides(cos, q.shape), _broadcast_strides(sin, q.shape)
            (cos_k, ck), (sin_k, sk) = _broadcast_strides(cos, new_k.shape), _broadcast_strides(sin, new_k.shape)
            tables = (cos_q, *cq, sin_q, *sq, cos_k, *ck, sin_k, *sk)
        rotary_args = (new_k, *new_k.stride()[:3], new_v, *new_v.stride()[:3], *tables, start.reshape(1))
    else:
        rotary_args = (q, 0, 0, 0) * 6 + (q,)  # never read
    _attention_decode_kernel[(programs, splits)](
        q, q.stride(0), q.stride(1), q.stride(2),
        k, k.stride(0), k.stride(1), k.stride(2),
        v, v.stride(0), v.stride(1), v.stride(2),
        out, out.stride(0), out.stride(1), out.stride(2),
        part, ml,
        mask if mask is not None else q, smb, smh, smq, smk,
        summary if summary is not None else q, ssb, ssh,
        key_len if key_len is not None else q, sinks if sinks is not None else q,
        *rotary_args,
        nheads, nheads_kv, kv_group, seqlen_q, seqlen_k, num_summary_k, float(scale),
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d, BLOCK_DV=block_dv,
        HAS_KEY_LEN=key_len is not None, HAS_SINKS=sinks is not None, HAS_MASK=mask is not None,
        MASK_IS_BOOL=mask is not None and mask.dtype == torch.bool,
        HAS_SUMMARY=summary is not None, SUMMARY_BLOCK_N=summary_block_n,
        SUMMARY_K_POW2=next_power_of_2(num_summary_k) if summary is not None else 1,
        GROUP_POW2=next_power_of_2(kv_group), MASKED_ROWS_ZERO=bool(masked_rows_zero),
        LOAD_AS_FP32=INTERPRET or q.dtype == torch.float32,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n, NEW_KV=new_kv is not None, ROTARY=rotary, NEW_ROWS=_NEW_ROWS,
        num_warps=4, num_stages=1 if INTERPRET else 3, **pdl(q),
    )
    if splits > 1:
        _attention_decode_combine_kernel[(rows,)](
            out, out.stride(0), out.stride(1), out.stride(2), part, ml,
            sinks if sinks is not None else q, nheads, seqlen_q,
            HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dv, SPLITS=splits, SPLITS_POW2=max(2, next_power_of_2(splits)),
            HAS_SINKS=sinks is not None, MASKED_ROWS_ZERO=bool(masked_rows_zero),
            num_warps=1 if block_dv <= 64 else 2, num_stages=1, **pdl(q),
        )
    return out
