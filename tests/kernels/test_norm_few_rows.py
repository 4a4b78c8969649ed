"""The few-rows GEMM with a norm prologue (transfuse.kernels.gemm_few_rows.norm_few_rows_fwd) against
the two kernels it replaces, the norm kernel then few_rows_fwd: the normalised rows are rounded where
the norm kernel rounds them, so the outputs, the stored sum and the stored normalised rows agree
(exactly here; the statistics' fp32 sums may associate differently on a GPU). Tiny shapes for the
interpreter: K=100 crosses its 16-wide K steps with a masked tail, N=33 its 16-column blocks, 5 rows
are padded to 16. Plus a comparison with plain PyTorch in fp32."""

import pytest
import torch

from transfuse.kernels import gemm_few_rows, norm
from transfuse.kernels.gemm import is_gated
from transfuse.kernels.norm_prologue import NormPrologue
from transfuse.reference.gemm import linear_ref

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _case(M, K, N, dtype, activation="none", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    r = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.rand(K, generator=g) + 0.5).to(dtype)
    b = (torch.randn(K, generator=g) / 4).to(dtype)
    W = (torch.randn(N * (2 if is_gated(activation) else 1), K, generator=g) / K ** 0.5).to(dtype)
    return x, r, w, b, W


def _unfused(x, prologue):
    """(normed, sum or None) by the norm kernels."""
    p = prologue
    if p.layer:
        if p.residual is None:
            return norm.layer_norm_fwd(x, p.weight, p.bias, p.eps), None
        return norm.add_layer_norm_fwd(x, p.residual, p.weight, p.bias, p.eps, True)
    if p.residual is None:
        return norm.rms_norm_fwd(x, p.weight, p.eps, p.weight_offset, p.cast_before_weight), None
    return norm.add_rms_norm_fwd(x, p.residual, p.weight, p.eps, p.weight_offset, p.cast_before_weight, True)


NORMS = {
    "llama": lambda r, w, b: NormPrologue(r, w, 1e-6, 0.0, True),           # add + RMSNorm, cast before weight
    "first-layer": lambda r, w, b: NormPrologue(None, w, 1e-6, 0.0, True),  # RMSNorm alone
    "gemma": lambda r, w, b: NormPrologue(r, w, 1e-6, 1.0, False),          # (1 + weight), cast after
    "no-weight": lambda r, w, b: NormPrologue(r, None, 1e-6, 0.0, False),
    "layer-norm": lambda r, w, b: NormPrologue(r, w, 1e-5, 0.0, False, b, True),  # GPT-2, BART, BERT
    "layer-norm-alone": lambda r, w, b: NormPrologue(None, w, 1e-5, 0.0, False, b, True),
}


@pytest.mark.parametrize("dtype,kind,activation,split", [
    *[("fp16", kind, "none", 1) for kind in NORMS],
    ("fp16", "llama", "silu_mul", 1), ("fp16", "layer-norm", "gelu", 3), ("fp16", "gemma", "none", 3),
    ("bf16", "llama", "silu_mul", 3), ("bf16", "layer-norm", "none", 1), ("bf16", "no-weight", "none", 1),
])
def test_matches_norm_then_few_rows(dtype, kind, activation, split):
    x, r, w, b, W = _case(5, 100, 33, DTYPES[dtype], activation)
    prologue = NORMS[kind](r, w, b)
    normed = torch.empty_like(x)
    out, summed = gemm_few_rows.norm_few_rows_fwd(x, prologue, W, None, activation, split_k=split, normed=normed)
    ref_normed, ref_sum = _unfused(x, prologue)
    ref = gemm_few_rows.few_rows_fwd(ref_normed, W, None, activation, split_k=split)  # the same order of sums
    assert out.dtype == x.dtype and out.shape == ref.shape
    assert torch.equal(normed, ref_normed)
    assert torch.equal(out, ref)
    if ref_sum is None:
        assert summed.numel() == 0
    else:
        assert torch.equal(summed, ref_sum)


def test_against_fp32_pytorch_with_bias_leading_dims_and_32_rows():
    """The rounding points aside, the op is a norm and a linear: compared with both in fp32."""
    x, r, w, b, W = _case(24, 64, 40, torch.float16)
    bias = torch.randn(40).half()
    x3, r3 = x.view(2, 12, 64), r.view(2, 12, 64)
    out, summed = gemm_few_rows.norm_few_rows_fwd(x3, NormPrologue(r3, w, 1e-5, 0.0, False, b, True), W, bias, "none")
    s = x.float() + r.float()
    ref = linear_ref(torch.nn.functional.layer_norm(s, (64,), w.float(), b.float(), 1e-5), W, bias, upcast=True)
    assert out.shape == (2, 12, 40) and summed.shape == (2, 12, 64)
    torch.testing.assert_close(out.view(24, 40).float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(summed.view(24, 64).float(), s, atol=2e-3, rtol=2e-3)


def test_refuses_what_it_does_not_take():
    x, r, w, b, W = _case(4, 64, 40, torch.float16)
    assert gemm_few_rows.norm_few_rows_applies(x, W, NormPrologue(r, w, 1e-6, 0.0, True))
    assert not gemm_few_rows.norm_few_rows_applies(x, W, NormPrologue(r, w.float(), 1e-6, 0.0, True))
    assert not gemm_few_rows.norm_few_rows_applies(x, W, NormPrologue(r[:, :32], w, 1e-6, 0.0, True))
    assert not gemm_few_rows.norm_few_rows_applies(x.float(), W.float(), NormPrologue(None, None, 1e-6, 0.0, False))
    many = torch.randn(gemm_few_rows.FEW_ROWS_MAX + 1, 64).half()
    assert not gemm_few_rows.norm_few_rows_applies(many, W, NormPrologue(None, None, 1e-6, 0.0, False))
    with pytest.raises(ValueError, match="norm_few_rows_fwd"):
        gemm_few_rows.norm_few_rows_fwd(x, NormPrologue(r, w.float(), 1e-6, 0.0, True), W)
    with pytest.raises(ValueError, match="normed must be"):
        gemm_few_rows.norm_few_rows_fwd(x, NormPrologue(r, w, 1e-6, 0.0, True), W, normed=torch.empty(4, 63).half())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with the device tool: make test-gpu)")
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("M,K,N,activation,kind", [
    (8, 2048, 2560, "none", "llama"),           # Llama-1.1B QKV at batch 8
    (8, 2048, 5632, "silu_mul", "llama"),       # its gate-up
    (3, 2048, 2560, "none", "first-layer"),
    (16, 768, 3072, "gelu", "layer-norm"),      # bert-base's FFN up at 1 x 16
    (32, 896, 1152, "none", "gemma"),           # K not a power of two, 32 rows
    (5, 4096, 4096, "none", "layer-norm-alone"),
])
@pytest.mark.parametrize("split", [1, 2])
def test_gpu_against_the_unfused_kernels_and_fp32(dtype, M, K, N, activation, kind, split):
    x, r, w, b, W = (t.cuda() for t in _case(M, K, N, DTYPES[dtype], activation))
    prologue = NORMS[kind](r, w, b)
    normed = torch.empty_like(x)
    out, summed = gemm_few_rows.norm_few_rows_fwd(x, prologue, W, None, activation, split_k=split, normed=normed)
    ref_normed, ref_sum = _unfused(x, prologue)
    ref = gemm_few_rows.few_rows_fwd(ref_normed, W, None, activation)
    if ref_sum is not None:
        assert torch.equal(summed, ref_sum)
    # the statistics may differ in their last bit: an ulp in a few normalised values
    ulp = 2e-3 if dtype == "fp16" else 1.6e-2
    assert (normed.float() - ref_normed.float()).abs().max() <= ulp * ref_normed.float().abs().max()
    ref32 = linear_ref(ref_normed.float(), W.float(), None, activation, upcast=True)
    torch_err = (linear_ref(ref_normed, W, None, activation).float() - ref32).abs().max()
    assert (out.float() - ref32).abs().max() <= 2 * torch_err + 1e-3 * ref32.abs().max()
    assert (out.float() - ref.float()).abs().max() <= 2 * torch_err + 1e-3 * ref32.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with the device tool: make test-gpu)")
def test_gpu_in_a_cuda_graph_with_a_split():
    from tests.kernels.linear_cases import capture

    x, r, w, b, W = (t.cuda() for t in _case(8, 2048, 2048, torch.float16))
    prologue = NORMS["llama"](r, w, b)
    eager, _ = gemm_few_rows.norm_few_rows_fwd(x, prologue, W, None, "none", split_k=4)
    replayed = capture(lambda: gemm_few_rows.norm_few_rows_fwd(x, prologue, W, None, "none", split_k=4)[0],
                       split_counters=True)
    assert torch.equal(replayed, eager)
