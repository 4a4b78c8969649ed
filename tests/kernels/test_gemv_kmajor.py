"""The GEMV over (K, N)-stored weights (transfuse.kernels.gemv_kmajor, reached through gemv_fwd and
norm_gemv_fwd with a transposed weight view) against the plain-PyTorch reference, and its norm
prologue (RMSNorm and LayerNorm, also on gemv.py's own layout) against the norm kernel then the GEMV.
Tiny shapes for the interpreter's config (16 columns, 16 rows of K a step): N in {5, 40, 66} and
K in {24, 100} cross every block edge; K=100 is not a power of two."""

import pytest
import torch

from tests.kernels.linear_cases import assert_within_torch_error, randn
from transfuse.kernels import gemv, gemv_kmajor, norm
from transfuse.kernels.gemm import ACTIVATIONS, is_gated

DTYPES = [(torch.float32, 1e-5), (torch.float16, 1e-3), (torch.bfloat16, 1e-2)]


def _kmajor(rows, K, dtype, scale=None):
    """An (rows, K) weight view of a contiguous (K, rows) tensor: Conv1D's storage."""
    return randn((K, rows), dtype, scale if scale is not None else K ** -0.5).t()


def _problem(M, K, N, activation, dtype, has_bias=True, has_residual=True):
    rows = 2 * N if is_gated(activation) else N
    x = randn((M, K), dtype)
    weight = _kmajor(rows, K, dtype)
    bias = randn((rows,), dtype) if has_bias else None
    residual = randn((N, M), dtype).t() if has_residual else None  # a strided view, read in place
    return x, weight, bias, residual


@pytest.mark.parametrize("has_bias,has_residual", [(False, False), (True, True)])
@pytest.mark.parametrize("dtype,atol", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_kmajor_every_epilogue(activation, dtype, atol, has_bias, has_residual):
    args = _problem(2, 100, 40, activation, dtype, has_bias, has_residual)
    assert gemv_kmajor.kmajor_layout(args[1]) and gemv.gemv_applies(args[0], args[1])
    assert_within_torch_error(gemv.gemv_fwd(*args[:3], activation, args[3]), args, activation, atol)


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("K", [24, 100])
@pytest.mark.parametrize("N", [5, 40, 66])
def test_kmajor_shapes(M, K, N):
    args = _problem(M, K, N, "gelu_tanh", torch.float32)
    assert_within_torch_error(gemv.gemv_fwd(*args[:3], "gelu_tanh", args[3]), args, "gelu_tanh", 1e-5)


@pytest.mark.parametrize("config", [
    (16, 16, 2, 4),   # split-K: K=100 in 7 steps, two splits
    (16, 16, 8, 4),   # eight splits of one step: the eighth starts past K (zero partial)
    (32, 64, 1, 4),   # a step longer than the tail
    (8, 128, 1, 2),   # one step longer than K
])
@pytest.mark.parametrize("activation", ["silu_mul", "none"])
def test_kmajor_explicit_config(config, activation):
    args = _problem(5, 100, 66, activation, torch.float16)
    out = gemv.gemv_fwd(*args[:3], activation, args[3], config=config)
    assert_within_torch_error(out, args, activation, 1e-3)


def test_kmajor_leading_dims_and_strided_x():
    K, N = 100, 40
    weight = _kmajor(N, K, torch.float16)
    qkv = randn((2, 1, 3 * K), torch.float16)
    x = qkv[..., K:2 * K]  # a slice of a fused output: row stride 3K
    out = gemv.gemv_fwd(x, weight, None, "relu", None)
    assert out.shape == (2, 1, N)
    assert_within_torch_error(out.view(2, N), (x.reshape(2, K), weight, None, None), "relu", 1e-3)


def test_layouts_neither_refused():
    # unit stride along neither N nor K: no GEMV reads that cheaply
    w = torch.randn(80, 200)[::2, ::2]
    assert not gemv_kmajor.kmajor_layout(w) and not gemv.gemv_applies(torch.randn(1, 100), w)
    with pytest.raises(ValueError, match=r"contiguous\(\)"):
        gemv.gemv_fwd(torch.randn(1, 100), w)


# ------------------------------------------------------------------------------------------------
# Norm prologue, both weight layouts
# ------------------------------------------------------------------------------------------------


def _norm_case(M, K, N, dtype, layer, residual, weight, activation, kmajor, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) + (3.0 if layer else 0.0)).to(dtype)  # a mean to remove
    r = torch.randn(M, K, generator=g).to(dtype) if residual else None
    w = (torch.rand(K, generator=g) + 0.5).to(dtype) if weight else None
    b = torch.randn(K, generator=g).to(dtype) if (layer and weight) else None
    rows = N * (2 if is_gated(activation) else 1)
    W = (torch.randn(K, rows, generator=g) / K ** 0.5).to(dtype)
    W = W.t() if kmajor else W.t().contiguous()
    return x, r, w, b, W


def _unfused(x, r, w, b, W, layer, eps, activation):
    if layer:
        normed, summed = (norm.layer_norm_fwd(x, w, b, eps), None) if r is None else \
            norm.add_layer_norm_fwd(x, r, w, b, eps, True)
    else:
        normed, summed = (norm.rms_norm_fwd(x, w, eps, 0.0, True), None) if r is None else \
            norm.add_rms_norm_fwd(x, r, w, eps, 0.0, True, True)
    return gemv.gemv_fwd(normed, W, None, activation, None), summed, normed


def assert_within_two_ulps(normed, ref):
    """The normalised rows the GEMV stored (store_normed) against the norm kernel's: the row
    statistics' fp32 sums may associate differently, so a value may differ by the last bits of
    its row's largest value (a mean removed from every value of the row carries its error to all)."""
    assert normed.dtype == ref.dtype and normed.shape == ref.shape
    ulp = 2 * torch.finfo(ref.dtype).eps * ref.float().abs().amax(-1, keepdim=True)
    assert ((normed.float() - ref.float()).abs() <= ulp).all()


@pytest.mark.parametrize("kmajor", [True, False], ids=["KxN", "NxK"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("layer,residual,weight", [
    (True, True, True),     # GPT-2's add + LayerNorm
    (True, False, True),    # a first LayerNorm
    (True, True, False),    # no affine
    (False, True, True),    # RMSNorm on the K-major kernel
])
@pytest.mark.parametrize("activation", ["none", "silu_mul"])
def test_norm_prologue_matches_norm_then_gemv(kmajor, dtype, layer, residual, weight, activation):
    x, r, w, b, W = _norm_case(2, 100, 33, dtype, layer, residual, weight, activation, kmajor)
    prologue = gemv.NormPrologue(r, w, 1e-5, 0.0, not layer, b, layer)
    assert gemv.norm_gemv_applies(x, W, prologue)
    # the normalised rows are also stored (a post-norm layer's next residual) on half the cases
    normed = torch.empty_like(x) if activation == "none" else None
    out, summed = gemv.norm_gemv_fwd(x, prologue, W, None, activation, normed=normed)
    ref, ref_sum, ref_normed = _unfused(x, r, w, b, W, layer, 1e-5, activation)
    if normed is not None:
        assert_within_two_ulps(normed, ref_normed)
    assert out.dtype == dtype and out.shape == ref.shape
    scale = ref.float().abs().max().item()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert (out.float() - ref.float()).abs().max().item() <= tol * scale
    if residual:
        assert torch.equal(summed, ref_sum)
    else:
        assert summed.numel() == 0


def test_norm_prologue_kmajor_split_and_bias():
    # split-K with a norm: every split normalises its own K range; the sum is stored once
    x, r, w, b, W = _norm_case(1, 100, 40, torch.float16, True, True, True, "none", True, seed=3)
    bias = torch.randn(40).half()
    prologue = gemv.NormPrologue(r, w, 1e-5, 0.0, False, b, True)
    M, K, N = 1, 100, 40
    out = torch.empty(M, N, dtype=torch.float16)
    summed = torch.empty(M, K, dtype=torch.float16)
    stored = torch.empty(M, K, dtype=torch.float16)
    gemv_kmajor.gemv_kmajor_fwd(x, W, bias, "gelu", None, out, 1, 4, prologue, summed, config=(16, 16, 4, 4),
                                normed=stored)
    normed, ref_sum = norm.add_layer_norm_fwd(x, r, w, b, 1e-5, True)
    ref = gemv.gemv_fwd(normed, W, bias, "gelu", None)
    assert torch.equal(summed, ref_sum)
    assert_within_two_ulps(stored, normed)  # every split stores its own K range of the rows
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with the device tool: make test-gpu)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("M,K,N,activation", [
    (1, 768, 2304, "none"),       # GPT-2 c_attn
    (2, 3072, 768, "none"),       # its MLP c_proj
    (1, 768, 3072, "gelu_tanh"),  # its c_fc
    (1, 1600, 6400, "silu_mul"),  # a wide gated MLP
    (1, 100, 33, "relu"),         # tiny, odd N (masked, scalar loads)
])
def test_kmajor_gpu(dtype, M, K, N, activation):
    from tests.kernels.linear_cases import assert_within_torch_error_gpu

    args = tuple(t.cuda() if t is not None else None for t in _problem(M, K, N, activation, dtype))
    assert_within_torch_error_gpu(gemv.gemv_fwd(*args[:3], activation, args[3]), args, activation)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with the device tool: make test-gpu)")
@pytest.mark.parametrize("kmajor", [True, False], ids=["KxN", "NxK"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("M,K,N,layer", [(1, 768, 2304, True), (2, 768, 3072, True), (1, 2048, 2560, False),
                                         (1, 1600, 4800, True)])
def test_norm_prologue_gpu(kmajor, dtype, M, K, N, layer):
    x, r, w, b, W = (t.cuda() if t is not None else None
                     for t in _norm_case(M, K, N, dtype, layer, True, True, "none", kmajor))
    normed = torch.empty_like(x)
    out, summed = gemv.norm_gemv_fwd(x, gemv.NormPrologue(r, w, 1e-5, 0.0, not layer, b, layer), W, normed=normed)
    ref, ref_sum, ref_normed = _unfused(x, r, w, b, W, layer, 1e-5, "none")
    assert torch.equal(summed, ref_sum)
    assert_within_two_ulps(normed, ref_normed)
    scale = ref.float().abs().max().item()
    assert (out.float() - ref.float()).abs().max().item() <= (2e-3 if dtype == torch.float16 else 1e-2) * scale
