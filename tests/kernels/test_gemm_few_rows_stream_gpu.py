"""transfuse.kernels.gemm_few_rows_stream on a GPU at Llama-1.1B's and bert-base's batched-decode
sizes: the default config at 3, 8, 16 and 32 rows in fp16 and bf16 against an fp32 reference with a
tolerance relative to PyTorch's own error in the same dtype; explicit configs and program counts
(blocks shared by many programs); a masked K tail; CUDA-graph replay with and without counters.

Run: `PYTHONPATH=src python3 -m pytest -q tests/kernels/test_gemm_few_rows_stream_gpu.py`
"""

import pytest
import torch

from tests.kernels.linear_cases import (GPU_DTYPES, LLAMA_1B_DECODE, assert_within_torch_error_gpu, capture,
                                        gpu_problem)
from tests.kernels.test_gemm_few_rows_gpu import SPLIT_CASES
from transfuse.kernels import split_counters
from transfuse.kernels.gemm_few_rows_stream import StreamConfig, few_rows_stream_fwd

pytestmark = pytest.mark.gpu

CASES, DTYPES = LLAMA_1B_DECODE, GPU_DTYPES


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("M", [3, 8, 16, 32])
@pytest.mark.parametrize("case", list(CASES))
def test_llama_1b_shapes(case, M, dtype):
    N, K, act, has_res = CASES[case]
    args = gpu_problem(M, K, N, act, DTYPES[dtype], False, has_res)
    assert_within_torch_error_gpu(few_rows_stream_fwd(*args[:3], act, args[3]), args, act)


@pytest.mark.parametrize("config", [
    StreamConfig(32, 64, 4, 4, 1),
    StreamConfig(64, 128, 3, 4, 2),
    StreamConfig(32, 256, 3, 4, 2),
    StreamConfig(128, 64, 4, 8, 1),
])
@pytest.mark.parametrize("activation", ["silu_mul", "gelu"])
def test_explicit_configs(config, activation):
    # N=1000: the last column block is partial; K=5632 with a bias and a residual
    args = gpu_problem(5, 5632, 1000, activation, torch.float16, True, True)
    out = few_rows_stream_fwd(*args[:3], activation, args[3], config=config)
    assert_within_torch_error_gpu(out, args, activation)


@pytest.mark.parametrize("M", [8, 16])
@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_program_counts(case, M):
    """From a few programs (runs of many blocks) to ten times the blocks (each block shared by many):
    within tolerance, the counters zero after every launch, two launches the same bits."""
    N, K, act, has_res = SPLIT_CASES[case]
    args = gpu_problem(M, K, N, act, torch.float16, True, has_res)
    tickets = split_counters.counters(args[0].device, 1)
    for programs in (7, 132, 264, 10 * N // 32):
        out = few_rows_stream_fwd(*args[:3], act, args[3], programs=programs)
        assert_within_torch_error_gpu(out, args, act)
        again = few_rows_stream_fwd(*args[:3], act, args[3], programs=programs)
        torch.cuda.synchronize()
        assert not tickets.any(), programs
        assert torch.equal(out, again), programs


def test_odd_k_masks_the_tail():
    args = gpu_problem(7, 1000, 768, "gelu_tanh", torch.bfloat16, True, True)
    assert_within_torch_error_gpu(few_rows_stream_fwd(*args[:3], "gelu_tanh", args[3]), args, "gelu_tanh")


def test_cuda_graph_replay():
    """Captured on a stream with counters: every replay leaves them at zero and is correct. On a
    stream without, the launcher declines (returns None) and launches nothing."""
    N, K, act, has_res = CASES["gate_up+silu_mul"]
    args = gpu_problem(8, K, N, act, torch.float16, False, has_res)
    few_rows_stream_fwd(*args[:3], act, args[3])
    torch.cuda.synchronize()
    out = capture(lambda: few_rows_stream_fwd(*args[:3], act, args[3]), split_counters=True)
    assert_within_torch_error_gpu(out, args, act)
    declined = []
    capture(lambda: (declined.append(few_rows_stream_fwd(*args[:3], act, args[3])), args[0] * 1)[1], split_counters=False)
    assert declined == [None]
