"""transfuse.kernels.gemm_few_rows on a GPU at Llama-1.1B's batched-decode sizes (hidden 2048,
intermediate 5632, fused QKV 2560, vocabulary 32000): the default config at 3, 8, 16 and 32 rows in
fp16 and bf16, each against an fp32 reference with a tolerance relative to PyTorch's own error in
the same dtype; explicit configs (split-K, other tiles) on one shape; CUDA-graph replay.

Run: `PYTHONPATH=src python3 -m pytest -q tests/kernels/test_gemm_few_rows_gpu.py`
"""

import pytest
import torch

from tests.kernels.linear_cases import (GPU_DTYPES, LLAMA_1B_DECODE, assert_within_torch_error_gpu, capture,
                                        gpu_problem)
from transfuse.kernels import split_counters
from transfuse.kernels.gemm import is_gated
from transfuse.kernels.gemm_few_rows import FewRowsConfig, few_rows_fwd, split_candidates

pytestmark = pytest.mark.gpu

CASES, DTYPES = LLAMA_1B_DECODE, GPU_DTYPES


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("M", [3, 8, 16, 32])
@pytest.mark.parametrize("case", list(CASES))
def test_llama_1b_shapes(case, M, dtype):
    N, K, act, has_res = CASES[case]
    args = gpu_problem(M, K, N, act, DTYPES[dtype], False, has_res)
    assert_within_torch_error_gpu(few_rows_fwd(*args[:3], act, args[3]), args, act)


@pytest.mark.parametrize("config", [
    FewRowsConfig(64, 128, 2, 4, 4),   # split-K, finished by the last program of a column block
    FewRowsConfig(32, 256, 3, 3, 4),   # K=5632 = 22 steps of 256: splits of 8, 8 and 6
    FewRowsConfig(128, 64, 1, 5, 4),   # a full warpgroup tile of weight rows
    FewRowsConfig(64, 256, 1, 3, 8),
])
@pytest.mark.parametrize("activation", ["silu_mul", "gelu", "gelu_tanh_mul"])
def test_explicit_configs(config, activation):
    # N=1000: the last column block is partial; K=5632 with a bias and a residual
    args = gpu_problem(5, 5632, 1000, activation, torch.float16, True, True)
    out = few_rows_fwd(*args[:3], activation, args[3], config=config)
    assert_within_torch_error_gpu(out, args, activation)


def test_odd_k_masks_the_tail():
    # K=1000 is not a multiple of the K step: every program's last step is masked
    args = gpu_problem(7, 1000, 768, "gelu_tanh", torch.bfloat16, True, True)
    assert_within_torch_error_gpu(few_rows_fwd(*args[:3], "gelu_tanh", args[3]), args, "gelu_tanh")


def test_cuda_graph_replay():
    """The runtime's order: one eager call (compiles and loads the kernel), then capture and replay."""
    N, K, act, has_res = CASES["gate_up+silu_mul"]
    args = gpu_problem(8, K, N, act, torch.float16, False, has_res)
    few_rows_fwd(*args[:3], act, args[3])
    torch.cuda.synchronize()
    out = capture(lambda: few_rows_fwd(*args[:3], act, args[3]))
    assert_within_torch_error_gpu(out, args, act)


BERT_BASE = {"qkv": (2304, 768, "none", False), "o+res": (768, 768, "none", True),
             "up+gelu": (3072, 768, "gelu", False), "down+res": (768, 3072, "none", True)}
SPLIT_CASES = {**{f"llama-1b {k}": v for k, v in CASES.items() if k != "lm_head"},
               **{f"bert-base {k}": v for k, v in BERT_BASE.items()}}


@pytest.mark.parametrize("M", [8, 16])
@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_every_split_the_dispatcher_may_time(case, M):
    """Each split that split_candidates offers (and 2 and 4 besides) against fp32; the arrival
    counters are zero after every launch; two launches give the same bits."""
    N, K, act, has_res = SPLIT_CASES[case]
    args = gpu_problem(M, K, N, act, torch.float16, True, has_res)
    device = args[0].device
    tickets = split_counters.counters(device, 1)
    for split in sorted(set(split_candidates(N, K, device, is_gated(act))) | {2, 4}):
        out = few_rows_fwd(*args[:3], act, args[3], split_k=split)
        assert_within_torch_error_gpu(out, args, act)
        again = few_rows_fwd(*args[:3], act, args[3], split_k=split)
        torch.cuda.synchronize()
        assert not tickets.any(), split
        assert torch.equal(out, again), split


@pytest.mark.parametrize("reserved", [True, False])
def test_split_in_a_cuda_graph(reserved):
    """Captured on a stream with counters, the split runs inside the graph and every replay leaves
    them at zero; on a stream without, the capture runs unsplit. Correct either way."""
    N, K, act, has_res = CASES["down+res"]
    args = gpu_problem(8, K, N, act, torch.bfloat16, False, has_res)
    few_rows_fwd(*args[:3], act, args[3], split_k=4)
    torch.cuda.synchronize()
    out = capture(lambda: few_rows_fwd(*args[:3], act, args[3], split_k=4), split_counters=reserved)
    assert_within_torch_error_gpu(out, args, act)
