"""The few-rows tensor-core GEMM with a norm prologue (transfuse.kernels.norm_few_rows) against the
two kernels it replaces, the norm kernel then gemm_few_rows: the normalised rows are rounded where
the norm kernel rounds them, so the outputs agree to the last bits (the statistics' fp32 sums may
associate differently), and the stored sum and normalised rows are identical. Tiny shapes for the
interpreter: K=100 is not a multiple of its 16-element steps (masked tails), N=33 crosses its
16-column blocks, 17 rows take the 32-row tile."""

import pytest
import torch

from transfuse.kernels import gemm_few_rows, norm
from transfuse.kernels.norm_few_rows import norm_few_rows_applies, norm_few_rows_fwd
from transfuse.kernels.norm_prologue import NormPrologue

DTYPES = [(torch.float16, 1e-3), (torch.bfloat16, 8e-3)]


def _case(M, K, N, dtype, residual, weight, bias=False, activation="none", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) + 0.3).to(dtype)  # a mean away from zero: LayerNorm centres it
    r = torch.randn(M, K, generator=g).to(dtype) if residual else None
    w = (torch.rand(K, generator=g) + 0.5).to(dtype) if weight else None
    b = torch.randn(K, generator=g).to(dtype) if bias else None
    W = (torch.randn(N * (2 if activation == "silu_mul" else 1), K, generator=g) / K ** 0.5).to(dtype)
    return x, r, w, b, W


def _unfused(x, prologue: NormPrologue, W, bias, activation):
    r, w, eps = prologue.residual, prologue.weight, prologue.eps
    if prologue.layer:
        normed, summed = ((norm.layer_norm_fwd(x, w, prologue.bias, eps), None) if r is None
                          else norm.add_layer_norm_fwd(x, r, w, prologue.bias, eps, True))
    else:
        args = (w, eps, prologue.weight_offset, prologue.cast_before_weight)
        normed, summed = ((norm.rms_norm_fwd(x, *args), None) if r is None
                          else norm.add_rms_norm_fwd(x, r, *args, True))
    return gemm_few_rows.few_rows_fwd(normed, W, bias, activation, None), summed, normed


def _check(out, summed, ref, ref_sum, dtype, tol):
    assert out.dtype == dtype and out.shape == ref.shape
    scale = ref.float().abs().max().item()
    assert (out.float() - ref.float()).abs().max().item() <= tol * scale
    if ref_sum is not None:
        assert torch.equal(summed, ref_sum)
    else:
        assert summed.numel() == 0


@pytest.mark.parametrize("dtype,tol", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("residual,weight,offset,cast", [
    (True, True, 0.0, True),     # Llama's add + RMSNorm
    (False, True, 0.0, True),    # the first layer's RMSNorm
    (True, True, 1.0, False),    # Gemma: (1 + weight), cast after
    (False, False, 0.0, False),  # no weight
])
@pytest.mark.parametrize("activation", ["none", "silu_mul"])
def test_rms_norm_matches_norm_then_linear(dtype, tol, residual, weight, offset, cast, activation):
    x, r, w, _, W = _case(5, 100, 33, dtype, residual, weight, activation=activation)
    prologue = NormPrologue(r, w, 1e-6, offset, cast)
    out, summed = norm_few_rows_fwd(x, prologue, W, None, activation)
    ref, ref_sum, _ = _unfused(x, prologue, W, None, activation)
    _check(out, summed, ref, ref_sum, dtype, tol)


@pytest.mark.parametrize("residual,weight,bias", [(True, True, True), (False, True, False), (True, False, False)])
@pytest.mark.parametrize("activation", ["gelu", "none"])
def test_layer_norm_matches_norm_then_linear(residual, weight, bias, activation):
    """GPT-2's ln_1 -> c_attn and ln_2 -> c_fc; the normalised rows stored for a post-norm layer."""
    x, r, w, b, W = _case(6, 100, 33, torch.float16, residual, weight, bias, activation)
    lin_bias = torch.randn(33).half()
    prologue = NormPrologue(r, w, 1e-5, 0.0, False, b, True)
    normed = torch.empty_like(x)
    out, summed = norm_few_rows_fwd(x, prologue, W, lin_bias, activation, normed=normed)
    ref, ref_sum, ref_normed = _unfused(x, prologue, W, lin_bias, activation)
    _check(out, summed, ref, ref_sum, torch.float16, 1e-3)
    torch.testing.assert_close(normed, ref_normed, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("M", [3, 16, 17, 32])
@pytest.mark.parametrize("K,N", [(64, 16), (100, 33)])
def test_shapes(M, K, N):
    x, r, w, _, W = _case(M, K, N, torch.float16, True, True)
    prologue = NormPrologue(r, w, 1e-6, 0.0, True)
    out, summed = norm_few_rows_fwd(x, prologue, W, None, "none")
    ref, ref_sum, _ = _unfused(x, prologue, W, None, "none")
    _check(out, summed, ref, ref_sum, torch.float16, 1e-3)


def test_leading_dims_strided_weight_and_config():
    x, r, w, _, W = _case(8, 100, 40, torch.bfloat16, True, True, activation="silu_mul")
    W_t = W.t().contiguous().t()  # (N, K) read through (1, N) strides
    prologue = NormPrologue(r.view(2, 4, 100), w, 1e-6, 0.0, True)
    out, summed = norm_few_rows_fwd(x.view(2, 4, 100), prologue, W_t, None, "silu_mul", config=(32, 32, 1, 1, 4))
    ref, ref_sum, _ = _unfused(x, prologue._replace(residual=r), W, None, "silu_mul")
    assert out.shape == (2, 4, 40) and summed.shape == (2, 4, 100)
    _check(out.view(8, 40), summed.view(8, 100), ref, ref_sum, torch.bfloat16, 8e-3)


def test_refuses_what_it_does_not_take():
    x, r, w, _, W = _case(4, 64, 40, torch.float16, True, True)
    assert norm_few_rows_applies(x, W, NormPrologue(r, w, 1e-6, 0.0, True))
    assert not norm_few_rows_applies(x, W, NormPrologue(r, w.float(), 1e-6, 0.0, True))  # weight dtype
    assert not norm_few_rows_applies(x, W, NormPrologue(r[:, :32], w, 1e-6, 0.0, True))  # residual shape
    assert not norm_few_rows_applies(x.float(), W.float(), NormPrologue(None, None, 1e-6, 0.0, False))
    assert not norm_few_rows_applies(torch.randn(33, 64).half(), W, NormPrologue(None, None, 1e-6, 0.0, False))
    with pytest.raises(ValueError, match="norm_few_rows_fwd"):
        norm_few_rows_fwd(x, NormPrologue(r, w.float(), 1e-6, 0.0, True), W)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with the device tool: make test-gpu)")
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)], ids=["fp16", "bf16"])
@pytest.mark.parametrize("M,K,N,activation,layer", [
    (8, 2048, 2560, "none", False),       # Llama-1.1B QKV at batch 8
    (8, 2048, 5632, "silu_mul", False),   # its gate-up
    (16, 896, 1152, "none", False),       # Qwen2-0.5B: K not a power of two
    (32, 4096, 4096, "none", False),      # a 7B-wide row, 32 rows
    (5, 768, 2304, "none", True),         # GPT-2's ln_1 -> c_attn
    (12, 768, 3072, "gelu_tanh", True),   # its ln_2 -> c_fc
])
def test_gpu(dtype, tol, M, K, N, activation, layer):
    x, r, w, b, W = (t.cuda() if t is not None else None
                     for t in _case(M, K, N, dtype, True, True, layer, activation))
    prologue = NormPrologue(r, w, 1e-5, 0.0, not layer, b, layer)
    out, summed = norm_few_rows_fwd(x, prologue, W, None, activation)
    ref, ref_sum, _ = _unfused(x, prologue, W, None, activation)
    _check(out, summed, ref, ref_sum, dtype, tol)
