"""transfuse.kernels.gemm_tma on a GPU at bert-base's and Llama-1.1B's many-row sizes (the encoder
and prefill linears): every named tile, fp16 and bf16, each against an fp32 reference with a
tolerance relative to PyTorch's own error in the same dtype; odd row counts and N not a multiple of
the tile (edges zero-filled by the TMA, masked at the store); a strided residual; CUDA-graph replay.

Run: `PYTHONPATH=src python3 -m pytest -q tests/kernels/test_gemm_tma_gpu.py`
"""

import pytest
import torch

from tests.kernels.linear_cases import GPU_DTYPES, assert_within_torch_error_gpu, capture, gpu_problem
from transfuse.kernels.gemm_tma import TILES, linear_tma_fwd, tma_applies

pytestmark = pytest.mark.gpu

CASES = {  # name -> (N, K, activation, has_residual); gated weights have 2N rows
    "bert ffn1+gelu": (3072, 768, "gelu", False),
    "bert out+res": (768, 768, "none", True),
    "bert ffn2+res": (768, 3072, "none", True),
    "llama gate_up+silu_mul": (5632, 2048, "silu_mul", False),
    "gelu_tanh_mul, N off the tile": (1000, 1032, "gelu_tanh_mul", True),
    "tanh, N off the tile": (1000, 1032, "tanh", True),
}


def _needs_hopper():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA GEMM needs a Hopper-or-later GPU")


@pytest.mark.parametrize("dtype", list(GPU_DTYPES), ids=list(GPU_DTYPES))
@pytest.mark.parametrize("M", [128, 1000, 4096])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tile", list(TILES))
def test_shapes(tile, case, M, dtype):
    _needs_hopper()
    N, K, act, has_res = CASES[case]
    args = gpu_problem(M, K, N, act, GPU_DTYPES[dtype], True, has_res)
    assert tma_applies(args[0], args[1])
    assert_within_torch_error_gpu(linear_tma_fwd(*args[:3], act, args[3], tile=tile), args, act)


def test_strided_residual_and_weight_rows_of_a_fused_weight():
    _needs_hopper()
    x, weight, bias, _ = gpu_problem(777, 768, 3 * 768, "none", torch.float16, True, False)
    w, b = weight[768:1536], bias[768:1536]  # the middle third of a merged QKV weight, read in place
    residual = torch.randn(768, 777, device="cuda", dtype=torch.float16).t()
    out = linear_tma_fwd(x, w, b, "gelu", residual)
    assert_within_torch_error_gpu(out, (x, w, b, residual), "gelu")


def test_cuda_graph_replay():
    """The runtime's order: one eager call (compiles and loads the kernel), then capture and replay."""
    _needs_hopper()
    N, K, act, has_res = CASES["bert ffn1+gelu"]
    args = gpu_problem(2048, K, N, act, torch.float16, True, has_res)
    linear_tma_fwd(*args[:3], act, args[3])
    torch.cuda.synchronize()
    out = capture(lambda: linear_tma_fwd(*args[:3], act, args[3]))
    assert_within_torch_error_gpu(out, args, act)
