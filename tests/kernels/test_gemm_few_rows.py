"""The few-rows tensor-core GEMM (transfuse.kernels.gemm_few_rows) against the plain-PyTorch
reference. Tiny shapes: on CPU the kernel runs in Triton's interpreter, whose config
(BLOCK_N=16, BLOCK_K=16) makes N in {5, 40} and K in {24, 100} cross every block edge (K=24: one
whole step and a masked tail; K=100: six steps and a tail of 4)."""

import functools

import pytest
import torch

from tests.kernels import linear_cases
from tests.kernels.linear_cases import assert_within_torch_error, randn
from transfuse.kernels import gemm_few_rows as kernels
from transfuse.kernels import split_counters
from transfuse.kernels.gemm import ACTIVATIONS
from transfuse.kernels.gemm_few_rows import FEW_ROWS_MAX, FewRowsConfig, few_rows_applies, few_rows_fwd

# dtype, atol added to twice torch's own error against the fp32 reference (bf16: see test_gemv.py)
DTYPES = [(torch.float16, 1e-3), (torch.bfloat16, 2e-2)]
problem = functools.partial(linear_cases.problem, strided_residual=True)


@pytest.mark.parametrize("has_bias,has_residual", [(False, False), (True, True)])
@pytest.mark.parametrize("dtype,atol", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_epilogue(activation, dtype, atol, has_bias, has_residual):
    args = problem((3,), 100, 40, activation, dtype, has_bias, has_residual)
    assert_within_torch_error(few_rows_fwd(*args[:3], activation, args[3]), args, activation, atol)


@pytest.mark.parametrize("M", [1, 5, 16, 17, 32])
@pytest.mark.parametrize("K", [24, 100])
@pytest.mark.parametrize("N", [5, 40])
def test_shapes(M, K, N):
    args = problem((M,), K, N, "gelu", torch.float16)
    assert_within_torch_error(few_rows_fwd(*args[:3], "gelu", args[3]), args, "gelu", 1e-3)


@pytest.mark.parametrize("config", [
    FewRowsConfig(16, 16, 2, 1, 4),  # split-K, finished in the last program: 7 steps of K=100 in splits of 4 and 3
    FewRowsConfig(16, 32, 3, 1, 4),  # splits of 64: the second ends in a tail, the third starts past K
    FewRowsConfig(16, 16, 8, 1, 4),  # more splits than steps allow: clamped to 7
    FewRowsConfig(32, 64, 1, 1, 4),  # column block wider than N: columns wrap, never stored twice
])
@pytest.mark.parametrize("activation", ["silu_mul", "none"])
def test_explicit_config(config, activation):
    args = problem((8,), 100, 24, activation, torch.float16)
    out = few_rows_fwd(*args[:3], activation, args[3], config=config)
    assert_within_torch_error(out, args, activation, 1e-3)


def test_leading_dims_and_weight_row_slice():
    # x (2, 4, K), the weight rows of a bigger fused weight read in place (row stride, offset)
    K, N = 100, 40
    weight = randn((3 * N, K), torch.float16, K**-0.5)[N:2 * N]
    x, bias = randn((2, 4, K), torch.float16), randn((N,), torch.float16)
    out = few_rows_fwd(x, weight, bias, "silu", None)
    assert out.shape == (2, 4, N)
    assert_within_torch_error(out, (x, weight, bias, None), "silu", 1e-3)


def test_transposed_weight_and_strided_x():
    # a (N, K) view of (K, N) storage (Conv1D), read through its strides; x a column slice
    K, N = 100, 40
    weight = randn((K, N), torch.float16, K**-0.5).t()
    x = randn((3, 2 * K), torch.float16)[:, K:]
    assert few_rows_applies(x, weight)
    out = few_rows_fwd(x, weight, None, "none", None)
    assert_within_torch_error(out, (x, weight, None, None), "none", 1e-3)


def test_bad_inputs():
    x = randn((3, 100), torch.float16)
    with pytest.raises(ValueError, match=r"weight must be \(N, 100\)"):
        few_rows_fwd(x, randn((40, 99), torch.float16))
    with pytest.raises(ValueError, match="linear_fwd"):
        few_rows_fwd(randn((FEW_ROWS_MAX + 1, 100), torch.float16), randn((40, 100), torch.float16))
    with pytest.raises(ValueError, match="linear_fwd"):
        few_rows_fwd(randn((3, 100), torch.float32), randn((40, 100), torch.float32))


def test_applies():
    w = torch.randn(40, 100).half()
    assert few_rows_applies(torch.randn(16, 100).half(), w)
    assert few_rows_applies(torch.randn(2, 8, 100).half(), w)
    assert few_rows_applies(torch.randn(2, 16, 100).half(), w)
    assert not few_rows_applies(torch.randn(33, 100).half(), w)
    assert not few_rows_applies(torch.randn(0, 100).half(), w)
    assert not few_rows_applies(torch.randn(3, 99).half(), w)
    assert not few_rows_applies(torch.randn(3, 100), w.float())
    assert not few_rows_applies(torch.randn(3, 100).bfloat16(), w)


def test_defaults_fit_shared_memory(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRET", False)
    for gated in (False, True):
        conf = kernels.default_config(gated)
        rows = 2 * conf.block_n if gated else conf.block_n
        assert conf.split_k == 1
        assert conf.num_stages * (rows + FEW_ROWS_MAX) * conf.block_k * 2 <= 200 * 1024


@pytest.mark.parametrize("activation,has_bias,has_residual", [("silu_mul", True, False), ("gelu", True, True)])
def test_splits_finish_in_their_last_program(activation, has_bias, has_residual):
    """Every split of K=100 (7 steps of 16) against the reference; the column blocks' arrival
    counters are zero again after each launch (the next launch on the stream starts from them), and
    a repeated launch gives the same bits (partials are summed in split order, whoever came last)."""
    args = problem((6,), 100, 40, activation, torch.float16, has_bias, has_residual)
    tickets = split_counters.counters(torch.device("cpu"), 1)
    for split in range(1, 8):
        out = few_rows_fwd(*args[:3], activation, args[3], split_k=split)
        assert_within_torch_error(out, args, activation, 1e-3)
        assert not tickets.any(), split
        assert torch.equal(out, few_rows_fwd(*args[:3], activation, args[3], split_k=split))


def test_no_counters_means_no_split(monkeypatch):
    """A stream without counters (a capture on a stream that reserved none) runs unsplit."""
    args = problem((4,), 100, 40, "none", torch.float16)
    monkeypatch.setattr(split_counters, "counters", lambda device, blocks: None)
    out = few_rows_fwd(*args[:3], "none", args[3], split_k=4)
    assert_within_torch_error(out, args, "none", 1e-3)


def test_counters_refuse_more_blocks_than_they_hold():
    assert split_counters.counters(torch.device("cpu"), split_counters.CAPACITY + 1) is None
    assert split_counters.counters(torch.device("cpu"), split_counters.CAPACITY).shape == (split_counters.CAPACITY,)


def test_split_candidates_off_the_gpu():
    assert kernels.split_candidates(768, 768, torch.device("cpu")) == [1]
