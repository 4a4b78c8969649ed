"""The persistent TMA GEMM (transfuse.kernels.gemm_tma) against the plain-PyTorch reference, on the
CPU through Triton's interpreter. Its interpreter tile (BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, four
programs) makes M in {37, 70}, N in {40, 50} and K in {24, 104} cross every edge: partial tiles in M
and N (zero-filled by the descriptor loads, masked at the store), a K tail that the loads zero-fill,
and more tiles than programs (each program loops over several)."""

import pytest
import torch

from tests.kernels import linear_cases
from tests.kernels.linear_cases import assert_within_torch_error, randn
from transfuse.kernels.gemm import ACTIVATIONS
from transfuse.kernels.gemm_tma import linear_tma_fwd, tma_applies

# dtype, atol added to twice torch's own error against the fp32 reference (bf16: see test_gemv.py)
DTYPES = [(torch.float16, 1e-3), (torch.bfloat16, 2e-2)]


@pytest.mark.parametrize("has_bias,has_residual", [(False, False), (True, True)])
@pytest.mark.parametrize("dtype,atol", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_epilogue(activation, dtype, atol, has_bias, has_residual):
    args = linear_cases.problem((37,), 104, 40, activation, dtype, has_bias, has_residual, strided_residual=True)
    assert_within_torch_error(linear_tma_fwd(*args[:3], activation, args[3]), args, activation, atol)


@pytest.mark.parametrize("M", [37, 70])
@pytest.mark.parametrize("K", [24, 104])
@pytest.mark.parametrize("N", [40, 50])
def test_shapes(M, K, N):
    args = linear_cases.problem((M,), K, N, "gelu", torch.float16)
    assert_within_torch_error(linear_tma_fwd(*args[:3], "gelu", args[3]), args, "gelu", 1e-3)


def test_leading_dims_and_weight_row_slice():
    # x (2, 9, K) and the weight rows of a bigger fused weight, read in place (offset, row stride)
    K, N = 64, 40
    weight = randn((3 * N, K), torch.float16, K**-0.5)[N:2 * N]
    x, bias = randn((2, 9, K), torch.float16), randn((N,), torch.float16)
    out = linear_tma_fwd(x, weight, bias, "gelu", None)
    assert out.shape == (2, 9, N)
    assert_within_torch_error(out, (x, weight, bias, None), "gelu", 1e-3)


def test_applies_only_where_the_tma_can_load():
    x = randn((40, 64), torch.float16)
    w = randn((32, 64), torch.float16)
    assert tma_applies(x, w)
    assert not tma_applies(x.float(), w.float())  # fp32: the other kernels take it
    assert not tma_applies(x[:, 1:], w[:, 1:])  # rows of 63 halves: 126-byte strides, not 16-byte ones
    assert not tma_applies(x, w.t().contiguous().t())  # the weight read along N (GPT-2's Conv1D)
    with pytest.raises(ValueError, match="16-byte"):
        linear_tma_fwd(x[:, 1:], w[:, 1:], None, "gelu", None)
