"""The few-rows GEMM with the weight shared evenly among programs (transfuse.kernels.
gemm_few_rows_stream) against the plain-PyTorch reference. Under the interpreter its tiles are 16 x 16
and it runs 3 programs by default, so on N in {5, 40} and K in {24, 100} runs start and end inside
column blocks, share blocks two and three ways, and cross masked K tails."""

import functools

import pytest
import torch

from tests.kernels import linear_cases
from tests.kernels.linear_cases import assert_within_torch_error, randn
from transfuse.kernels import split_counters
from transfuse.kernels.gemm import ACTIVATIONS
from transfuse.kernels.gemm_few_rows_stream import (StreamConfig, few_rows_stream_fwd, max_sharing, programs_for,
                                                    stream_applies)

DTYPES = [(torch.float16, 1e-3), (torch.bfloat16, 2e-2)]
problem = functools.partial(linear_cases.problem, strided_residual=True)


@pytest.mark.parametrize("has_bias,has_residual", [(False, False), (True, True)])
@pytest.mark.parametrize("dtype,atol", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_epilogue(activation, dtype, atol, has_bias, has_residual):
    args = problem((3,), 100, 40, activation, dtype, has_bias, has_residual)
    assert_within_torch_error(few_rows_stream_fwd(*args[:3], activation, args[3]), args, activation, atol)


@pytest.mark.parametrize("M", [1, 8, 17, 32])
@pytest.mark.parametrize("K", [24, 100])
@pytest.mark.parametrize("N", [5, 40])
def test_shapes(M, K, N):
    args = problem((M,), K, N, "gelu", torch.float16, True, True)
    assert_within_torch_error(few_rows_stream_fwd(*args[:3], "gelu", args[3]), args, "gelu", 1e-3)


@pytest.mark.parametrize("activation", ["silu_mul", "none"])
def test_every_program_count(activation):
    """K=100, N=40: 3 column blocks of 7 steps, 21 pairs. From one program (every block whole in one
    run) to 21 (every pair its own program: seven programs share each block); the counters are zero
    after every launch, and a repeated launch gives the same bits (partials summed in program order)."""
    args = problem((6,), 100, 40, activation, torch.float16, True, True)
    tickets = split_counters.counters(torch.device("cpu"), 3)
    for programs in range(1, 22):
        out = few_rows_stream_fwd(*args[:3], activation, args[3], programs=programs)
        assert_within_torch_error(out, args, activation, 1e-3)
        assert not tickets.any(), programs
        assert torch.equal(out, few_rows_stream_fwd(*args[:3], activation, args[3], programs=programs))


def test_more_programs_than_pairs_are_cut_to_the_pairs():
    args = problem((4,), 24, 5, "none", torch.float16)  # 1 block of 2 steps
    assert_within_torch_error(few_rows_stream_fwd(*args[:3], "none", args[3], programs=50), args, "none", 1e-3)


@pytest.mark.parametrize("config", [StreamConfig(32, 64, 1, 4, 2), StreamConfig(16, 32, 1, 4, 5)])
def test_explicit_config(config):
    args = problem((8,), 100, 24, "silu_mul", torch.float16, True, False)
    out = few_rows_stream_fwd(*args[:3], "silu_mul", args[3], config=config, programs=config.programs_per_sm)
    assert_within_torch_error(out, args, "silu_mul", 1e-3)


def test_leading_dims_transposed_weight_and_strided_x():
    K, N = 100, 40
    weight = randn((K, N), torch.float16, K**-0.5).t()  # Conv1D storage, read through its strides
    x = randn((2, 3, 2 * K), torch.float16)[..., K:]
    out = few_rows_stream_fwd(x, weight, None, "silu", None)
    assert out.shape == (2, 3, N)
    assert_within_torch_error(out, (x, weight, None, None), "silu", 1e-3)


def test_no_counters_returns_none(monkeypatch):
    """A stream without counters (a capture on a stream that reserved none): the caller falls back."""
    args = problem((4,), 100, 40, "none", torch.float16)
    monkeypatch.setattr(split_counters, "counters", lambda device, blocks: None)
    assert few_rows_stream_fwd(*args[:3], "none", args[3]) is None


def test_bad_inputs():
    with pytest.raises(ValueError, match="linear_fwd"):
        few_rows_stream_fwd(randn((33, 100), torch.float16), randn((40, 100), torch.float16))
    with pytest.raises(ValueError, match="linear_fwd"):
        few_rows_stream_fwd(randn((3, 100), torch.float32), randn((40, 100), torch.float32))


def test_applies_and_programs():
    w = torch.randn(40, 100).half()
    assert stream_applies(torch.randn(8, 100).half(), w)
    assert not stream_applies(torch.randn(33, 100).half(), w)
    too_wide = torch.randn(16 * split_counters.CAPACITY + 1, 1).half()  # interpreter blocks of 16 columns
    assert stream_applies(torch.randn(8, 1).half(), too_wide[:-1])
    assert not stream_applies(torch.randn(8, 1).half(), too_wide)
    cpu = torch.device("cpu")
    assert programs_for(40, 100, cpu, StreamConfig(16, 16, 1, 4, 3)) == 3
    assert programs_for(5, 16, cpu, StreamConfig(16, 16, 1, 4, 3)) == 1  # one pair


@pytest.mark.parametrize("blocks,steps", [(3, 7), (80, 16), (1, 1), (5, 64), (1000, 2)])
def test_max_sharing_bounds_every_block(blocks, steps):
    """The workspace bound against a count of the programs that meet each block."""
    total = blocks * steps
    for programs in {1, 2, 3, 7, 132, 264, total}:
        if programs > total:
            continue
        starts = [p * total // programs for p in range(programs + 1)]
        most = max(sum(1 for p in range(programs) if starts[p] < (b + 1) * steps and starts[p + 1] > b * steps)
                   for b in range(blocks))
        assert most <= max_sharing(total, programs, steps), (programs, most)
