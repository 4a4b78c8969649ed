"""transfuse.linear on a GPU at real transformer sizes: the Triton kernel (autotuned, split-K and
fixed tiles), the torch/cuBLAS path and the measured dispatch, each against an fp32 reference with
a tolerance relative to PyTorch's own error in the same dtype; and CUDA-graph capture.

Shapes: bert-base (hidden 768, intermediate 3072, fused QKV 2304) and a LLaMA-style SwiGLU MLP
(hidden 2048, intermediate 5632). Run: `PYTHONPATH=src python3 -m pytest -q tests/kernels/test_gemm_gpu.py`
(about a minute on an H100 with a cold Triton cache, mostly compiling the autotuning candidates).
"""

import pytest
import torch

import transfuse.ops.gemm as gemm_ops
from tests.kernels.linear_cases import assert_within_torch_error_gpu, capture, gpu_problem
from transfuse.kernels.gemm import ACTIVATIONS, is_gated, linear_fwd, m_bucket
from transfuse.ops.gemm import GemmKey, gemm_choices, set_gemm_backend
from transfuse.reference.gemm import linear_ref

pytestmark = pytest.mark.gpu

# name: (K, N, activation, has_bias, has_residual)
CASES = {
    "bert_qkv": (768, 2304, "none", True, False),
    "bert_attn_out": (768, 768, "none", True, True),
    "bert_ffn1": (768, 3072, "gelu", True, False),
    "bert_ffn2": (3072, 768, "none", True, True),
    "llama_mlp": (2048, 5632, "silu_mul", False, False),
}
# (case, M, dtype): every case at batch-1 size (16 rows, split-K) and at 1000 rows (not a power of
# two), bf16 once, one compute-bound point. Kept lean: every new epilogue, dtype or M regime costs
# one Triton compile per candidate config (about 60 compiles for the whole file, most of its time).
PARAMS = (
    [(c, m, torch.float16) for c in CASES for m in (16, 1000)]
    + [("llama_mlp", 1000, torch.bfloat16), ("bert_ffn2", 4096, torch.float16)]
)
PARAM_IDS = [f"{c}-M{m}-{str(dt).removeprefix('torch.')}" for c, m, dt in PARAMS]


@pytest.fixture(autouse=True)
def _auto_backend(monkeypatch):
    monkeypatch.delenv(gemm_ops.BACKEND_ENV, raising=False)
    previous = set_gemm_backend(None)
    yield
    set_gemm_backend(previous)


@pytest.mark.parametrize("case,M,dtype", PARAMS, ids=PARAM_IDS)
def test_triton_autotuned(case, M, dtype):
    K, N, act, has_bias, has_res = CASES[case]
    args = gpu_problem(M, K, N, act, dtype, has_bias, has_res)
    assert_within_torch_error_gpu(linear_fwd(*args[:3], act, args[3]), args, act)


@pytest.mark.parametrize("case,M,dtype", PARAMS, ids=PARAM_IDS)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_op_forced_backend(case, M, dtype, backend):
    K, N, act, has_bias, has_res = CASES[case]
    args = gpu_problem(M, K, N, act, dtype, has_bias, has_res)
    set_gemm_backend(backend)
    assert_within_torch_error_gpu(torch.ops.transfuse.linear(*args[:3], act, args[3]), args, act)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("M", [16, 1000])
def test_op_dispatched(case, M):
    K, N, act, has_bias, has_res = CASES[case]
    args = gpu_problem(M, K, N, act, torch.float16, has_bias, has_res)
    out = torch.ops.transfuse.linear(*args[:3], act, args[3])
    assert_within_torch_error_gpu(out, args, act)
    key = GemmKey(m_bucket(M), N, K, "float16", act, has_bias, has_res)
    choice = gemm_choices()[key]
    assert choice.measured and choice.backend in ("triton", "few_rows", "torch", "torch_lt")
    gated = is_gated(act)
    if (key.m_bucket > gemm_ops.TRITON_MAX_ROWS and not gated
            and not gemm_ops.cublaslt_epilogue_applies(args[0], args[2], act)):
        # cuBLAS alone: nothing to choose between, so nothing is timed (ops/gemm._measure)
        assert (choice.backend, choice.times_ms, choice.note) == ("torch", {}, "the only candidate")
        return
    assert "torch" in choice.times_ms
    # Triton is timed up to TRITON_MAX_ROWS rows (cuBLAS won every larger bucket measured), at every
    # size for a gated unit; the few-rows kernel up to its 16
    assert any(name.startswith("triton") for name in choice.times_ms) == (key.m_bucket <= gemm_ops.TRITON_MAX_ROWS
                                                                          or gated)
    assert ("few_rows" in choice.times_ms) == (M <= 16)
    # the rule the dispatcher promises: never the slower of the two by more than the noise margin
    best_torch = min(t for n, t in choice.times_ms.items() if n in ("torch", "torch_lt"))
    chosen = choice.times_ms[f"triton/split_k={choice.split_k}"] if choice.backend == "triton" else \
        choice.times_ms[choice.backend]
    assert chosen <= best_torch


@pytest.mark.parametrize("activation,dtype", [(a, torch.float16) for a in ACTIVATIONS]
                         + [(a, torch.bfloat16) for a in ("gelu", "silu_mul", "gelu_tanh_mul")])
def test_every_activation_fixed_tile(activation, dtype):
    # One fixed tile (no autotuning: one compile per epilogue), odd M and N, K a multiple of 8
    args = gpu_problem(300, 520, 1000, activation, dtype, True, True)
    out = linear_fwd(*args[:3], activation, args[3], tile=(64, 64, 64, 3, 4))
    assert_within_torch_error_gpu(out, args, activation)


@pytest.mark.parametrize("split_k", [2, 8])
@pytest.mark.parametrize("activation", ["gelu", "silu_mul", "gelu_tanh_mul"])
def test_split_k(activation, split_k):
    args = gpu_problem(16, 3072, 768, activation, torch.float16, True, True)
    out = linear_fwd(*args[:3], activation, args[3], split_k=split_k, tile=(16, 64, 128, 4, 4))
    assert_within_torch_error_gpu(out, args, activation)


def test_fp32_is_not_silently_tf32(monkeypatch):
    # fp32 inputs: the kernel follows torch.backends.cuda.matmul.allow_tf32 (off by default), so its
    # error is fp32-sized, not tf32-sized (~1e-3)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    args = gpu_problem(256, 768, 768, "gelu", torch.float32, True, True)
    out = linear_fwd(*args[:3], "gelu", args[3], tile=(64, 64, 32, 3, 4))
    gold = linear_ref(*args[:3], "gelu", args[3], upcast=True)
    assert (out - gold).abs().max().item() < 1e-4


def test_strided_inputs_real_size():
    # x: the V third of a fused (B, S, 3*768) QKV output; residual: (S, B, 768) seen as (B, S, 768)
    B, S, H = 4, 128, 768
    qkv = torch.randn(B, S, 3 * H, device="cuda", dtype=torch.float16)
    x = qkv[..., 2 * H:]
    residual = torch.randn(S, B, H, device="cuda", dtype=torch.float16).transpose(0, 1)
    weight = (torch.randn(H, H, device="cuda") * H**-0.5).half()
    bias = torch.randn(H, device="cuda").half()
    for backend in ("triton", "torch"):
        set_gemm_backend(backend)
        out = torch.ops.transfuse.linear(x, weight, bias, "none", residual)
        assert_within_torch_error_gpu(out, (x, weight, bias, residual), "none")


def test_cuda_graph_capture_of_an_unseen_key():
    """A key never seen, with no Triton kernel ever launched for it: nothing may be timed and no
    Triton kernel loaded inside the capture (cuModuleLoadData aborts it), so the heuristic must
    take cuBLAS; the replay is right, and the next call outside capture measures the key."""
    M, K, N = 4000, 768, 3072  # gelu_tanh + residual: an epilogue no other test runs
    args = gpu_problem(M, K, N, "gelu_tanh", torch.float16, True, True)
    key = GemmKey(m_bucket(M), N, K, "float16", "gelu_tanh", True, True)
    gemm_ops._CHOICES.pop(key, None)
    out = capture(lambda: torch.ops.transfuse.linear(*args[:3], "gelu_tanh", args[3]))
    assert_within_torch_error_gpu(out, args, "gelu_tanh")
    choice = gemm_choices()[key]
    assert choice.backend == "torch" and not choice.measured
    torch.ops.transfuse.linear(*args[:3], "gelu_tanh", args[3])
    assert gemm_choices()[key].measured


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_cuda_graph_capture_after_warm_up(backend):
    """The runtime's order: an eager call (measures, autotunes, loads the kernels), then capture,
    which replays that choice with the kernels already loaded."""
    set_gemm_backend(backend)
    M, K, N = 3000, 768, 3072
    args = gpu_problem(M, K, N, "gelu", torch.float16, True, False)
    torch.ops.transfuse.linear(*args[:3], "gelu", args[3])
    torch.cuda.synchronize()
    out = capture(lambda: torch.ops.transfuse.linear(*args[:3], "gelu", args[3]))
    assert_within_torch_error_gpu(out, args, "gelu")


@pytest.mark.parametrize("case", ["llama_mlp", "bert_ffn2", "bert_qkv"])
@pytest.mark.parametrize("M", [1, 2])
def test_op_dispatched_decode_rows(case, M):
    """1 and 2 rows (decode) are their own row bucket, timed against the GEMV kernel too; the choice
    is within torch's error and never slower than the best torch candidate."""
    K, N, act, has_bias, has_res = CASES[case]
    args = gpu_problem(M, K, N, act, torch.float16, has_bias, has_res)
    out = torch.ops.transfuse.linear(*args[:3], act, args[3])
    assert_within_torch_error_gpu(out, args, act)
    choice = gemm_choices()[GemmKey(M, N, K, "float16", act, has_bias, has_res)]
    assert choice.measured and "gemv" in choice.times_ms, choice
    best_torch = min(t for n, t in choice.times_ms.items() if not (n.startswith("triton") or n == "gemv"))
    chosen = {"triton": choice.times_ms.get(f"triton/split_k={choice.split_k}")}.get(choice.backend) \
        or choice.times_ms[choice.backend]
    assert chosen <= best_torch
