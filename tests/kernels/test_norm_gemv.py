"""The GEMV with an RMSNorm prologue (transfuse.kernels.gemv.norm_gemv_fwd) against the two kernels
it replaces, the norm kernel then the GEMV: the normalised row is rounded where the norm kernel
rounds it, so the outputs agree to the last bits (the sum of squares may associate differently) and
the stored sum is identical. Tiny shapes for the interpreter: K=100 is not a power of two (a masked
row), N=33 crosses the interpreter's 16-column blocks."""

import pytest
import torch

from transfuse.kernels import gemv, norm
from transfuse.kernels.gemm import is_gated

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _case(M, K, N, dtype, residual, weight, activation="none", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    r = torch.randn(M, K, generator=g).to(dtype) if residual else None
    w = (torch.rand(K, generator=g) + 0.5).to(dtype) if weight else None
    W = (torch.randn(N * (2 if is_gated(activation) else 1), K, generator=g) / K ** 0.5).to(dtype)
    return x, r, w, W


def _unfused(x, r, w, W, eps, offset, cast, activation):
    if r is None:
        normed, summed = norm.rms_norm_fwd(x, w, eps, offset, cast), None
    else:
        normed, summed = norm.add_rms_norm_fwd(x, r, w, eps, offset, cast, True)
    return gemv.gemv_fwd(normed, W, None, activation, None), summed


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("residual,weight,offset,cast", [
    (True, True, 0.0, True),     # Llama's add + RMSNorm
    (False, True, 0.0, True),    # the first layer's RMSNorm
    (True, True, 1.0, False),    # Gemma: (1 + weight), cast after
    (False, False, 0.0, False),  # no weight
])
@pytest.mark.parametrize("activation", ["none", "silu_mul"])
def test_norm_gemv_matches_norm_then_gemv(dtype, residual, weight, offset, cast, activation):
    x, r, w, W = _case(2, 100, 33, dtype, residual, weight, activation)
    prologue = gemv.NormPrologue(r, w, 1e-6, offset, cast)
    out, summed = gemv.norm_gemv_fwd(x, prologue, W, None, activation)
    ref, ref_sum = _unfused(x, r, w, W, 1e-6, offset, cast, activation)
    assert out.dtype == dtype and out.shape == ref.shape
    scale = ref.float().abs().max().item()
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert (out.float() - ref.float()).abs().max().item() <= tol * scale
    if residual:
        assert torch.equal(summed, ref_sum)
    else:
        assert summed.numel() == 0


def test_norm_gemv_leading_dims_bias_and_one_row():
    x, r, w, W = _case(1, 64, 40, torch.float16, True, True)
    bias = torch.randn(40).half()
    prologue = gemv.NormPrologue(r.view(1, 1, 64), w, 1e-5, 0.0, True)
    out, summed = gemv.norm_gemv_fwd(x.view(1, 1, 64), prologue, W, bias, "none")
    normed, ref_sum = norm.add_rms_norm_fwd(x, r, w, 1e-5, 0.0, True, True)
    ref = gemv.gemv_fwd(normed, W, bias, "none", None)
    assert out.shape == (1, 1, 40) and summed.shape == (1, 1, 64)
    torch.testing.assert_close(out.view(1, 40), ref, atol=2e-3, rtol=2e-3)
    assert torch.equal(summed.view(1, 64), ref_sum)


def test_norm_gemv_refuses_what_it_does_not_take():
    x, r, w, W = _case(1, 64, 40, torch.float16, True, True)
    assert gemv.norm_gemv_applies(x, W, gemv.NormPrologue(r, w, 1e-6, 0.0, True))
    assert not gemv.norm_gemv_applies(x, W, gemv.NormPrologue(r, w.float(), 1e-6, 0.0, True))  # weight dtype
    assert not gemv.norm_gemv_applies(x, W, gemv.NormPrologue(r[:, :32], w, 1e-6, 0.0, True))  # residual shape
    wide = torch.randn(1, gemv.NORM_K_MAX + 8).half()
    assert not gemv.norm_gemv_applies(wide, torch.randn(4, wide.shape[1]).half(),
                                      gemv.NormPrologue(None, None, 1e-6, 0.0, False))
    with pytest.raises(ValueError, match="norm_gemv_fwd"):
        gemv.norm_gemv_fwd(x, gemv.NormPrologue(r, w.float(), 1e-6, 0.0, True), W)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with the device tool: make test-gpu)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("M,K,N,activation", [
    (1, 2048, 2560, "none"),       # Llama-1.1B QKV
    (2, 2048, 5632, "silu_mul"),   # its gate-up
    (1, 4096, 4096, "none"),       # a 7B-wide row: two of the plain GEMV's K steps in one
    (1, 896, 1152, "none"),        # Qwen2-0.5B: K not a power of two
])
def test_norm_gemv_gpu(dtype, M, K, N, activation):
    x, r, w, W = (t.cuda() if t is not None else None for t in _case(M, K, N, dtype, True, True, activation))
    out, summed = gemv.norm_gemv_fwd(x, gemv.NormPrologue(r, w, 1e-5, 0.0, True), W, None, activation)
    ref, ref_sum = _unfused(x, r, w, W, 1e-5, 0.0, True, activation)
    assert torch.equal(summed, ref_sum)
    scale = ref.float().abs().max().item()
    assert (out.float() - ref.float()).abs().max().item() <= (2e-3 if dtype == torch.float16 else 1e-2) * scale

