"""GEMM with a fused epilogue: the `nn.Linear` of a transformer and whatever follows it elementwise.

    out = act(x @ weight.T + bias) + residual

    x:        (M, K)  rows of the flattened (..., K) input; unit stride along K, any row stride
    weight:   (N, K)  as `F.linear` takes it, read in place through its strides (no transposed copy)
    bias:     (N,)
    residual: (M, N)  any strides
    out:      (M, N)  contiguous, dtype of x

`activation` is one of ACTIVATIONS. "<act>_mul" is a gated unit (Shazeer 2020, "GLU Variants Improve
Transformer"): "silu_mul" the SwiGLU of LLaMA-style MLPs, "gelu_tanh_mul" / "gelu_mul" the GeGLU of
Gemma and T5 v1.1, "relu_mul" ReGLU. weight is (2N, K) = [W_gate; W_up] stacked along rows, bias
(2N,), and out = act(x @ W_gate.T + b_gate) * (x @ W_up.T + b_up). One program computes the gate
and up tiles of the same output columns, so the (M, 2N) intermediate never reaches memory.

Numerics: products accumulate in fp32 (tl.dot), the whole epilogue (bias, activation, gate,
residual) runs on the fp32 accumulator and is rounded once, at the store. PyTorch's eager path
rounds after the GEMM and again after every elementwise op, so ours is at least as close to an fp32
reference.

Program order: output tiles are visited in groups of GROUP_M tile-rows (the "grouped ordering" of
Triton's matmul tutorial), so programs that run together share weight columns and x rows in L2.

Split-K (small M): with few rows there are too few output tiles to occupy the GPU and the GEMM is
bound by reading the weight. SPLIT_K programs then share the K range of one tile; each writes its
fp32 partial tile to a workspace and a second small kernel sums the partials in a fixed order
(deterministic, unlike atomics) and applies the epilogue, which cannot run on a partial sum because
the activation is not linear.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl
import triton.testing

from transfuse.kernels._config import (INTERPRET, compiling_only, next_power_of_2, num_sms, pdl, tune_configs,
                                      wait_for_previous_kernel)

# "<act>_mul" is a gated unit (GLU variants): act(gate) * up, weight [W_gate; W_up]. SwiGLU (LLaMA),
# GeGLU with exact or tanh GELU (T5 v1.1 / Flan-T5, Gemma), ReGLU.
GATED_ACTIVATIONS = ("silu_mul", "gelu_mul", "gelu_tanh_mul", "relu_mul")
ACTIVATIONS = ("none", "gelu", "gelu_tanh", "relu", "tanh", "silu", *GATED_ACTIVATIONS)


def is_gated(activation: str) -> bool:
    """Whether `activation` is a gated unit: weight (2N, K) = [W_gate; W_up], output N wide."""
    return activation in GATED_ACTIVATIONS

# The interpreter's tl.dot is wrong for bf16 operands; there (only) the tiles are widened to fp32
# before the dot. On a GPU they must stay 16-bit so the dot runs on the tensor cores.
_WIDEN_DOT_OPERANDS = tl.constexpr(INTERPRET)

# M regimes. The row count picks which tile shapes are worth trying: tiles taller than the matrix
# only waste work, and a 16-row GEMM is a weight-streaming problem, not a compute one.
FEW_M_MAX = 16
SMALL_M_MAX = 64
MID_M_MAX = 1024


def m_bucket(m: int) -> int:
    """Rows rounded up to a power of two (at least 16): the M that autotuning and dispatch key on."""
    return max(16, next_power_of_2(m))


def _regime(m_bucket_: int) -> str:
    if m_bucket_ <= SMALL_M_MAX:
        return "small"
    if m_bucket_ <= MID_M_MAX:
        return "mid"
    return "large"


# -------------------------------------------------------------------------------------------------
# Configs
# -------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps) per M regime, for H100 (228 KB shared memory
# per SM, wgmma needs 64-row warpgroup tiles, mma.sync below that).
_TILES = {
    # Weight-bandwidth bound: short tiles, long K steps (each weight row segment is a 256-512 B
    # contiguous read), deep pipelines to keep many loads in flight, narrow N so enough programs run.
    "small": [
        (16, 32, 256, 4, 4),
        (16, 64, 128, 5, 4),
        (16, 128, 128, 4, 4),
        (32, 64, 128, 4, 4),
        (64, 64, 128, 4, 4),
    ],
    # Neither bound clearly: medium tiles so that N=768 still gives enough programs (M=1024 with
    # 128x128 tiles would be 48 programs on 132 SMs).
    "mid": [
        (64, 64, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (128, 64, 64, 4, 4),
        (128, 128, 64, 3, 8),
    ],
    # Compute bound: big tiles (more FLOPs per loaded byte), 3-4 stages, 8 warps (two warpgroups).
    "large": [
        (128, 256, 64, 3, 8),
        (256, 128, 64, 3, 8),
        (128, 128, 64, 4, 8),  # twice the programs of 128x256 where N is small (N=768)
        (128, 64, 64, 4, 4),
        (128, 64, 64, 4, 8),  # silu_mul only (two accumulators: 128x128 of work), spill-free
    ],
}

# Shared memory per program we allow a config to ask for (H100: 227 KB usable, leave room for the
# epilogue's layout conversion scratch).
_SMEM_BUDGET = 200 * 1024

# Under the interpreter: small blocks so tiny test shapes still cross block edges in M, N and K.
_INTERPRET_CONFIG = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16}, num_warps=4, num_stages=1)


def _tile_of(conf: triton.Config) -> tuple[int, int, int, int, int]:
    kw = conf.kwargs
    return (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], conf.num_stages, conf.num_warps)


def _smem_bytes(tile: tuple[int, int, int, int, int], gated: bool, element_size: int) -> int:
    """Shared memory a tile's pipeline asks for: num_stages x (x tile + weight tile(s))."""
    block_m, block_n, block_k, num_stages, _ = tile
    return (block_m + (2 * block_n if gated else block_n)) * block_k * element_size * num_stages


def _fit_smem(tile: tuple[int, int, int, int, int], gated: bool, element_size: int) -> tuple[int, int, int, int, int]:
    """The tile with fewer stages, then shorter K steps, until its pipeline fits _SMEM_BUDGET: the
    tiles are sized for 16-bit operands, and fp32 ones (4 bytes) overflow the 227 KB of an H100
    (a gated 16x64 tile with 5 stages asked for 295 KB and failed to launch)."""
    block_m, block_n, block_k, num_stages, num_warps = tile
    while _smem_bytes((block_m, block_n, block_k, num_stages, num_warps), gated, element_size) > _SMEM_BUDGET:
        if num_stages > 2:
            num_stages -= 1
        elif block_k > 32:
            block_k //= 2
        else:
            break
    return (block_m, block_n, block_k, num_stages, num_warps)


def keep(conf: triton.Config) -> bool:
    """Static prune: configs whose pipeline does not fit in shared memory even in the lightest
    case (16-bit operands, one weight tile)."""
    return _smem_bytes(_tile_of(conf), gated=False, element_size=2) <= _SMEM_BUDGET


def _linear_configs() -> list[triton.Config]:
    """Every regime's configs (the interpreter's one under TRITON_INTERPRET); _prune_for_shape picks
    the regime's share per call."""
    return tune_configs(_all_configs(), _INTERPRET_CONFIG)


def _all_configs() -> list[triton.Config]:
    seen, configs = set(), []
    for tiles in _TILES.values():
        for tile in tiles:
            if tile in seen:
                continue
            seen.add(tile)
            block_m, block_n, block_k, num_stages, num_warps = tile
            conf = triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k},
                                 num_stages=num_stages, num_warps=num_warps)
            if keep(conf):
                configs.append(conf)
    return configs


def _prune_for_shape(configs, named_args, **kwargs):
    """Shape-dependent prune: the configs of this M regime that fit the shape and shared memory."""
    args = {**named_args, **kwargs}
    bucket = args["M_BUCKET"]
    wanted = set(_TILES[_regime(bucket)])
    gated = is_gated(args["ACTIVATION"])
    elem = args["x_ptr"].element_size()
    kept = []
    for conf in configs:
        block_m, block_n, _, _, num_warps = tile = _tile_of(conf)
        if tile not in wanted or block_m > bucket:
            continue
        # A gated program holds two accumulators and streams two weight tiles.
        weight_rows = 2 * block_n if gated else block_n
        # 8 warps only pay off on 128x128 of accumulator or more: below that each warp holds too
        # small a piece of it to hide latency with.
        if num_warps == 8 and block_m * weight_rows < 128 * 128:
            continue
        # More than 128 fp32 accumulator registers per thread spills (255 is the hardware cap and
        # the pipeline's addresses and loaded fragments need the rest).
        if block_m * weight_rows > 128 * 32 * num_warps:
            continue
        if _smem_bytes(tile, gated, elem) > _SMEM_BUDGET:
            continue
        kept.append(conf)
    if kept or INTERPRET:
        return kept or configs[:1]
    # Nothing of this regime fits (fp32 operands): its first tile, fitted to shared memory.
    block_m, block_n, block_k, num_stages, num_warps = _fit_smem(_TILES[_regime(bucket)][0], gated, elem)
    return [triton.Config({"BLOCK_M": min(block_m, bucket), "BLOCK_N": block_n, "BLOCK_K": block_k},
                          num_stages=num_stages, num_warps=num_warps)]


# -------------------------------------------------------------------------------------------------
# Kernels
# -------------------------------------------------------------------------------------------------


@triton.jit
def _activate(h, ACTIVATION: tl.constexpr):
    """The activation on an fp32 tile (for a gated one, "<act>_mul", act of the gate)."""
    if ACTIVATION == "gelu" or ACTIVATION == "gelu_mul":
        # exact GELU, x * Phi(x)
        h = 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh" or ACTIVATION == "gelu_tanh_mul":
        # 0.5 x (1 + tanh(u)) == x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3); the sigmoid
        # form needs no tanh (not in core triton.language) and saturates cleanly: exp overflow to
        # inf gives 0, not nan.
        u = 0.7978845608028654 * (h + 0.044715 * h * h * h)
        h = h / (1.0 + tl.exp(-2.0 * u))
    elif ACTIVATION == "relu" or ACTIVATION == "relu_mul":
        h = tl.maximum(h, 0.0)
    elif ACTIVATION == "tanh":
        # tanh(x) = 2 sigmoid(2x) - 1; fp32 absolute error ~1e-7, far below a 16-bit output's ulp
        h = 2.0 / (1.0 + tl.exp(-2.0 * h)) - 1.0
    elif ACTIVATION == "silu" or ACTIVATION == "silu_mul":
        h = h / (1.0 + tl.exp(-h))
    return h


@triton.jit
def _linear_epilogue(
    acc, acc_up, offs_m, offs_n, M, N,
    bias_ptr, stride_bias,
    res_ptr, stride_res_m, stride_res_n,
    out_ptr, stride_out_m,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """bias, activation (and gate), residual on the fp32 accumulator; one rounding at the store.
    `acc_up` is the up-projection tile of a gated activation and ignored otherwise."""
    GATED: tl.constexpr = ((ACTIVATION == "silu_mul" or ACTIVATION == "gelu_mul")
                           or (ACTIVATION == "gelu_tanh_mul" or ACTIVATION == "relu_mul"))
    mask_m = offs_m < M
    mask_n = offs_n < N
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=mask_n, other=0.0).to(tl.float32)
        acc += bias[None, :]
        if GATED:
            bias_up = tl.load(bias_ptr + (offs_n + N) * stride_bias, mask=mask_n, other=0.0).to(tl.float32)
            acc_up += bias_up[None, :]
    h = _activate(acc, ACTIVATION)
    if GATED:
        h = h * acc_up
    rows = offs_m.to(tl.int64)
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_RESIDUAL:
        res_ptrs = res_ptr + rows[:, None] * stride_res_m + offs_n[None, :] * stride_res_n
        h += tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
    out_ptrs = out_ptr + rows[:, None] * stride_out_m + offs_n[None, :]
    tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_partials(
    acc, acc_up, offs_m, offs_n, M, N,
    part_ptr, stride_part_split, stride_part_m, pid_k,
    GATED: tl.constexpr,
):
    """A split-K program's fp32 partial sums into split pid_k's slice of the workspace, where
    _linear_splitk_reduce_kernel reads them: the gate's (or only) partials in columns [0, N), the
    up's in [N, 2N)."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    part_ptrs = (part_ptr + pid_k.to(tl.int64) * stride_part_split
                 + offs_m.to(tl.int64)[:, None] * stride_part_m + offs_n[None, :])
    tl.store(part_ptrs, acc, mask=mask)
    if GATED:
        tl.store(part_ptrs + N, acc_up, mask=mask)


@triton.jit
def _finish_tile(
    acc, acc_up, offs_m, offs_n, M, N, SPLIT_K, pid_k,
    bias_ptr, stride_bias,
    res_ptr, stride_res_m, stride_res_n,
    out_ptr, stride_out_m,
    part_ptr, stride_part_split, stride_part_m,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """The end of a main kernel's (rows, columns) tile: its fp32 partials when split along K (the
    reduce kernel runs the epilogue), else the epilogue. A runtime branch, not a constexpr: split
    and unsplit launches share one compiled kernel. The decode kernels' tail (gemv, gemv_kmajor,
    gemm_few_rows); linear_fwd's own also splits big epilogues in halves."""
    GATED: tl.constexpr = ((ACTIVATION == "silu_mul" or ACTIVATION == "gelu_mul")
                           or (ACTIVATION == "gelu_tanh_mul" or ACTIVATION == "relu_mul"))
    if SPLIT_K > 1:
        _store_partials(acc, acc_up, offs_m, offs_n, M, N, part_ptr, stride_part_split, stride_part_m, pid_k,
                        GATED)
    else:
        _linear_epilogue(acc, acc_up, offs_m, offs_n, M, N, bias_ptr, stride_bias,
                         res_ptr, stride_res_m, stride_res_n, out_ptr, stride_out_m,
                         ACTIVATION, HAS_BIAS, HAS_RESIDUAL)


@triton.jit
def _finish_tile_in_last_split(
    acc, acc_up, offs_m, offs_n, M, N, SPLIT_K, pid_k, ticket_ptr,
    bias_ptr, stride_bias,
    res_ptr, stride_res_m, stride_res_n,
    out_ptr, stride_out_m,
    part_ptr, stride_part_split, stride_part_m,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """_finish_tile without a reduce kernel: split programs write their partials (_finish_tile) and
    take a ticket of their column block (`ticket_ptr`, zero at launch, kernels/split_counters.py);
    the one that arrives last sums every split's partials in split order (the result does not
    depend on which program came last), runs the epilogue and sets the ticket back to zero for the
    next launch. Unsplit, _finish_tile runs the epilogue."""
    GATED: tl.constexpr = ((ACTIVATION == "silu_mul" or ACTIVATION == "gelu_mul")
                           or (ACTIVATION == "gelu_tanh_mul" or ACTIVATION == "relu_mul"))
    _finish_tile(acc, acc_up, offs_m, offs_n, M, N, SPLIT_K, pid_k, bias_ptr, stride_bias,
                 res_ptr, stride_res_m, stride_res_n, out_ptr, stride_out_m,
                 part_ptr, stride_part_split, stride_part_m, ACTIVATION, HAS_BIAS, HAS_RESIDUAL)
    if SPLIT_K > 1:
        # Every thread's partials are written before the ticket's release makes them visible GPU-wide.
        tl.debug_barrier()
        arrived = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
            part_ptrs = part_ptr + offs_m.to(tl.int64)[:, None] * stride_part_m + offs_n[None, :]
            total = tl.zeros_like(acc)
            total_up = tl.zeros_like(acc)
            for s in range(0, SPLIT_K):
                # .cg: from L2, where the other programs' partials are, never a stale L1 line
                total += tl.load(part_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                if GATED:
                    total_up += tl.load(part_ptrs + N, mask=mask, other=0.0, cache_modifier=".cg")
                part_ptrs += stride_part_split
            tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")
            _linear_epilogue(total, total_up, offs_m, offs_n, M, N, bias_ptr, stride_bias,
                             res_ptr, stride_res_m, stride_res_n, out_ptr, stride_out_m,
                             ACTIVATION, HAS_BIAS, HAS_RESIDUAL)


# Unspecialised: a new row count or split (or the unsplit launch's dummy partials) must not compile
# another kernel, which Triton's specialisation of ints on ==1 and on divisibility by 16 would do.
@triton.jit(do_not_specialize=["M", "M_BUCKET", "SPLIT_K", "stride_part_split", "stride_part_m"])
def _linear_fwd_kernel(
    x_ptr, stride_x_m,
    w_ptr, stride_w_n, stride_w_k,
    bias_ptr, stride_bias,
    res_ptr, stride_res_m, stride_res_n,
    out_ptr, stride_out_m,
    part_ptr, stride_part_split, stride_part_m,  # fp32 partials when SPLIT_K > 1
    M, N, K,
    SPLIT_K,  # > 1: this program writes its fp32 partial tile; the reduce kernel does the epilogue
    M_BUCKET,  # unused in the body: the autotune key, so tuning follows M's power-of-two bucket
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVEN_K: tl.constexpr,  # every program's K range is whole BLOCK_K steps: no K masks
    SPLIT_EPILOGUE: tl.constexpr,  # run the epilogue on two (BLOCK_M, BLOCK_N / 2) halves
    DOT_PRECISION: tl.constexpr,  # fp32 inputs only: "ieee" unless the user allowed tf32
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (_config.pdl)
):
    wait_for_previous_kernel(PDL)
    GATED: tl.constexpr = ((ACTIVATION == "silu_mul" or ACTIVATION == "gelu_mul")
                           or (ACTIVATION == "gelu_tanh_mul" or ACTIVATION == "relu_mul"))
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)

    # Grouped ordering: consecutive programs walk GROUP_M tile-rows down one band of columns, so a
    # wave of programs touches GROUP_M row panels of x and few column panels of the weight.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows and columns past the edge wrap back into range instead of being masked: the main loop's
    # loads then need masks along K only, and the wrapped rows are never stored.
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)

    # This program's K range: whole BLOCK_K steps per split, the last split takes the remainder.
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
    k_len = min(K - k_start, k_per_split)
    offs_k = k_start + tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + rows[:, None] * stride_x_m + offs_k[None, :]
    # The weight is (N, K); its (BLOCK_K, BLOCK_N) tile is W^T read through the strides, which the
    # dot consumes directly (no transposed copy of the weight anywhere).
    w_ptrs = w_ptr + offs_k[:, None] * stride_w_k + cols[None, :] * stride_w_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        # the up rows start N rows below the gate rows (int64: N * stride can pass 2**31)
        w_up_ptrs = w_ptr + offs_k[:, None] * stride_w_k + (cols + N)[None, :] * stride_w_n
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc_up = acc

    for k in range(0, k_len, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_mask = tl.arange(0, BLOCK_K) < k_len - k
            a = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
        if _WIDEN_DOT_OPERANDS:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:
            if EVEN_K:
                b_up = tl.load(w_up_ptrs)
            else:
                b_up = tl.load(w_up_ptrs, mask=k_mask[:, None], other=0.0)
            if _WIDEN_DOT_OPERANDS:
                b_up = b_up.to(tl.float32)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
            w_up_ptrs += BLOCK_K * stride_w_k
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_w_k

    # A runtime branch, not a constexpr: split and unsplit launches share one compiled kernel.
    if SPLIT_K > 1:
        # Partial sums stay fp32: the reduce kernel sums them and runs the epilogue.
        _store_partials(acc, acc_up, offs_m, offs_n, M, N, part_ptr, stride_part_split, stride_part_m, pid_k, GATED)
    elif SPLIT_EPILOGUE:
        # Big accumulators (128 fp32 registers a thread) leave no room for the residual tile and
        # the activation's temporaries: ptxas spills ~400 B a thread on 128x256 with a residual.
        # Half a tile at a time, it does not.
        HALF_N: tl.constexpr = BLOCK_N // 2
        acc_0, acc_1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF_N)), (0, 2, 1)))
        if GATED:
            up_0, up_1 = tl.split(tl.permute(tl.reshape(acc_up, (BLOCK_M, 2, HALF_N)), (0, 2, 1)))
        else:
            up_0, up_1 = acc_0, acc_1
        offs_n_0 = pid_n * BLOCK_N + tl.arange(0, HALF_N)
        _linear_epilogue(acc_0, up_0, offs_m, offs_n_0, M, N, bias_ptr, stride_bias,
                         res_ptr, stride_res_m, stride_res_n, out_ptr, stride_out_m,
                         ACTIVATION, HAS_BIAS, HAS_RESIDUAL)
        _linear_epilogue(acc_1, up_1, offs_m, offs_n_0 + HALF_N, M, N, bias_ptr, stride_bias,
                         res_ptr, stride_res_m, stride_res_n, out_ptr, stride_out_m,
                         ACTIVATION, HAS_BIAS, HAS_RESIDUAL)
    else:
        _linear_epilogue(acc, acc_up, offs_m, offs_n, M, N, bias_ptr, stride_bias,
                         res_ptr, stride_res_m, stride_res_n, out_ptr, stride_out_m,
                         ACTIVATION, HAS_BIAS, HAS_RESIDUAL)


@triton.jit(do_not_specialize=["M", "SPLIT_K", "stride_part_split", "stride_part_m"])
def _linear_splitk_reduce_kernel(
    part_ptr, stride_part_split, stride_part_m,
    bias_ptr, stride_bias,
    res_ptr, stride_res_m, stride_res_n,
    out_ptr, stride_out_m,
    M, N, SPLIT_K,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (_config.pdl)
):
    """Sums the SPLIT_K fp32 partial tiles in split order (deterministic) and applies the epilogue."""
    wait_for_previous_kernel(PDL)
    GATED: tl.constexpr = ((ACTIVATION == "silu_mul" or ACTIVATION == "gelu_mul")
                           or (ACTIVATION == "gelu_tanh_mul" or ACTIVATION == "relu_mul"))
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    part_ptrs = part_ptr + offs_m.to(tl.int64)[:, None] * stride_part_m + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, SPLIT_K):
        acc += tl.load(part_ptrs, mask=mask, other=0.0)
        if GATED:
            acc_up += tl.load(part_ptrs + N, mask=mask, other=0.0)
        part_ptrs += stride_part_split
    _linear_epilogue(acc, acc_up, offs_m, offs_n, M, N, bias_ptr, stride_bias,
                     res_ptr, stride_res_m, stride_res_n, out_ptr, stride_out_m,
                     ACTIVATION, HAS_BIAS, HAS_RESIDUAL)


def _split_epilogue(args) -> bool:
    """At 128 accumulator values a thread the epilogue goes half a tile at a time (ptxas -v for
    sm_90a, triton 3.8: 128x256 with gelu and a residual spills 400 B a thread in one piece,
    nothing in halves; `bench_gemm.py --ptxas` shows it for every config). Not for
    gated units, whose two accumulators spill either way (~100 B at 128x128, 8 warps) and slightly
    more when split; its spills sit after the main loop, paid once per tile."""
    acc_values = args["BLOCK_M"] * args["BLOCK_N"]
    return (not is_gated(args["ACTIVATION"]) and args["BLOCK_N"] >= 32
            and acc_values >= 128 * 32 * args.get("num_warps", 4))


_linear_fwd_heuristic = triton.heuristics({
    # K masks can be dropped when every split covers whole BLOCK_K steps.
    "EVEN_K": lambda args: args["K"] % (args["BLOCK_K"] * args["SPLIT_K"]) == 0,
    "SPLIT_EPILOGUE": _split_epilogue,
})(_linear_fwd_kernel)


def _bench_config(kernel_call, quantiles):
    # Shorter than triton's default 25 ms warm-up + 100 ms of reps per config: still hundreds of
    # reps of even the largest GEMM here (~0.2 ms), and tuning a model's dozen keys stays quick.
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


_linear_fwd_tuned = triton.autotune(
    configs=_linear_configs(),
    key=["M_BUCKET", "N", "K", "SPLIT_K", "ACTIVATION", "HAS_BIAS", "HAS_RESIDUAL", "DOT_PRECISION"],
    prune_configs_by={"early_config_prune": _prune_for_shape},
    do_bench=_bench_config,
    # Tuning results on disk beside Triton's binaries: a second process does not re-tune.
    **({"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}),
)(_linear_fwd_heuristic)


# -------------------------------------------------------------------------------------------------
# Launchers
# -------------------------------------------------------------------------------------------------

_GROUP_M = 8
_REDUCE_BLOCK_M, _REDUCE_BLOCK_N = 16, 128

# Autotune keys this process has tuned, outside CUDA-graph capture. Two things are forbidden inside
# a capture: the autotuner's timing (it synchronises) and the first launch of any compiled kernel
# (Triton loads the module with cuModuleLoadData, which aborts the capture). A tuned key has had
# its best config launched already, so it is safe to launch under capture with the same strides.
_TUNED: set[tuple] = set()

# One dependable tile per regime, for capture of a key never tuned (safe only if that kernel was
# launched before in this process, e.g. by an earlier call with the same epilogue and regime).
_FIXED_TILES = {
    "few": (16, 16, 256, 3, 2),
    "small": (16, 64, 128, 5, 4),
    "mid": (64, 128, 64, 4, 4),
    "large": (128, 128, 64, 4, 8),
}


def default_split_k(m: int, n: int, k: int, device: torch.device) -> int:
    """How many programs share the K range of a tile: enough to give every SM work when M is small
    and the output has few tiles, but no split shorter than 256 along K. Both thresholds are a
    starting point, not a measurement; the op's dispatcher times split 1 against this split."""
    bucket = m_bucket(m)
    regime = _regime(bucket)
    if regime == "large":
        return 1
    tile_m, tile_n = (16, 64) if regime == "small" else (64, 128)
    tiles = triton.cdiv(m, tile_m) * triton.cdiv(n, tile_n)
    sms = num_sms(device)  # interpreter: 4; tests pass split_k explicitly
    split = 1
    while tiles * split * 2 <= sms and k // (split * 2) >= 256:
        split *= 2
    return split


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype != torch.float32:
        return "tf32"  # ignored for 16-bit operands
    # fp32 follows the user's choice for torch.matmul: tf32 only where torch would use it too.
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _tune_key(m, n, k, split_k, activation, has_bias, has_residual, dtype) -> tuple:
    return (m_bucket(m), n, k, split_k, activation, has_bias, has_residual, dtype, _dot_precision(dtype))


def is_tuned(m: int, n: int, k: int, split_k: int, activation: str, has_bias: bool, has_residual: bool,
             dtype: torch.dtype) -> bool:
    """Whether linear_fwd has autotuned (and so launched) this shape outside CUDA-graph capture:
    only then may it run inside one."""
    return _tune_key(m, n, k, split_k, activation, has_bias, has_residual, dtype) in _TUNED


def check_linear_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    residual: torch.Tensor | None,
) -> int:
    """Validates the arguments of a linear with epilogue; returns N, the output's last dim."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    K = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"weight must be (N, {K}), got {tuple(weight.shape)}")
    if is_gated(activation) and weight.shape[0] % 2:
        raise ValueError(f"{activation} needs weight (2N, K) = [gate; up], got an odd row count")
    N = weight.shape[0] // 2 if is_gated(activation) else weight.shape[0]
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{name} must be {x.dtype} on {x.device}, got {t.dtype} on {t.device}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be ({weight.shape[0]},), got {tuple(bias.shape)}")
    if residual is not None and tuple(residual.shape) != (*x.shape[:-1], N):
        raise ValueError(f"residual must be {(*x.shape[:-1], N)}, got {tuple(residual.shape)}")
    return N


class EpilogueOperands:
    """The epilogue side of one linear launch, shared by linear_fwd and gemv.gemv_fwd: everything
    their main kernels and the split-K reduce kernel pass for the output.

    out: (M, N) contiguous; bias: (N,) or (2N,) or None; res2: (M, N) residual (any strides) or None.
    `args` are the bias / residual / out pointers and strides in the kernels' order, `part_args` the
    fp32 workspace of partial sums (split_k, M, N), or (split_k, M, 2N) for a gated one (gate then
    up), and its strides; `flags` the epilogue's constexprs. `reduce()` sums the partials and runs
    the epilogue when split_k > 1 (a main kernel does it itself otherwise).
    """

    def __init__(self, out: torch.Tensor, bias: torch.Tensor | None, res2: torch.Tensor | None,
                 activation: str, split_k: int):
        self.out, self.split_k = out, split_k
        M, N = out.shape
        # Unsplit launches get a 1-element fp32 stand-in (never written), so that the pointer's type,
        # and with it the compiled kernel, is the same either way.
        width = 2 * N if is_gated(activation) else N
        part = torch.empty((split_k, M, width) if split_k > 1 else (1, 1, 1), device=out.device, dtype=torch.float32)
        self.part_args = (part, part.stride(0), part.stride(1))
        # Absent tensors are replaced by `out` (never read: HAS_BIAS / HAS_RESIDUAL are false).
        self.args = (
            bias if bias is not None else out, bias.stride(0) if bias is not None else 0,
            res2 if res2 is not None else out,
            res2.stride(0) if res2 is not None else 0, res2.stride(1) if res2 is not None else 0,
            out, out.stride(0),
        )
        self.flags = dict(ACTIVATION=activation, HAS_BIAS=bias is not None, HAS_RESIDUAL=res2 is not None)

    def reduce(self, block_m: int, block_n: int) -> None:
        """After a split main kernel: the partials summed in split order, then the epilogue, in
        (block_m, block_n) tiles of out. Nothing to do when unsplit."""
        if self.split_k == 1:
            return
        M, N = self.out.shape
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
        _linear_splitk_reduce_kernel[grid](
            *self.part_args,
            *self.args,
            M, N, self.split_k,
            **self.flags, BLOCK_M=block_m, BLOCK_N=block_n, **pdl(self.out),
        )


def fixed_tile(m: int, gated: bool = False, element_size: int = 2) -> tuple[int, int, int, int, int]:
    """The dependable tile of m's regime: (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps), fitted
    to shared memory for the operands' element size. One compiled kernel per regime, epilogue and
    dtype serves every row count, so a new shape compiles nothing."""
    bucket = m_bucket(m)
    regime = _regime(bucket)
    if bucket <= FEW_M_MAX:
        # 16 rows: weight streaming. Narrow tiles put 4x more programs on the weights than the small
        # regime's 64 columns (bench/kernels/bench_small_m.py, H200 2026-11-22, us per bert-base GEMM
        # inside a graph: 768x768+residual 3.5 vs 4.4 (cuBLAS 5.1), 3072x768+GELU 5.2 vs 5.8 (6.9)).
        regime = "few"
    block_m, block_n, block_k, num_stages, num_warps = _FIXED_TILES[regime]
    if gated and block_m * block_n * 2 > 128 * 256:
        block_n //= 2
    return _fit_smem((min(block_m, bucket), block_n, block_k, num_stages, num_warps), gated, element_size)


def linear_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    residual: torch.Tensor | None = None,
    split_k: int | None = None,
    tile: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """act(x @ weight.T + bias) + residual in one Triton GEMM (two kernels when split along K).

    x: (..., K); weight: (N, K), or (2N, K) for a gated activation; bias: (N,) or (2N,); residual: (..., N).
    Returns (..., N), contiguous, dtype of x. `split_k=None` picks the split from the shape.
    `tile=(BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)` skips autotuning and runs that config
    (tests, benchmarks); by default the config is autotuned per (M bucket, N, K, flags), except
    inside CUDA-graph capture for a key not tuned before, which runs a fixed per-regime config.
    """
    N = check_linear_args(x, weight, bias, activation, residual)
    K = x.shape[-1]
    lead = x.shape[:-1]
    gated = is_gated(activation)

    # reshape is a view whenever the leading dims collapse (slices of a fused QKV output, (B, S, H*D)
    # views of attention outputs); only a non-unit stride along K forces a copy.
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return out.view(*lead, N)
    res2 = residual.reshape(-1, N) if residual is not None else None

    if split_k is None:
        split_k = default_split_k(M, N, K, x.device)
    split_k = max(1, min(int(split_k), triton.cdiv(max(K, 1), 16)))
    bucket = m_bucket(M)
    epilogue = EpilogueOperands(out, bias, res2, activation, split_k)
    args = (
        x2, x2.stride(0),
        weight, weight.stride(0), weight.stride(1),
        *epilogue.args,
        *epilogue.part_args,
        M, N, K, split_k, bucket,
    )
    flags = dict(**epilogue.flags, DOT_PRECISION=_dot_precision(x.dtype), GROUP_M=_GROUP_M, **pdl(x2))

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), split_k)

    tune_key = _tune_key(M, N, K, split_k, activation, bias is not None, residual is not None, x.dtype)
    capturing = _is_capturing(x.device)
    if tile is None and capturing and tune_key not in _TUNED:
        tile = fixed_tile(M, gated, x.element_size())  # no autotuning inside a capture (see _TUNED)
    if tile is None:
        _linear_fwd_tuned[grid](*args, **flags)
        if not capturing and not compiling_only():  # a precompile dry run compiles, loads nothing
            _TUNED.add(tune_key)
    else:
        block_m, block_n, block_k, num_stages, num_warps = tile
        _linear_fwd_heuristic[grid](*args, **flags, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                    num_stages=num_stages, num_warps=num_warps)
    epilogue.reduce(_REDUCE_BLOCK_M, _REDUCE_BLOCK_N)
    return out.view(*lead, N)
