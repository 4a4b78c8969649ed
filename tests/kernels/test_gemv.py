"""Weight-streaming GEMV (transfuse.kernels.gemv) against the plain-PyTorch reference. Tiny shapes:
on CPU the kernel runs in Triton's interpreter, whose one config (BLOCK_N=16, BLOCK_K=32) makes
N in {5, 40, 66} and K in {24, 100} cross every block edge (K=24: only a masked tail step; K=100:
three whole steps and a tail of 4)."""

import functools
import math

import pytest
import torch

from tests.kernels import linear_cases
from tests.kernels.linear_cases import assert_within_torch_error, randn
from transfuse.kernels import gemv as kernels
from transfuse.kernels.gemm import ACTIVATIONS
from transfuse.kernels.gemv import GEMV_M_MAX, GemvConfig, gemv_applies, gemv_bucket, gemv_fwd
from transfuse.reference.gemm import linear_ref

# dtype, atol added to twice torch's own error against the fp32 reference. bf16: the interpreter
# rounds fp32 -> bf16 toward zero (a GPU rounds to nearest), so our error can reach one bf16 ulp
# where torch's is half of one; the factor 2 in the bound absorbs it.
DTYPES = [(torch.float32, 1e-5), (torch.float16, 1e-3), (torch.bfloat16, 1e-2)]
# every residual a non-contiguous view (N first in memory): the kernel reads it in place
problem = functools.partial(linear_cases.problem, strided_residual=True)


@pytest.mark.parametrize("has_bias,has_residual", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype,atol", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gemv_every_epilogue(activation, dtype, atol, has_bias, has_residual):
    args = problem((3,), 100, 40, activation, dtype, has_bias, has_residual)
    if dtype == torch.bfloat16:
        # The interpreter's truncation costs up to one ulp of the largest output, which a gated
        # unit with biases pushes past 8 (ulp 1/16): more than twice torch's error plus 1e-2.
        largest = linear_ref(*args[:3], activation, args[3], upcast=True).abs().max().item()
        atol = max(atol, 2.0 ** (math.floor(math.log2(largest)) - 7))
    assert_within_torch_error(gemv_fwd(*args[:3], activation, args[3]), args, activation, atol)


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("K", [24, 100])
@pytest.mark.parametrize("N", [5, 40, 66])
def test_gemv_shapes(M, K, N):
    args = problem((M,), K, N, "gelu", torch.float32)
    assert_within_torch_error(gemv_fwd(*args[:3], "gelu", args[3]), args, "gelu", 1e-5)


@pytest.mark.parametrize("activation", ["none", "silu_mul"])
@pytest.mark.parametrize("dtype,atol", DTYPES[1:], ids=["fp16", "bf16"])
def test_gemv_leading_dims(activation, dtype, atol):
    args = problem((2, 3), 100, 33, activation, dtype)
    out = gemv_fwd(*args[:3], activation, args[3])
    assert out.shape == (2, 3, 33)
    assert_within_torch_error(out, args, activation, atol)


@pytest.mark.parametrize("config", [
    GemvConfig(16, 32, 2, 4),   # split-K: K=100 in 4 steps of 32, two splits of 2 steps
    GemvConfig(16, 32, 3, 4),   # three splits of 2 steps: the third starts past K (zero partial)
    GemvConfig(8, 64, 1, 4),    # one whole step and a tail of 36
    GemvConfig(4, 16, 1, 1),    # more column blocks than rows of a small N
    GemvConfig(32, 128, 1, 4),  # a K step longer than K: a tail only
])
@pytest.mark.parametrize("activation", ["silu_mul", "gelu_tanh"])
def test_gemv_explicit_config(config, activation):
    args = problem((5,), 100, 66, activation, torch.float16)
    out = gemv_fwd(*args[:3], activation, args[3], config=config)
    assert_within_torch_error(out, args, activation, 1e-3)


def test_gemv_split_k_bf16_residual():
    args = problem((16,), 100, 40, "relu", torch.bfloat16)
    out = gemv_fwd(*args[:3], "relu", args[3], config=(16, 32, 2, 4))
    assert_within_torch_error(out, args, "relu", 1e-2)


def test_gemv_weight_row_slice():
    # rows of a bigger (fused) weight: row stride K, storage offset, read in place
    K, N = 100, 40
    weight = randn((3 * N, K), torch.float16, K**-0.5)[N:2 * N]
    x, bias = randn((3, K), torch.float16), randn((N,), torch.float16)
    assert gemv_applies(x, weight)
    out = gemv_fwd(x, weight, bias, "silu", None)
    assert_within_torch_error(out, (x, weight, bias, None), "silu", 1e-3)


def test_gemv_takes_transposed_weight_through_its_kmajor_kernel():
    # an (N, K) view of a (K, N) tensor (Conv1D's storage) runs kernels/gemv_kmajor.py, whose own
    # tests cover it; here only the routing
    weight = torch.randn(100, 40).t()
    x = torch.randn(3, 100)
    assert gemv_applies(x, weight)
    assert_within_torch_error(gemv_fwd(x, weight), (x, weight, None, None), "none", 1e-5)


def test_gemv_strided_x():
    # x: the middle third of a fused (B, S, 3K) output, and a stride-2 view along K (copied)
    K, N = 100, 40
    qkv = randn((2, 3, 3 * K), torch.float32)
    weight = randn((N, K), torch.float32, K**-0.5)
    for x in (qkv[..., K:2 * K], randn((3, 2 * K), torch.float32)[:, ::2]):
        out = gemv_fwd(x, weight, None, "tanh", None)
        assert_within_torch_error(out, (x, weight, None, None), "tanh", 1e-5)


def test_gemv_empty_rows():
    x = torch.empty(0, 24)
    assert gemv_fwd(x, torch.randn(5, 24)).shape == (0, 5)


def test_gemv_bad_inputs():
    x = randn((3, 100), torch.float32)
    with pytest.raises(ValueError, match=r"weight must be \(N, 100\)"):
        gemv_fwd(x, randn((40, 99), torch.float32))
    with pytest.raises(ValueError, match="linear_fwd"):
        gemv_fwd(randn((GEMV_M_MAX + 1, 100), torch.float32), randn((40, 100), torch.float32))
    with pytest.raises(ValueError, match=r"contiguous\(\)"):
        gemv_fwd(x, randn((40, 200), torch.float32)[:, ::2])
    with pytest.raises(ValueError, match="silu_mul"):
        gemv_fwd(x, randn((41, 100), torch.float32), activation="silu_mul")
    with pytest.raises(ValueError, match="float16"):
        gemv_fwd(x, randn((40, 100), torch.float16))


def test_gemv_applies():
    w = torch.randn(40, 100)
    assert gemv_applies(torch.randn(16, 100), w)
    assert gemv_applies(torch.randn(2, 8, 100), w)
    assert not gemv_applies(torch.randn(17, 100), w)
    assert not gemv_applies(torch.randn(3, 99), w)
    assert not gemv_applies(torch.randn(3, 100).double(), w.double())
    assert not gemv_applies(torch.randn(3, 100), w.half())
    assert not gemv_applies(torch.randn(3, 100), torch.randn(40, 200)[:, ::2])
    assert gemv_applies(torch.randn(3, 100), torch.randn(100, 40).t())  # (K, N) storage
    assert gemv_applies(torch.randn(2, 100), w, max_rows=kernels.GEMV_FAST_M_MAX)
    assert not gemv_applies(torch.randn(4, 100), w, max_rows=kernels.GEMV_FAST_M_MAX)


def test_buckets():
    assert [gemv_bucket(m) for m in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]


def test_heuristic_fits_the_shape():
    def fit(n, k, base=GemvConfig(4, 2048, 1, 4)):
        return kernels._fit(base, n, k, 132)

    assert fit(4096, 4096) == GemvConfig(4, 2048, 1, 4)  # Llama-7B o-proj: 1024 column blocks, unsplit
    # K=768: half the K step on half the warps, still 16 bytes a lane
    assert fit(4096, 768) == GemvConfig(4, 1024, 1, 2)
    assert kernels.keep(fit(4096, 24))
    # N=256: 64 column blocks on 132 SMs: split K while a split keeps two steps, up to 4
    assert fit(256, 8192) == GemvConfig(4, 2048, 2, 4)
    assert fit(256, 16384) == GemvConfig(4, 2048, 4, 4)
    assert fit(256, 3000) == GemvConfig(4, 2048, 1, 4)


def test_gpu_config_lists(monkeypatch):
    from transfuse.kernels import _config

    monkeypatch.setattr(_config, "INTERPRET", False)  # the GPU lists, not the interpreter's config
    assert kernels.gemv_configs(1) == kernels._CONFIGS[1]
    assert kernels.gemv_configs(3, gated=True) == kernels._GATED_CONFIGS[4]
    for m in (1, 2, 4, 8, 16):
        for gated in (False, True):
            configs = kernels.gemv_configs(m, gated)
            assert configs and len(set(configs)) == len(configs)
            for conf in configs:  # 16-byte loads on every lane, fp16 and fp32
                assert kernels.keep(conf, 2) and kernels.keep(conf, 4), conf
            if gated and m >= 4:  # two accumulators: at most 16 / rows columns
                assert all(conf.block_n <= 16 // m for conf in configs)
