"""gemm_few_rows with the weight shared out evenly among a fixed number of programs ("stream-K"):
the decode linears of a batch whose column blocks do not fill the GPU in whole waves.

    out = act(x @ weight.T + bias) + residual        (shapes, dtypes and numerics: gemm_few_rows's)

Why: a decode linear of a few rows is a read of its weight, and every SM must stream an equal
share of it for the read to run at the copy bandwidth. gemm_few_rows gives each program a column
block (times a split of K), so the programs come in whole tiles: Llama-1.1B's q/k/v projection has
80 column blocks of 32 rows for an H100's 132 SMs (40% idle), split in two it has 160 (a second,
28-program wave). Here the work is the (column block, K step) pairs in column-block order, and each
of PROGRAMS programs takes one contiguous, equal run of them. A run may start or end inside a
column block; the programs that share a block write fp32 partials and the last of them to arrive
sums them in program order (deterministic) and runs the epilogue, with gemm_few_rows's arrival
counters (kernels/split_counters.py) and gemm's finishing code.

Program p takes the pairs [p * T // P, (p + 1) * T // P) of T = blocks * steps, P <= T (so every
program has at least one). The programs sharing block t are those whose runs meet [t * S, (t + 1) * S)
(S steps a block): from the last program starting at or before t * S to the last starting at or
before (t + 1) * S - 1, where "the last program starting at or before i" is ceil((i + 1) * P / T) - 1.
Their slot in the partials is their rank among them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from transfuse.kernels import split_counters
from transfuse.kernels._config import INTERPRET, next_power_of_2, num_sms, pdl, wait_for_previous_kernel
from transfuse.kernels.gemm import (_WIDEN_DOT_OPERANDS, EpilogueOperands, _dot_precision, _linear_epilogue,
                                    _store_partials, check_linear_args)
from transfuse.kernels.gemm_few_rows import FEW_ROWS_MAX, few_rows_applies


class StreamConfig(NamedTuple):
    """Weight rows per column block (the MMA's M), K step, pipeline stages, warps, programs per SM."""
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int
    programs_per_sm: int


# Placeholder defaults until the GPU sweep (bench/kernels/bench_few_rows.py --stream) settles them.
_PLAIN = StreamConfig(32, 128, 6, 4, 1)
_GATED = StreamConfig(32, 128, 4, 4, 1)
# Under the interpreter: tiny tiles, and few programs so that runs cross block boundaries.
_INTERPRET_CONFIG = StreamConfig(16, 16, 1, 4, 3)


def default_config(gated: bool = False) -> StreamConfig:
    if INTERPRET:
        return _INTERPRET_CONFIG
    return _GATED if gated else _PLAIN


@triton.jit
def _last_program_at_or_before(i, PROGRAMS, total):
    """The last program whose run starts at or before pair i (runs as in the module docstring)."""
    return ((i + 1) * PROGRAMS + total - 1) // total - 1


@triton.jit
def _finish_shared_block(acc, acc_up, offs_m, offs_n, M, N, share, slot, ticket_ptr,
                         bias_ptr, stride_bias, res_ptr, stride_res_m, stride_res_n, out_ptr, stride_out_m,
                         part_ptr, stride_part_split, stride_part_m,
                         ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                         MAX_SHARE: tl.constexpr):
    """The end of one program's part of a column block: the epilogue when the program had the whole
    block; else its fp32 partials into `slot`, and the last of the `share` programs to arrive sums
    every slot (one (MAX_SHARE, rows, columns) load and a sum over its first axis: no loop, so the
    main loop around this stays a single pipelined loop; the same sum whoever came last) and runs
    the epilogue, then sets the ticket back to zero."""
    if share == 1:
        _linear_epilogue(acc, acc_up, offs_m, offs_n, M, N, bias_ptr, stride_bias, res_ptr, stride_res_m, stride_res_n,
                         out_ptr, stride_out_m, ACTIVATION, HAS_BIAS, HAS_RESIDUAL)
    else:
        GATED: tl.constexpr = ACTIVATION == "silu_mul"
        _store_partials(acc, acc_up, offs_m, offs_n, M, N, part_ptr, stride_part_split, stride_part_m, slot, GATED)
        tl.debug_barrier()  # every thread's partials written before the ticket makes them visible
        arrived = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == share - 1:
            slots = tl.arange(0, MAX_SHARE)
            mask = ((slots < share)[:, None, None] & (offs_m < M)[None, :, None] & (offs_n < N)[None, None, :])
            ptrs = (part_ptr + slots.to(tl.int64)[:, None, None] * stride_part_split
                    + offs_m.to(tl.int64)[None, :, None] * stride_part_m + offs_n[None, None, :])
            # .cg: from L2, where the other programs' partials are, never a stale L1 line
            total = tl.sum(tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg"), axis=0)
            total_up = total
            if GATED:
                total_up = tl.sum(tl.load(ptrs + N, mask=mask, other=0.0, cache_modifier=".cg"), axis=0)
            tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")
            _linear_epilogue(total, total_up, offs_m, offs_n, M, N, bias_ptr, stride_bias,
                             res_ptr, stride_res_m, stride_res_n, out_ptr, stride_out_m,
                             ACTIVATION, HAS_BIAS, HAS_RESIDUAL)


# M, PROGRAMS and the workspace strides unspecialised: a new row count or program count must not
# compile another kernel.
@triton.jit(do_not_specialize=["M", "PROGRAMS", "stride_part_split", "stride_part_m"])
def _few_rows_stream_kernel(
    x_ptr, stride_x_m,
    w_ptr, stride_w_n, stride_w_k,
    bias_ptr, stride_bias,
    res_ptr, stride_res_m, stride_res_n,
    out_ptr, stride_out_m,
    part_ptr, stride_part_split, stride_part_m,  # fp32 partials, one slice per sharing program
    ticket_ptr,  # int32 arrival counters, one per column block, zero at launch
    M, N, K,
    PROGRAMS,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,  # K is whole BLOCK_K steps: no K masks
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # 16 or 32: x's rows, padded
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MAX_SHARE: tl.constexpr,  # a power of two >= the most programs sharing one column block
    PDL: tl.constexpr = 0,
):
    GATED: tl.constexpr = ACTIVATION == "silu_mul"
    pid = tl.program_id(0)
    steps = tl.cdiv(K, BLOCK_K)
    total = tl.cdiv(N, BLOCK_N) * steps
    first_pair = (pid.to(tl.int64) * total // PROGRAMS).to(tl.int32)
    end = ((pid.to(tl.int64) + 1) * total // PROGRAMS).to(tl.int32)
    offs_m = tl.arange(0, BLOCK_M)
    rows = (offs_m % M).to(tl.int64)
    offs_kb = tl.arange(0, BLOCK_K)
    wait_for_previous_kernel(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = acc
    # One loop over this program's (column block, K step) pairs, so that the weight streams through
    # one software pipeline from the first pair to the last, across column blocks.
    for it in range(first_pair, end):
        block = it // steps
        step = it - block * steps
        cols = ((block * BLOCK_N + tl.arange(0, BLOCK_N)) % N).to(tl.int64)
        offs_k = step * BLOCK_K + offs_kb
        # (BLOCK_N, BLOCK_K) weight rows as stored: the dot's A operand; (BLOCK_K, BLOCK_M) of x.T its B
        w_ptrs = w_ptr + cols[:, None] * stride_w_n + offs_k[None, :] * stride_w_k
        x_ptrs = x_ptr + rows[None, :] * stride_x_m + offs_k[:, None]
        if EVEN_K:
            xt = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_mask = offs_k < K
            xt = tl.load(x_ptrs, mask=k_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
        if _WIDEN_DOT_OPERANDS:
            xt = xt.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up_ptrs = w_ptrs + N * stride_w_n
            if EVEN_K:
                w_up = tl.load(w_up_ptrs)
            else:
                w_up = tl.load(w_up_ptrs, mask=k_mask[None, :], other=0.0)
            if _WIDEN_DOT_OPERANDS:
                w_up = w_up.to(tl.float32)
            acc_up = tl.dot(w_up, xt, acc_up, input_precision=DOT_PRECISION)
        if (step == steps - 1) | (it == end - 1):
            first = _last_program_at_or_before(block * steps, PROGRAMS, total)
            last = _last_program_at_or_before(block * steps + steps - 1, PROGRAMS, total)
            offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
            _finish_shared_block(tl.trans(acc), tl.trans(acc_up) if GATED else tl.trans(acc), offs_m, offs_n, M, N,
                                 last - first + 1, pid - first, ticket_ptr + block,
                                 bias_ptr, stride_bias, res_ptr, stride_res_m, stride_res_n, out_ptr, stride_out_m,
                                 part_ptr, stride_part_split, stride_part_m, ACTIVATION, HAS_BIAS, HAS_RESIDUAL,
                                 MAX_SHARE)
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_up = acc


def stream_applies(x: torch.Tensor, weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether few_rows_stream_fwd can take this linear: gemm_few_rows's inputs, with no more column
    blocks than the arrival counters hold."""
    if not few_rows_applies(x, weight):
        return False
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    return triton.cdiv(n, default_config(gated).block_n) <= split_counters.CAPACITY


def programs_for(n: int, k: int, device: torch.device, config: StreamConfig) -> int:
    """PROGRAMS: programs_per_sm per SM, or one per (column block, K step) pair when there are fewer."""
    total = triton.cdiv(n, config.block_n) * triton.cdiv(max(k, 1), config.block_k)
    return max(1, min(total, config.programs_per_sm * num_sms(device, off_gpu=1)))


def max_sharing(total: int, programs: int, steps: int) -> int:
    """The most programs that share one column block: a block of `steps` pairs meets at most
    ceil((steps - 1) / run) + 1 runs of at least run = total // programs pairs."""
    run = max(1, total // programs)
    return min(programs, -(-(steps - 1) // run) + 1)


def few_rows_stream_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    residual: torch.Tensor | None = None,
    config: StreamConfig | tuple[int, int, int, int, int] | None = None,
    programs: int | None = None,
) -> torch.Tensor | None:
    """act(x @ weight.T + bias) + residual for x of at most 32 rows, fp16 or bf16, the weight shared
    evenly among `programs` programs (default: programs_for()).

    Arguments as gemm_few_rows.few_rows_fwd's. Returns None where the current stream has no arrival
    counters (a capture on a stream without them, kernels/split_counters.py): the caller runs
    few_rows_fwd instead.
    """
    N = check_linear_args(x, weight, bias, activation, residual)
    if not few_rows_applies(x, weight):
        raise ValueError(f"few_rows_stream_fwd takes 1..{FEW_ROWS_MAX} rows of fp16 or bf16, got "
                         f"{tuple(x.shape)} {x.dtype}: use gemm.linear_fwd")
    K = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if N == 0:
        return out.view(*lead, N)
    gated = activation == "silu_mul"
    conf = StreamConfig(*config) if config is not None else default_config(gated)
    blocks, steps = triton.cdiv(N, conf.block_n), triton.cdiv(K, conf.block_k)
    total = blocks * steps
    P = max(1, min(total, programs if programs is not None else programs_for(N, K, x.device, conf)))
    tickets = split_counters.counters(x.device, blocks)
    if tickets is None:
        return None
    res2 = residual.reshape(-1, N) if residual is not None else None
    share = max_sharing(total, P, steps)
    # Always a real workspace (at least 2 slices): the kernel's shared-or-not branch is at run time.
    epilogue = EpilogueOperands(out, bias, res2, activation, max(2, share))
    _few_rows_stream_kernel[(P,)](
        x2, x2.stride(0),
        weight, weight.stride(0), weight.stride(1),
        *epilogue.args,
        *epilogue.part_args,
        tickets,
        M, N, K, P,
        **epilogue.flags,
        EVEN_K=K % conf.block_k == 0,
        DOT_PRECISION=_dot_precision(x.dtype),
        BLOCK_M=16 if M <= 16 else FEW_ROWS_MAX, BLOCK_N=conf.block_n, BLOCK_K=conf.block_k,
        MAX_SHARE=next_power_of_2(max(2, share)),
        num_stages=conf.num_stages, num_warps=conf.num_warps, **pdl(x2),
    )
    return out.view(*lead, N)
