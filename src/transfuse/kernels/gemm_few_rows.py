"""GEMM with a fused epilogue for a few rows (up to 32; transfuse.linear times it from 3): the decode
linears of a batch and short prompts' prefill, on tensor cores.

    out = act(x @ weight.T + bias) + residual

    x:        (M, K)  M <= 32 rows, unit stride along K, any row stride
    weight:   (N, K)  nn.Linear layout, read in place through its strides
    bias:     (N,)
    residual: (M, N)  any strides
    out:      (M, N)  contiguous, dtype of x

Semantics, activations (the gated "<act>_mul": weight (2N, K) = [W_gate; W_up]) and numerics are those of
`gemm.linear_fwd`: fp32 products and sums, the epilogue on fp32, one rounding at the store; its
epilogue and split-K partials layout are reused as they are. A split launch has no reduce kernel: the
last program of a column block to finish sums the partials (gemm._finish_tile_in_last_split, with
the arrival counters of kernels/split_counters.py).

Why a third linear kernel: with a handful of rows a linear is bound by reading the weight once,
like the GEMV (kernels/gemv.py), but from 4 rows up the GEMV's CUDA-core products set the pace
(M multiply-adds per weight element). gemm.linear_fwd puts the rows on the tensor cores, but as
the dot's M side: a 16-row tile is below the 64 rows of a Hopper warpgroup MMA, so it runs the
older mma.sync path with 16-row tiles of mostly padding. Here the product is computed transposed,
out.T = weight @ x.T ("swap AB", as cuBLAS's 64x8 decode kernels do): the weight's BLOCK_N rows are
the MMA's M side (32 rows by default: mma.sync; 64 or more: a warpgroup MMA) and the rows of x,
padded to 16 or 32, its N side, so the weight streams through the pipelined shared-memory loads
(cp.async) of an ordinary Triton matmul and every loaded weight element is used once, by one MMA.

Measured in a batch-8 decode step of Llama-1.1B (H100, bench/decode_step_time.py, 2026-11-26):
1,277 -> 1,226 us, from the gated gate_up (the dispatcher keeps cuBLAS where it is as fast).

Tried and removed: the RMSNorm or LayerNorm that feeds the linear (with its residual add) inside
this kernel's launch, every program reading its rows whole for their statistics and normalising each
x tile before the dot, to save a layer's two norm launches (1.5-2.7 us each) in batched decode. It
was exact, and slower than the norm kernel then few_rows_fwd in both its forms (H200, fp16, 8 rows,
Llama-1.1B): QKV 14.3 against 1.6 + 5.3 us, and with the x tiles loaded a K step ahead 12.1 against
7.4; gate-up 28.2 against 1.6 + 10.7, then 20.8 against 16.8; at 4 warps and at 8
(bench/results/2026-12-02-nvidia-h200-norm-few-rows-decode-step-ab-session42.log and
2026-12-02-nvidia-h200-gated-warps-norm-few-rows-session43.log). The kernel, its tests and its timing
tool are at commit 6be8733 (norm_few_rows_fwd).

Program (pid_n, pid_k) owns output columns [pid_n * BLOCK_N, +BLOCK_N) for all rows and the pid_k-th
of SPLIT_K slices of K; rows past M wrap back into range (never stored), so loads need masks along
K only, and none when every split holds whole BLOCK_K steps.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from transfuse.kernels import split_counters
from transfuse.kernels._config import INTERPRET, num_sms, pdl, wait_for_previous_kernel
from transfuse.kernels.gemm import (_WIDEN_DOT_OPERANDS, EpilogueOperands, _dot_precision, _finish_tile_in_last_split,
                                    check_linear_args, is_gated)

NO_SPLIT_ENV = "TRANSFUSE_FEW_ROWS_NO_SPLIT"  # =1: never time a split (A/B runs)
FEW_ROWS_MAX = 32  # the x side of the dot: rows are padded (wrapped) to 16, or to 32 from 17
_DTYPES = (torch.float16, torch.bfloat16)  # fp32 operands would halve the pipeline: gemm.linear_fwd takes them


class FewRowsConfig(NamedTuple):
    """Weight rows per program (the MMA's M), K step, programs per column block along K, pipeline
    stages, warps."""
    block_n: int
    block_k: int
    split_k: int
    num_stages: int
    num_warps: int


# Defaults (H100 SXM, torch 2.11, triton 3.6, fp16, weights from HBM, 2026-11-26;
# bench/kernels/bench_few_rows.py, bench/results/2026-11-26-*-few-rows-sweep-session15.log): over
# BLOCK_N 32-128, BLOCK_K 64-256, 3 or 5 stages and splits of 1-8, at 4, 8 and 16 rows:
# - plain linears: 32 x 256 with 5 stages was best or within 2% of it on every Llama-1.1B and
#   Llama-7B shape (1.1B down + residual 12.9 us at 8 rows, cuBLAS 14.5; 7B lm_head 99% of copy
#   bandwidth);
# - silu_mul (two weight tiles a step): 64 x 128 with 3 stages (1.1B gate_up 18.6 us, cuBLAS and
#   its eager epilogue 24.7);
# - split-K with a reduce kernel lost everywhere, by 5-15%: the reduce launch cost more than the
#   extra programs saved. Finished in the last program instead (H200, 2026-11-28,
#   bench/results/2026-11-28-nvidia-h200-few-rows-split-sweep-session30.log), a split wins where K
#   is long and the column blocks few: 1.1B down + residual at 8 rows 15.4 -> 11.6 us (split 2;
#   cuBLAS 12.9), o + residual 7.3 -> 6.6 (split 4), bert-base down + residual 8.8 -> 6.0 (split 4);
#   it loses on short K (bert-base qkv 4.2 -> 5.2) and wide N (lm_head 36 -> 48). So the default
#   stays unsplit and the dispatcher times split_candidates() per shape.
# - 8 warps for the gated config, where ptxas reports no spills (684 bytes a thread at 4 warps with
#   triton 3.6): slower, 15.8 against 14.7 us for Llama-1.1B's gate-up at 8 rows, and a batch-8 step
#   of 1,060 / 1,067 against 1,048 / 1,050 us (H200, session 43,
#   bench/results/2026-12-02-*-gated-warps-norm-few-rows-session43.log). The spills cost less than
#   the warps.
_PLAIN = FewRowsConfig(32, 256, 1, 5, 4)
_GATED = FewRowsConfig(64, 128, 1, 3, 4)
_INTERPRET_CONFIG = FewRowsConfig(16, 16, 1, 1, 4)


def default_config(gated: bool = False) -> FewRowsConfig:
    """The config of a linear, `gated` for a gated activation (the interpreter's under TRITON_INTERPRET).
    One for every shape: the sweep's best was within 2% of it on every Llama shape, and the rows do
    not change it (the x side of the dot is 16 or 32 wide)."""
    if INTERPRET:
        return _INTERPRET_CONFIG
    return _GATED if gated else _PLAIN


def few_rows_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether few_rows_fwd takes this linear: x of 1..32 rows, fp16 or bf16, the weight of x's dtype
    and device, 2-d."""
    if x.dim() == 0 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return False
    rows = x.numel() // max(x.shape[-1], 1)
    return (x.dtype in _DTYPES and weight.dtype == x.dtype and weight.device == x.device
            and 0 < rows <= FEW_ROWS_MAX)


# M and the workspace strides unspecialised: a new row count or split must not compile another kernel.
@triton.jit(do_not_specialize=["M", "SPLIT_K", "stride_part_split", "stride_part_m"])
def _few_rows_fwd_kernel(
    x_ptr, stride_x_m,
    w_ptr, stride_w_n, stride_w_k,
    bias_ptr, stride_bias,
    res_ptr, stride_res_m, stride_res_n,
    out_ptr, stride_out_m,
    part_ptr, stride_part_split, stride_part_m,  # fp32 partials when SPLIT_K > 1
    ticket_ptr,  # int32 arrival counters, one per column block, zero at launch (SPLIT_K > 1)
    M, N, K,
    SPLIT_K,
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,  # every split is whole BLOCK_K steps: no K masks
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # 16 or 32: x's rows, padded
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    GATED: tl.constexpr = ((ACTIVATION == "silu_mul" or ACTIVATION == "gelu_mul")
                           or (ACTIVATION == "gelu_tanh_mul" or ACTIVATION == "relu_mul"))
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)

    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
    k_len = min(K - k_start, k_per_split)
    offs_k = k_start + tl.arange(0, BLOCK_K)

    # (BLOCK_N, BLOCK_K) weight rows, K-contiguous in nn.Linear's layout: the dot's A operand as
    # stored. (BLOCK_K, BLOCK_M) of x.T: its B operand.
    w_ptrs = w_ptr + cols[:, None] * stride_w_n + offs_k[None, :] * stride_w_k
    w_up_ptrs = w_ptr + (cols + N)[:, None] * stride_w_n + offs_k[None, :] * stride_w_k
    x_ptrs = x_ptr + rows[None, :] * stride_x_m + offs_k[:, None]
    wait_for_previous_kernel(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = acc
    for k in range(0, k_len, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_mask = tl.arange(0, BLOCK_K) < k_len - k
            xt = tl.load(x_ptrs, mask=k_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
        if _WIDEN_DOT_OPERANDS:
            xt = xt.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
        if GATED:
            if EVEN_K:
                w_up = tl.load(w_up_ptrs)
            else:
                w_up = tl.load(w_up_ptrs, mask=k_mask[None, :], other=0.0)
            if _WIDEN_DOT_OPERANDS:
                w_up = w_up.to(tl.float32)
            acc_up = tl.dot(w_up, xt, acc_up, input_precision=DOT_PRECISION)
            w_up_ptrs += BLOCK_K * stride_w_k
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_w_k

    # back to (rows, columns) for gemm.py's epilogue and partials layout
    acc = tl.trans(acc)
    acc_up = tl.trans(acc_up) if GATED else acc
    _finish_tile_in_last_split(acc, acc_up, offs_m, offs_n, M, N, SPLIT_K, pid_k, ticket_ptr + pid_n,
                               bias_ptr, stride_bias, res_ptr, stride_res_m, stride_res_n, out_ptr, stride_out_m,
                               part_ptr, stride_part_split, stride_part_m, ACTIVATION, HAS_BIAS, HAS_RESIDUAL)


def few_rows_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    residual: torch.Tensor | None = None,
    config: FewRowsConfig | tuple[int, int, int, int, int] | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """act(x @ weight.T + bias) + residual for x of at most 32 rows, fp16 or bf16.

    x: (..., K) with prod(...) <= 32; weight: (N, K), or (2N, K) for a gated activation; bias: (N,) or
    (2N,); residual: (..., N). Returns (..., N), contiguous, dtype of x.
    `config=(BLOCK_N, BLOCK_K, SPLIT_K, num_stages, num_warps)` overrides the heuristic, `split_k`
    its split (the dispatcher times split_candidates()). A split is at most one per K step, and none
    where the stream has no counters (a capture on a stream without them, kernels/split_counters.py).
    """
    N = check_linear_args(x, weight, bias, activation, residual)
    if not few_rows_applies(x, weight):
        raise ValueError(f"few_rows_fwd takes 1..{FEW_ROWS_MAX} rows of fp16 or bf16, got "
                         f"{tuple(x.shape)} {x.dtype}: use gemm.linear_fwd")
    K = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    x_side = 16 if M <= 16 else FEW_ROWS_MAX  # the dot's N: one compile for 1-16 rows, one for 17-32
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if N == 0:
        return out.view(*lead, N)
    res2 = residual.reshape(-1, N) if residual is not None else None
    gated = is_gated(activation)
    conf = FewRowsConfig(*config) if config is not None else default_config(gated)
    blocks = triton.cdiv(N, conf.block_n)
    split = max(1, min(conf.split_k if split_k is None else split_k, triton.cdiv(max(K, 1), conf.block_k)))
    tickets = split_counters.counters(x.device, blocks) if split > 1 else None
    if tickets is None:
        split = 1
    epilogue = EpilogueOperands(out, bias, res2, activation, split)
    _few_rows_fwd_kernel[(blocks, split)](
        x2, x2.stride(0),
        weight, weight.stride(0), weight.stride(1),
        *epilogue.args,
        *epilogue.part_args,
        # unsplit: an int32 view of the partials' stand-in, never read; the pointer type, and with
        # it the compiled kernel, is the split launch's
        tickets if tickets is not None else epilogue.part_args[0].view(torch.int32),
        M, N, K, split,
        **epilogue.flags,
        EVEN_K=K % (conf.block_k * split) == 0,
        DOT_PRECISION=_dot_precision(x.dtype),
        BLOCK_M=x_side, BLOCK_N=conf.block_n, BLOCK_K=conf.block_k,
        num_stages=conf.num_stages, num_warps=conf.num_warps, **pdl(x2),
    )
    return out.view(*lead, N)


def split_candidates(n: int, k: int, device: torch.device, gated: bool = False) -> list[int]:
    """The splits worth timing for an (n, k) linear besides 1: those that bring the programs
    (column blocks x splits) up to about one or two per SM, each split whole K steps apart."""
    conf = default_config(gated)
    blocks, steps = triton.cdiv(n, conf.block_n), triton.cdiv(max(k, 1), conf.block_k)
    if device.type != "cuda" or blocks > split_counters.CAPACITY or os.environ.get(NO_SPLIT_ENV) == "1":
        return [1]
    sms = num_sms(device)
    out = {1}
    for target in (sms, 2 * sms):
        want = max(1, round(target / blocks))
        # the largest divisor of the K steps not above the wanted split: no split ends in a tail
        out.add(max(d for d in range(1, min(want, steps) + 1) if steps % d == 0))
    return sorted(out)
