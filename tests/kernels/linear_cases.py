"""Problems and the accuracy check shared by the tests of the two linear kernels, gemm.linear_fwd and
gemv.gemv_fwd (test_gemm.py, test_gemv.py and their *_gpu.py twins): args = (x, weight, bias,
residual) with outputs of order one, checked against the fp32 reference with a tolerance relative
to PyTorch's own error in the same dtype (flash-attention's rule)."""

import torch

from transfuse.kernels.gemm import is_gated
from transfuse.reference.gemm import linear_ref

# Llama-1.1B's decode linears, the GPU tests' shapes: name -> (N, K, activation, has_residual);
# silu_mul weights have 2N rows
LLAMA_1B_DECODE = {
    "qkv": (2560, 2048, "none", False),
    "o_proj+res": (2048, 2048, "none", True),
    "gate_up+silu_mul": (5632, 2048, "silu_mul", False),
    "down+res": (2048, 5632, "none", True),
    "lm_head": (32000, 2048, "none", False),
}
GPU_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# the GPU tests' atol per dtype, added to twice torch's own max error
GPU_ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-4}


def randn(shape, dtype, scale=1.0):
    return (scale * torch.randn(shape, dtype=torch.float32)).to(dtype)


def problem(lead, K, N, activation, dtype, has_bias=True, has_residual=True, strided_residual=False):
    """CPU args with weights scaled by 1/sqrt(K); `strided_residual`: the residual is a
    non-contiguous view (N first in memory), which the kernel must read in place."""
    rows = 2 * N if is_gated(activation) else N
    x = randn((*lead, K), dtype)
    weight = randn((rows, K), dtype, K**-0.5)
    bias = randn((rows,), dtype) if has_bias else None
    residual = None
    if has_residual and strided_residual:
        residual = randn((N, *lead), dtype).permute(*range(1, len(lead) + 1), 0)
        assert not residual.is_contiguous() or residual.numel() == N
    elif has_residual:
        residual = randn((*lead, N), dtype)
    return x, weight, bias, residual


def gpu_problem(M, K, N, activation, dtype, has_bias, has_residual):
    """CUDA args of M rows from a generator seeded by the shape (the same inputs on every run)."""
    rows = 2 * N if is_gated(activation) else N
    g = torch.Generator(device="cuda").manual_seed(M * 7 + N)
    x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(rows, K, device="cuda", generator=g) * K**-0.5).to(dtype)
    bias = torch.randn(rows, device="cuda", generator=g).to(dtype) if has_bias else None
    residual = torch.randn(M, N, device="cuda", generator=g).to(dtype) if has_residual else None
    return x, weight, bias, residual


def assert_within_torch_error(ours, args, activation, atol, rel_atol=None):
    """Our max error against the fp32 reference is at most twice torch's own in the same dtype, plus
    atol; with rel_atol, our relative (Frobenius) error too, plus rel_atol. ours: contiguous, of the
    reference's shape and of x's dtype."""
    x, weight, bias, residual = args
    gold = linear_ref(x, weight, bias, activation, residual, upcast=True)
    same = linear_ref(x, weight, bias, activation, residual)
    assert ours.shape == gold.shape and ours.dtype == x.dtype and ours.is_contiguous()
    err_ours = (ours.float() - gold).abs().max().item()
    err_torch = (same.float() - gold).abs().max().item()
    assert err_ours <= 2 * err_torch + atol, f"max err {err_ours:.3g} vs torch {err_torch:.3g} (+{atol})"
    if rel_atol is not None:
        rel_ours = ((ours.float() - gold).norm() / gold.norm()).item()
        rel_torch = ((same.float() - gold).norm() / gold.norm()).item()
        assert rel_ours <= 2 * rel_torch + rel_atol, f"rel err {rel_ours:.3g} vs torch {rel_torch:.3g}"


def assert_within_torch_error_gpu(ours, args, activation):
    """The GPU tests' check: max error with GPU_ATOL of x's dtype, and relative error (+1e-5)."""
    assert_within_torch_error(ours, args, activation, GPU_ATOL[args[0].dtype], rel_atol=1e-5)


def capture(fn, split_counters: bool = False):
    """fn() recorded into a CUDA graph on a side stream, as torch.cuda.graph's docs do it, then
    replayed into its zeroed output: what it returns is what the replay wrote. `split_counters`:
    the stream gets split-K arrival counters first, as the runtime's capture stream does."""
    stream = torch.cuda.Stream()
    if split_counters:
        from transfuse.kernels import split_counters as counters

        counters.reserve(stream.device, stream)
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = fn()
    torch.cuda.current_stream().wait_stream(stream)
    out.zero_()  # so that the checks see what the replay writes, not what the capture left
    graph.replay()
    torch.cuda.synchronize()
    return out
