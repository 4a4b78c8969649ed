"""GEMM-with-epilogue kernel (transfuse.kernels.gemm) against the plain-PyTorch reference, and the
reference against the modules it stands for. Tiny shapes: on CPU the kernel runs in Triton's
interpreter, whose one config (16x32x16 blocks) makes M=37, N=48, K=40 cross every block edge."""

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.linear_cases import assert_within_torch_error, problem, randn
from transfuse.kernels import gemm as kernels
from transfuse.kernels.gemm import ACTIVATIONS, check_linear_args, default_split_k, linear_fwd, m_bucket
from transfuse.reference.gemm import linear_ref

# dtype, atol added to twice torch's own error against the fp32 reference
DTYPES = [(torch.float32, 1e-5), (torch.float16, 1e-3)]


@pytest.mark.parametrize("has_bias,has_residual", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_every_epilogue(activation, dtype, atol, has_bias, has_residual):
    args = problem((37,), 40, 48, activation, dtype, has_bias, has_residual)
    assert_within_torch_error(linear_fwd(*args[:3], activation, args[3]), args, activation, atol)


@pytest.mark.parametrize("M", [1, 5, 37])
@pytest.mark.parametrize("K", [16, 40])
@pytest.mark.parametrize("N", [24, 48])
def test_linear_shapes(M, K, N):
    # K=16 is whole blocks (no K masks), K=40 is not; N=24 is less than one block
    args = problem((M,), K, N, "gelu", torch.float32)
    assert_within_torch_error(linear_fwd(*args[:3], "gelu", args[3]), args, "gelu", 1e-5)


@pytest.mark.parametrize("activation", ["silu_mul", "gelu_tanh"])
def test_linear_bf16(activation):
    # The interpreter rounds fp32 -> bf16 toward zero (a GPU rounds to nearest), so our error can
    # reach one bf16 ulp where torch's is half of one: the factor 2 in the bound absorbs it.
    args = problem((37,), 40, 48, activation, torch.bfloat16)
    assert_within_torch_error(linear_fwd(*args[:3], activation, args[3]), args, activation, 1e-2)


@pytest.mark.parametrize("activation", ["none", "silu_mul"])
def test_linear_3d_input(activation):
    args = problem((2, 7), 40, 24, activation, torch.float16)
    out = linear_fwd(*args[:3], activation, args[3])
    assert out.shape == (2, 7, 24)
    assert_within_torch_error(out, args, activation, 1e-3)


def test_linear_strided_x_and_residual():
    # x: the middle third of a fused (B, S, 3*K) QKV output (row stride 3K, not K); residual: a
    # (S, B, N) tensor transposed to (B, S, N). Neither may be copied to be read correctly.
    B, S, K, N = 2, 9, 40, 48
    qkv = randn((B, S, 3 * K), torch.float32)
    x = qkv[..., K:2 * K]
    residual = randn((S, B, N), torch.float32).transpose(0, 1)
    weight, bias = randn((N, K), torch.float32, K**-0.5), randn((N,), torch.float32)
    assert not x.is_contiguous() and not residual.is_contiguous()
    out = linear_fwd(x, weight, bias, "relu", residual)
    assert_within_torch_error(out, (x, weight, bias, residual), "relu", 1e-5)


def test_linear_leading_dims_that_do_not_collapse():
    # The first S of S+3 positions of a (B, S+3, K) buffer: batch stride (S+3)*K is not S times the
    # row stride, so no single row stride describes x and the launcher copies it.
    B, S, K, N = 2, 5, 40, 24
    x = randn((B, S + 3, K), torch.float32)[:, :S]
    residual = randn((B, S + 3, N), torch.float32)[:, 3:]
    weight = randn((N, K), torch.float32, K**-0.5)
    out = linear_fwd(x, weight, None, "none", residual)
    assert out.shape == (B, S, N)
    assert_within_torch_error(out, (x, weight, None, residual), "none", 1e-5)


def test_linear_non_unit_k_stride_x():
    big = randn((11, 80), torch.float32)
    x = big[:, ::2]  # stride 2 along K: copied before the kernel reads it
    weight = randn((24, 40), torch.float32, 40**-0.5)
    assert_within_torch_error(linear_fwd(x, weight, None, "tanh", None), (x, weight, None, None), "tanh", 1e-5)


@pytest.mark.parametrize("layout", ["row_slice", "transposed"])
def test_linear_weight_read_through_strides(layout):
    K, N = 40, 24
    if layout == "row_slice":  # rows of a bigger (fused) weight: row stride K, offset storage
        weight = randn((3 * N, K), torch.float32, K**-0.5)[N:2 * N]
    else:  # (N, K) view of a (K, N) tensor: stride 1 along N
        weight = randn((K, N), torch.float32, K**-0.5).t()
    x, bias = randn((37, K), torch.float32), randn((N,), torch.float32)
    out = linear_fwd(x, weight, bias, "silu", None)
    assert_within_torch_error(out, (x, weight, bias, None), "silu", 1e-5)


@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("activation", ["gelu", "silu_mul"])
def test_linear_split_k(activation, split_k):
    # K=40 in 16-wide blocks: split 2 gives ranges of 32 and 8, split 3 gives 16, 16, 8
    args = problem((37,), 40, 48, activation, torch.float16)
    out = linear_fwd(*args[:3], activation, args[3], split_k=split_k)
    assert_within_torch_error(out, args, activation, 1e-3)


def test_linear_split_k_more_splits_than_blocks():
    # K=40 has 3 blocks of 16: a fourth split has an empty K range and must contribute zeros
    args = problem((5,), 40, 24, "none", torch.float32)
    out = linear_fwd(*args[:3], "none", args[3], split_k=4)
    assert_within_torch_error(out, args, "none", 1e-5)


@pytest.mark.parametrize("activation", ["silu_mul", "gelu"])
@pytest.mark.parametrize("tile", [(32, 64, 32, 1, 4), (16, 16, 64, 1, 4), (64, 64, 16, 1, 1)])
def test_linear_explicit_tile(tile, activation):
    # Other block shapes than the interpreter's default: BLOCK_K=32 divides K=64 (no K masks),
    # BLOCK_K=64 is larger than K=40; 64x64 on one warp is 128 accumulator values a thread, which
    # runs a non-gated epilogue in two halves (SPLIT_EPILOGUE), as 128x256 tiles do on a GPU.
    for K in (64, 40):
        args = problem((37,), K, 72, activation, torch.float32)
        assert_within_torch_error(linear_fwd(*args[:3], activation, args[3], tile=tile), args, activation, 1e-5)


def test_split_epilogue_rule():
    rule = kernels._split_epilogue
    assert rule(dict(BLOCK_M=128, BLOCK_N=256, ACTIVATION="gelu", num_warps=8))
    assert not rule(dict(BLOCK_M=128, BLOCK_N=128, ACTIVATION="gelu", num_warps=8))
    assert not rule(dict(BLOCK_M=128, BLOCK_N=128, ACTIVATION="silu_mul", num_warps=4))
    assert rule(dict(BLOCK_M=64, BLOCK_N=64, ACTIVATION="none", num_warps=1))


def test_linear_empty_rows():
    x, weight, bias, _ = problem((0,), 40, 24, "gelu", torch.float32)
    out = linear_fwd(x, weight, bias, "gelu", None)
    assert out.shape == (0, 24)


def test_linear_does_not_modify_inputs():
    args = problem((5,), 40, 24, "relu", torch.float32)
    before = [t.clone() for t in args]
    linear_fwd(*args[:3], "relu", args[3])
    for a, b in zip(args, before):
        assert torch.equal(a, b)


def test_check_linear_args_rejects():
    x, weight, bias, residual = problem((5,), 16, 24, "none", torch.float32)
    with pytest.raises(ValueError, match="activation"):
        check_linear_args(x, weight, bias, "gelu_erf", residual)
    with pytest.raises(ValueError, match="weight"):
        check_linear_args(x, weight[:, :8], None, "none", None)
    with pytest.raises(ValueError, match="odd"):
        check_linear_args(x, weight[:23], None, "silu_mul", None)
    with pytest.raises(ValueError, match="bias"):
        check_linear_args(x, weight, bias[:8], "none", None)
    with pytest.raises(ValueError, match="residual"):
        check_linear_args(x, weight, bias, "silu_mul", residual)  # silu_mul output is (5, 12)
    with pytest.raises(ValueError, match="float16"):
        check_linear_args(x.half(), weight, None, "none", None)
    assert check_linear_args(x, weight, bias, "silu_mul", residual[:, :12]) == 12


def test_m_bucket():
    assert [m_bucket(m) for m in (1, 16, 17, 1000, 1024, 16384)] == [16, 16, 32, 1024, 1024, 16384]


def test_default_split_k(monkeypatch):
    monkeypatch.setattr(kernels, "num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    assert default_split_k(16, 768, 3072, cpu) == 8  # 12 tiles of 16x64: split to fill the SMs
    assert default_split_k(16, 768, 768, cpu) == 2  # no split shorter than 256 along K
    assert default_split_k(16, 5632, 2048, cpu) == 1  # 88 tiles already
    assert default_split_k(4096, 768, 3072, cpu) == 1  # large M: never
    for m, n, k in [(1, 64, 300), (64, 2304, 768), (256, 768, 3072), (512, 3072, 768)]:
        split = default_split_k(m, n, k, cpu)
        assert split == 1 or k // split >= 256


def test_config_prune_by_regime():
    configs = kernels._all_configs()
    fp16 = torch.empty(1, dtype=torch.float16)

    def tiles(bucket, activation="none"):
        kept = kernels._prune_for_shape(configs, {"M_BUCKET": bucket, "x_ptr": fp16}, ACTIVATION=activation)
        return [kernels._tile_of(c) for c in kept]

    assert tiles(16) and all(t[0] == 16 for t in tiles(16))  # no row wasted on a 16-row GEMM
    assert all(t[0] <= 64 and t[2] >= 128 for t in tiles(64))
    assert (128, 256, 64, 3, 8) in tiles(16384) and all(t[0] >= 128 for t in tiles(16384))
    for bucket in (16, 128, 16384):  # gated: two accumulators must still fit in registers
        for bm, bn, bk, stages, warps in tiles(bucket, "silu_mul"):
            assert bm * 2 * bn <= 128 * 32 * warps
            assert (bm + 2 * bn) * bk * 2 * stages <= kernels._SMEM_BUDGET


# ---------------------------------------------------------------------------------------------
# The reference against what it stands for


def test_reference_silu_mul_is_swiglu_of_two_linears():
    # HF LlamaMLP: down(silu(gate_proj(x)) * up_proj(x)); our weight is [gate; up] stacked by rows
    K, N = 16, 24
    gate, up = torch.nn.Linear(K, N), torch.nn.Linear(K, N)
    x = torch.randn(5, K)
    weight = torch.cat([gate.weight, up.weight]).detach()
    bias = torch.cat([gate.bias, up.bias]).detach()
    with torch.no_grad():
        torch.testing.assert_close(linear_ref(x, weight, bias, "silu_mul"), F.silu(gate(x)) * up(x))


@pytest.mark.parametrize("activation,module", [
    ("gelu", torch.nn.GELU()), ("gelu_tanh", torch.nn.GELU(approximate="tanh")), ("relu", torch.nn.ReLU()),
    ("tanh", torch.nn.Tanh()), ("silu", torch.nn.SiLU()),
])
def test_reference_matches_modules(activation, module):
    lin = torch.nn.Linear(16, 24)
    x, residual = torch.randn(2, 5, 16), torch.randn(2, 5, 24)
    with torch.no_grad():
        expected = module(lin(x)) + residual
        torch.testing.assert_close(linear_ref(x, lin.weight, lin.bias, activation, residual), expected)


@pytest.mark.parametrize("activation", ["tanh_mul", "none_mul", "gelu_new", "swish"])
def test_reference_refuses_what_no_kernel_implements(activation):
    with pytest.raises(ValueError, match="unknown activation"):
        linear_ref(torch.randn(3, 8), torch.randn(8, 8), activation=activation)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m", [1, 16, 48, 300, 4096])
@pytest.mark.parametrize("element_size", [2, 4])
def test_fixed_tile_fits_shared_memory(m, gated, element_size):
    """Every regime's fixed tile (the one a new key runs with, inside CUDA-graph capture too) fits
    the shared-memory budget for fp16/bf16 and for fp32 operands: the tiles are sized for 16-bit
    ones, and a gated fp32 one asked an H100 for 295 KB (GPU tests, tenth session)."""
    tile = kernels.fixed_tile(m, gated, element_size)
    assert kernels._smem_bytes(tile, gated, element_size) <= kernels._SMEM_BUDGET, tile
    half = kernels.fixed_tile(m, gated)
    assert tile[:2] == half[:2] and tile[4] == half[4]  # fp32 keeps the output tile, shortens the pipeline
