"""Bias gradient kernel (transfuse.kernels.bias_grad) against an fp64 column sum, with a tolerance
relative to torch's own reduction in the same dtype; odd shapes that cross row-chunk and column
edges under the interpreter's small tiles, strided, transposed and expanded inputs, the one-chunk
path, empty inputs and determinism. The GPU tests use a GPT-2 training size."""

import pytest
import torch

from transfuse.kernels import bias_grad as bias_grad_kernels
from transfuse.kernels.activation_backward import activation_bias_bwd, activation_bwd
from transfuse.kernels.bias_grad import bias_grad
from transfuse.kernels.gemm import is_gated
from transfuse.reference.bias_grad import bias_grad_ref

# dtype, atol added to twice torch's own max error, as a fraction of the largest |column sum|
DTYPES = [(torch.float32, 1e-6), (torch.float16, 1e-3), (torch.bfloat16, 1e-2)]


def _randn(shape, dtype, device="cpu"):
    return torch.randn(shape, dtype=torch.float32, device=device).to(dtype)


def _assert_within_torch_error(ours, dy, out_dtype, atol):
    gold = bias_grad_ref(dy, upcast=True)
    eager = bias_grad_ref(dy, out_dtype)
    assert ours.shape == gold.shape and ours.dtype == out_dtype, (ours.shape, ours.dtype)
    err_ours = (ours.double() - gold).abs().max().item()
    err_torch = (eager.double() - gold).abs().max().item()
    assert err_ours <= 2 * err_torch + atol * gold.abs().max().item(), (err_ours, err_torch)


def _chunks(m, n):
    config = bias_grad_kernels.bias_grad_config(n)
    blocks = -(-n // config.BLOCK_N)
    return bias_grad_kernels.row_chunks(m, blocks, config.BLOCK_M, config.programs_per_sm, torch.device("cpu"))


@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("shape", [(37, 21), (3, 7, 19), (101, 16), (2, 5)])
def test_bias_grad_matches_fp64_sum(shape, dtype, atol):
    dy = _randn(shape, dtype)
    _assert_within_torch_error(bias_grad(dy), dy, dtype, atol)


def test_test_shapes_cross_chunk_edges():
    """The shapes above exercise what they are meant to: several chunks with a short last one, and
    one chunk (written straight to the output)."""
    rows_per_chunk, n_chunks = _chunks(37, 21)
    assert n_chunks > 1 and 37 % rows_per_chunk != 0
    assert _chunks(2, 5)[1] == 1


@pytest.mark.parametrize("dtype,atol", DTYPES[1:])
def test_out_dtype_wider_than_input(dtype, atol):
    """A 16-bit gradient summed into an fp32 bias gradient: no intermediate 16-bit rounding."""
    dy = _randn((45, 13), dtype)
    ours = bias_grad(dy, torch.float32)
    gold = bias_grad_ref(dy, upcast=True)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), gold, rtol=1e-6, atol=1e-5)


def test_strided_inputs():
    base = _randn((4, 23, 40), torch.bfloat16)
    cases = {
        "3-D view, rows strided": base[:, ::2, 3:30],  # (4, 12, 27): a gap between rows
        "2-D view of a 3-D tensor": base.view(-1, 40)[:, 5:22],  # row stride 40, N = 17
        "transposed": _randn((19, 33), torch.float16).t(),  # column stride 33
        "expanded rows": _randn((1, 29), torch.float32).expand(31, 29),  # row stride 0
    }
    for name, dy in cases.items():
        ours = bias_grad(dy)
        gold = bias_grad_ref(dy, upcast=True)
        eager = bias_grad_ref(dy)
        err_ours = (ours.double() - gold).abs().max().item()
        err_torch = (eager.double() - gold).abs().max().item()
        assert ours.shape == (dy.shape[-1],) and ours.dtype == dy.dtype, name
        assert err_ours <= 2 * err_torch + 1e-5 * gold.abs().max().item(), (name, err_ours, err_torch)


def test_empty_and_deterministic():
    assert torch.equal(bias_grad(torch.empty(0, 7)), torch.zeros(7))
    assert bias_grad(torch.empty(5, 0)).shape == (0,)
    dy = _randn((53, 18), torch.float32)
    assert torch.equal(bias_grad(dy), bias_grad(dy))


def test_rejects_bad_dtypes():
    with pytest.raises(ValueError, match="float16"):
        bias_grad(torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="0-dim"):
        bias_grad(torch.tensor(1.0))


@pytest.mark.parametrize("activation", ["gelu_tanh", "silu_mul"])
def test_activation_kernel_sums_what_it_writes(activation):
    """activation_bias_bwd's dbias is bias_grad of its own grad_pre (the rounded values) and its
    grad_pre is activation_bwd's, bit for bit."""
    width = 42 if is_gated(activation) else 21
    pre = _randn((3, 13, width), torch.bfloat16)
    grad_out = _randn((3, 13, 21), torch.bfloat16)
    grad_pre, dbias = activation_bias_bwd(grad_out, pre, activation)
    assert torch.equal(grad_pre, activation_bwd(grad_out, pre, activation))
    assert dbias.shape == (width,) and dbias.dtype == torch.bfloat16
    _assert_within_torch_error(dbias, grad_pre, torch.bfloat16, 1e-2)


# ---------------------------------------------------------------------------------------------
# GPU: GPT-2 small's MLP at batch 8 x seq 1024


@pytest.mark.gpu
@pytest.mark.parametrize("n", [768, 2304, 3072])
def test_bias_grad_gpu(n):
    dy = _randn((8, 1024, n), torch.bfloat16, "cuda")
    _assert_within_torch_error(bias_grad(dy.view(-1, n)), dy, torch.bfloat16, 1e-3)
    _assert_within_torch_error(bias_grad(dy[:, :, : n - 5]), dy[:, :, : n - 5], torch.bfloat16, 1e-3)
    ours32 = bias_grad(dy, torch.float32)
    torch.testing.assert_close(ours32.double(), bias_grad_ref(dy, upcast=True), rtol=1e-5, atol=1e-3)
    assert torch.equal(bias_grad(dy), bias_grad(dy))  # no atomics


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu_tanh", "silu_mul"])
def test_activation_bias_bwd_gpu(activation):
    n = 3072
    pre = _randn((8, 1024, 2 * n if is_gated(activation) else n), torch.bfloat16, "cuda")
    grad_out = _randn((8, 1024, n), torch.bfloat16, "cuda")
    grad_pre, dbias = activation_bias_bwd(grad_out, pre, activation)
    # the same math compiled in two kernels: equal up to the compiler's choice of FMAs
    torch.testing.assert_close(grad_pre, activation_bwd(grad_out, pre, activation))
    _assert_within_torch_error(dbias, grad_pre, torch.bfloat16, 1e-3)
