"""transfuse.kernels.gemv on a GPU at Llama-1.1B's decode sizes (hidden 2048, intermediate 5632,
fused QKV 2560, vocabulary 32000): the heuristic's config at 1 and 8 rows in fp16 and bf16, each
against an fp32 reference with a tolerance relative to PyTorch's own error in the same dtype; every
config of the sweep on one shape, split-K, fp32; CUDA-graph replay.

Run: `PYTHONPATH=src python3 -m pytest -q tests/kernels/test_gemv_gpu.py`
"""

import pytest
import torch

from tests.kernels.linear_cases import (GPU_DTYPES, LLAMA_1B_DECODE, assert_within_torch_error_gpu, capture,
                                        gpu_problem)
from transfuse.kernels.gemv import GemvConfig, gemv_configs, gemv_fwd

pytestmark = pytest.mark.gpu

CASES, DTYPES = LLAMA_1B_DECODE, GPU_DTYPES


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_llama_1b_shapes(case, M, dtype):
    N, K, act, has_res = CASES[case]
    args = gpu_problem(M, K, N, act, DTYPES[dtype], False, has_res)
    assert_within_torch_error_gpu(gemv_fwd(*args[:3], act, args[3]), args, act)


@pytest.mark.parametrize("M", [1, 16])
def test_every_config_of_the_sweep(M):
    # down+res with a bias: K=5632 is 2.75 steps of 2048, so every config also runs a tail step
    N, K, act, has_res = CASES["down+res"]
    args = gpu_problem(M, K, N, act, torch.float16, True, has_res)
    for conf in gemv_configs(M):
        assert_within_torch_error_gpu(gemv_fwd(*args[:3], act, args[3], config=conf), args, act)


@pytest.mark.parametrize("activation", ["silu_mul", "gelu", "gelu_tanh_mul"])
def test_split_k(activation):
    # N=768 at 3 rows: 192 column blocks of 4, fewer than two per SM, so the heuristic splits K in two
    # (not for silu_mul, whose half-width blocks are 384); then an explicit 3-way split
    args = gpu_problem(3, 3072, 768, activation, torch.bfloat16, True, True)
    assert_within_torch_error_gpu(gemv_fwd(*args[:3], activation, args[3]), args, activation)
    out = gemv_fwd(*args[:3], activation, args[3], config=GemvConfig(4, 1024, 3, 4))
    assert_within_torch_error_gpu(out, args, activation)


def test_fp32():
    args = gpu_problem(4, 2048, 2560, "gelu_tanh", torch.float32, True, True)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in true fp32
    try:
        assert_within_torch_error_gpu(gemv_fwd(*args[:3], "gelu_tanh", args[3]), args, "gelu_tanh")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def test_cuda_graph_replay():
    """The runtime's order: one eager call (compiles and loads the kernel), then capture and replay."""
    N, K, act, has_res = CASES["o_proj+res"]
    args = gpu_problem(1, K, N, act, torch.float16, False, has_res)
    gemv_fwd(*args[:3], act, args[3])
    torch.cuda.synchronize()
    out = capture(lambda: gemv_fwd(*args[:3], act, args[3]))
    assert_within_torch_error_gpu(out, args, act)
