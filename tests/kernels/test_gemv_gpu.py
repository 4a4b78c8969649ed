"""transfuse.kernels.gemv on a GPU at Llama-1.1B's decode sizes (hidden 2048, intermediate 5632,
fused QKV 2560, vocabulary 32000): the heuristic's config at 1 and 8 rows in fp16 and bf16, each
against an fp32 reference with a tolerance relative to PyTorch's own error in the same dtype; every
config of the sweep on one shape, split-K, fp32; CUDA-graph replay.

Run: `PYTHONPATH=src python3 -m pytest -q tests/kernels/test_gemv_gpu.py`
"""

import pytest
import torch

from transfuse.kernels.gemv import GemvConfig, gemv_configs, gemv_fwd
from transfuse.reference.gemm import linear_ref

pytestmark = pytest.mark.gpu

# name: (N, K, activation, has_residual); silu_mul weights have 2N rows
CASES = {
    "qkv": (2560, 2048, "none", False),
    "o_proj+res": (2048, 2048, "none", True),
    "gate_up+silu_mul": (5632, 2048, "silu_mul", False),
    "down+res": (2048, 5632, "none", True),
    "lm_head": (32000, 2048, "none", False),
}
ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-4}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _problem(M, K, N, activation, dtype, has_bias, has_residual):
    rows = 2 * N if activation == "silu_mul" else N
    g = torch.Generator(device="cuda").manual_seed(M * 7 + N)
    x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    weight = (torch.randn(rows, K, device="cuda", generator=g) * K**-0.5).to(dtype)
    bias = torch.randn(rows, device="cuda", generator=g).to(dtype) if has_bias else None
    residual = torch.randn(M, N, device="cuda", generator=g).to(dtype) if has_residual else None
    return x, weight, bias, residual


def _assert_within_torch_error(ours, args, activation):
    x, weight, bias, residual = args
    gold = linear_ref(x, weight, bias, activation, residual, upcast=True)
    same = linear_ref(x, weight, bias, activation, residual)
    assert ours.shape == gold.shape and ours.dtype == x.dtype and ours.is_contiguous()
    err_ours = (ours.float() - gold).abs().max().item()
    err_torch = (same.float() - gold).abs().max().item()
    rel_ours = ((ours.float() - gold).norm() / gold.norm()).item()
    rel_torch = ((same.float() - gold).norm() / gold.norm()).item()
    assert err_ours <= 2 * err_torch + ATOL[x.dtype], f"max err {err_ours:.3g} vs torch {err_torch:.3g}"
    assert rel_ours <= 2 * rel_torch + 1e-5, f"rel err {rel_ours:.3g} vs torch {rel_torch:.3g}"


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_llama_1b_shapes(case, M, dtype):
    N, K, act, has_res = CASES[case]
    args = _problem(M, K, N, act, DTYPES[dtype], False, has_res)
    _assert_within_torch_error(gemv_fwd(*args[:3], act, args[3]), args, act)


@pytest.mark.parametrize("M", [1, 16])
def test_every_config_of_the_sweep(M):
    # down+res with a bias: K=5632 is 2.75 steps of 2048, so every config also runs a tail step
    N, K, act, has_res = CASES["down+res"]
    args = _problem(M, K, N, act, torch.float16, True, has_res)
    for conf in gemv_configs(M):
        _assert_within_torch_error(gemv_fwd(*args[:3], act, args[3], config=conf), args, act)


@pytest.mark.parametrize("activation", ["silu_mul", "gelu"])
def test_split_k(activation):
    # N=768 at 3 rows: 192 column blocks of 4, fewer than two per SM, so the heuristic splits K in two
    # (not for silu_mul, whose half-width blocks are 384); then an explicit 3-way split
    args = _problem(3, 3072, 768, activation, torch.bfloat16, True, True)
    _assert_within_torch_error(gemv_fwd(*args[:3], activation, args[3]), args, activation)
    out = gemv_fwd(*args[:3], activation, args[3], config=GemvConfig(4, 1024, 3, 4))
    _assert_within_torch_error(out, args, activation)


def test_fp32():
    args = _problem(4, 2048, 2560, "gelu_tanh", torch.float32, True, True)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in true fp32
    try:
        _assert_within_torch_error(gemv_fwd(*args[:3], "gelu_tanh", args[3]), args, "gelu_tanh")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def test_cuda_graph_replay():
    """The runtime's order: one eager call (compiles and loads the kernel), then capture and replay."""
    N, K, act, has_res = CASES["o_proj+res"]
    args = _problem(1, K, N, act, torch.float16, False, has_res)
    gemv_fwd(*args[:3], act, args[3])
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = gemv_fwd(*args[:3], act, args[3])
    torch.cuda.current_stream().wait_stream(stream)
    out.zero_()  # so that the check sees what the replay writes
    graph.replay()
    torch.cuda.synchronize()
    _assert_within_torch_error(out, args, act)
