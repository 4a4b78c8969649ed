"""GEMM with a fused epilogue for many rows (from 128), tiles fed by the Hopper tensor-memory
accelerator (TMA) and a persistent grid: the prefill and encoder linears whose activation cuBLAS
cannot fuse.

    out = act(x @ weight.T + bias) + residual

    x:        (M, K)  unit stride along K; row stride and base 16-byte aligned (a TMA rule)
    weight:   (N, K)  nn.Linear layout, contiguous along K, or (2N, K) = [W_gate; W_up] for a gated unit
    bias:     (N,) or (2N,)
    residual: (M, N)  any strides
    out:      (M, N)  contiguous, dtype of x

Semantics, activations and numerics are those of `gemm.linear_fwd`: fp32 products and sums, the
epilogue on the fp32 accumulator, one rounding at the store (its `_linear_epilogue` is reused as it
is).

Why a second large-M kernel: gemm.linear_fwd loads its tiles through pointers, and on an H100/H200
cuBLAS beat it on every bert-base GEMM from 128 rows up, even with the epilogue it fuses (which is
why the dispatcher times it only up to 64 rows). cuBLAS, though, has no exact-GELU epilogue
(cuBLASLt's is the tanh approximation), so bert-base at 32x512 ran a separate GELU kernel over the
(16384, 3072) intermediate: 0.9 of its 7.9 ms. Here each program loops over output tiles (a
persistent grid of one program per SM, the tile order grouped by GROUP_M tile-rows so that programs
running together share weight columns in L2), and the x and weight tiles arrive by TMA bulk copies
into shared memory, pipelined across K steps and, with the loop flattened, across tiles. The
dispatcher (ops/gemm.py) times this kernel against cuBLAS plus PyTorch's epilogue per shape and keeps
whichever is faster.

Edges: TMA loads zero-fill outside the tensor, so rows past M, columns past N and K past its end add
nothing to the dot; the epilogue's stores are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from transfuse.kernels._config import INTERPRET, num_sms, pdl, wait_for_previous_kernel
from transfuse.kernels.gemm import _WIDEN_DOT_OPERANDS, EpilogueOperands, _linear_epilogue, check_linear_args, is_gated

try:  # Triton 3.4+: host-side descriptors (triton 3.6 and 3.8 both have it)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the kernel never applies
    TensorDescriptor = None

TMA_MIN_ROWS = 128  # below this the weight-streaming kernels (gemv, few_rows, gemm's small tiles) fit better
_DTYPES = (torch.float16, torch.bfloat16)
_GROUP_M = 8

# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps). Two warpgroups per program (wgmma M = 64 each).
# A gated unit holds two accumulators, so its tiles are half as wide.
TILES = {
    "wide": (128, 256, 64, 3, 8),
    "square": (128, 128, 64, 4, 8),
}
GATED_TILES = {
    "wide": (128, 128, 64, 3, 8),
    "square": (128, 64, 64, 4, 8),
}
# Under the interpreter: tiny tiles so that test shapes cross every edge in M, N and K.
_INTERPRET_TILE = (16, 32, 16, 1, 4)


def tma_applies(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this kernel can run x2 (M, K) @ weight (N, K).T: 16-bit operands on a Hopper-or-later
    GPU (or under the interpreter), and the TMA's alignment rules (16-byte base addresses and row
    strides, unit stride along K) met by both."""
    if TensorDescriptor is None or x2.dtype not in _DTYPES or weight.dtype != x2.dtype:
        return False
    if x2.device.type == "cuda":
        if INTERPRET or torch.cuda.get_device_capability(x2.device)[0] < 9:
            return False
    elif not INTERPRET:
        return False
    elem = x2.element_size()
    for t in (x2, weight):
        if t.dim() != 2 or t.stride(1) != 1 or (t.stride(0) * elem) % 16 or t.data_ptr() % 16:
            return False
    return x2.shape[1] > 0


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of output tile `tile` in grouped order: GROUP_M tile-rows down one column band."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % size_m
    pid_n = (tile % per_group) // size_m
    return pid_m, pid_n


@triton.jit(do_not_specialize=["M", "NUM_PROGRAMS"])
def _linear_tma_fwd_kernel(
    x_desc, w_desc,
    bias_ptr, stride_bias,
    res_ptr, stride_res_m, stride_res_n,
    out_ptr, stride_out_m,
    M, N, K,
    NUM_PROGRAMS,  # programs in the grid: each takes every NUM_PROGRAMS-th tile
    ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SPLIT_EPILOGUE: tl.constexpr,  # the epilogue on two (BLOCK_M, BLOCK_N / 2) halves (register room)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (_config.pdl)
):
    wait_for_previous_kernel(PDL)
    GATED: tl.constexpr = ((ACTIVATION == "silu_mul" or ACTIVATION == "gelu_mul")
                           or (ACTIVATION == "gelu_tanh_mul" or ACTIVATION == "relu_mul"))
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        row0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = acc
        if GATED:
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(k_steps):
            a = x_desc.load([row0, ks * BLOCK_K])
            b = w_desc.load([col0, ks * BLOCK_K])
            if _WIDEN_DOT_OPERANDS:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, tl.trans(b), acc)
            if GATED:
                b_up = w_desc.load([N + col0, ks * BLOCK_K])  # the up rows start N rows below the gate's
                if _WIDEN_DOT_OPERANDS:
                    b_up = b_up.to(tl.float32)
                acc_up = tl.dot(a, tl.trans(b_up), acc_up)
        offs_m = row0 + tl.arange(0, BLOCK_M)
        if SPLIT_EPILOGUE:
            HALF_N: tl.constexpr = BLOCK_N // 2
            acc_0, acc_1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF_N)), (0, 2, 1)))
            offs_n = col0 + tl.arange(0, HALF_N)
            _linear_epilogue(acc_0, acc_0, offs_m, offs_n, M, N, bias_ptr, stride_bias,
                             res_ptr, stride_res_m, stride_res_n, out_ptr, stride_out_m,
                             ACTIVATION, HAS_BIAS, HAS_RESIDUAL)
            _linear_epilogue(acc_1, acc_1, offs_m, offs_n + HALF_N, M, N, bias_ptr, stride_bias,
                             res_ptr, stride_res_m, stride_res_n, out_ptr, stride_out_m,
                             ACTIVATION, HAS_BIAS, HAS_RESIDUAL)
        else:
            offs_n = col0 + tl.arange(0, BLOCK_N)
            _linear_epilogue(acc, acc_up, offs_m, offs_n, M, N, bias_ptr, stride_bias,
                             res_ptr, stride_res_m, stride_res_n, out_ptr, stride_out_m,
                             ACTIVATION, HAS_BIAS, HAS_RESIDUAL)


def tile_for(name: str, activation: str) -> tuple[int, int, int, int, int]:
    """The tile called `name` ("wide", "square") for this activation; the interpreter's under it."""
    if INTERPRET:
        return _INTERPRET_TILE
    return (GATED_TILES if is_gated(activation) else TILES)[name]


def linear_tma_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    residual: torch.Tensor | None = None,
    tile: tuple[int, int, int, int, int] | str = "wide",
    persistent: bool = True,
) -> torch.Tensor:
    """act(x @ weight.T + bias) + residual in one persistent TMA GEMM; see the module docstring.

    x: (..., K); weight: (N, K), or (2N, K) for a gated activation; bias: (N,) or (2N,); residual:
    (..., N). Returns (..., N), contiguous, dtype of x. `tile`: a name of TILES or
    (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps). Raises ValueError where tma_applies is False.
    """
    N = check_linear_args(x, weight, bias, activation, residual)
    K = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if not tma_applies(x2, weight):
        raise ValueError("linear_tma_fwd: needs 16-bit x and weight, unit stride along K, 16-byte aligned rows "
                         "and base addresses, on a Hopper-or-later GPU")
    M = x2.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return out.view(*lead, N)
    res2 = residual.reshape(-1, N) if residual is not None else None
    block_m, block_n, block_k, num_stages, num_warps = tile_for(tile, activation) if isinstance(tile, str) else tile
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    programs = max(1, min(tiles, num_sms(x.device))) if persistent else tiles
    epilogue = EpilogueOperands(out, bias, res2, activation, split_k=1)
    x_desc = TensorDescriptor.from_tensor(x2, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    split_epilogue = not is_gated(activation) and block_m * block_n >= 128 * 32 * num_warps
    _linear_tma_fwd_kernel[(programs,)](
        x_desc, w_desc, *epilogue.args, M, N, K, programs,
        **epilogue.flags, SPLIT_EPILOGUE=split_epilogue,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=_GROUP_M,
        num_stages=num_stages, num_warps=num_warps, **pdl(x2),
    )
    return out.view(*lead, N)
