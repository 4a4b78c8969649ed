"""transfuse.kernels.rotary against its plain-PyTorch reference and against eager's own formula, on
the CPU through Triton's interpreter (tiny shapes) and on the GPU (marked gpu)."""

import pytest
import torch

from transfuse.kernels.rotary import rotary_fwd
from transfuse.reference.rotary import rotary_ref, rotate_half


def _inputs(batch, heads, seq, dim, dtype, device, strided):
    torch.manual_seed(0)
    if strided:  # the K slice of a merged QKV output, transposed: (B, S, 3H, D) -> (B, H, S, D)
        qkv = torch.randn(batch, seq, 3 * heads, dim, dtype=torch.float32, device=device).to(dtype)
        x = qkv[:, :, heads:2 * heads].transpose(1, 2)
    else:
        x = torch.randn(batch, heads, seq, dim, device=device).to(dtype)
    angle = torch.randn(batch, 1, seq, dim // 2, device=device)
    angle = torch.cat((angle, angle), dim=-1)
    return x, angle.cos().to(dtype), angle.sin().to(dtype)


def _eager(x, cos, sin):
    return x * cos + rotate_half(x) * sin


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dim", [16, 24])
def test_rotary_matches_reference_cpu(dim, strided):
    x, cos, sin = _inputs(2, 3, 5, dim, torch.float32, "cpu", strided)
    out = rotary_fwd(x, cos, sin)
    assert out.is_contiguous() and out.shape == x.shape
    torch.testing.assert_close(out, rotary_ref(x, cos, sin), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, _eager(x, cos, sin), rtol=1e-5, atol=1e-5)


def test_rotary_broadcast_cos_over_batch_cpu():
    x, cos, sin = _inputs(3, 2, 4, 16, torch.float32, "cpu", False)
    out = rotary_fwd(x, cos[:1], sin[:1])
    torch.testing.assert_close(out, rotary_ref(x, cos[:1], sin[:1]), rtol=1e-6, atol=1e-6)


def test_rotary_rejects_bad_input():
    x, cos, sin = _inputs(1, 2, 3, 16, torch.float32, "cpu", False)
    with pytest.raises(TypeError, match="float32"):
        rotary_fwd(x, cos.double(), sin)
    with pytest.raises(TypeError, match="float32"):
        rotary_fwd(x.bfloat16(), cos.half(), sin.half())
    with pytest.raises(ValueError, match="does not broadcast"):
        rotary_fwd(x, cos[..., :8], sin)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [32, 64, 80, 128, 256])
@pytest.mark.parametrize("strided", [False, True])
def test_rotary_gpu(dtype, dim, strided):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x, cos, sin = _inputs(2, 5, 37, dim, dtype, "cuda", strided)
    exact = _eager(x.double(), cos.double(), sin.double())
    ours = (rotary_fwd(x, cos, sin).double() - exact).abs().max().item()
    theirs = (_eager(x, cos, sin).double() - exact).abs().max().item()
    assert ours <= max(theirs, 1e-3), f"transfuse error {ours:.2e} vs eager {dtype} error {theirs:.2e}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_pair_equals_two_rotations(device, dtype):
    """Q and K of grouped-query attention (different head counts, strided slices) in one launch:
    bit for bit what rotary_fwd gives for each."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from transfuse.kernels.rotary import rotary_pair_fwd

    torch.manual_seed(0)
    qkv = torch.randn(2, 7, 4 + 2 + 2, 24, device=device).to(dtype)  # (B, S, Hq + 2 Hkv, D)
    q, k = qkv[:, :, :4].transpose(1, 2), qkv[:, :, 4:6].transpose(1, 2)
    angle = torch.randn(2, 1, 7, 12, device=device)
    angle = torch.cat((angle, angle), dim=-1)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    q_out, k_out = rotary_pair_fwd(q, k, cos, sin)
    assert torch.equal(q_out, rotary_fwd(q, cos, sin)) and torch.equal(k_out, rotary_fwd(k, cos, sin))
    torch.testing.assert_close(k_out.float(), rotary_ref(k, cos, sin).float(), rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="must share"):
        rotary_pair_fwd(q[:1], k, cos[:1], sin[:1])


def test_rotary_pair_opcheck():
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    cos, sin = torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 16)
    torch.library.opcheck(torch.ops.transfuse.rotary_pair.default, (q, k, cos, sin))


def test_rotary_gradients_equal_the_reference():
    """Backward is the kernel on dy with -(sin, halves swapped); cos/sin get gradients as well (their
    halves differ here, so the general formula is what passes)."""

    x = torch.randn(2, 3, 5, 8, requires_grad=True)
    k = torch.randn(2, 1, 5, 8, requires_grad=True)
    angle = torch.randn(1, 1, 5, 4)
    cos = torch.cat([angle.cos(), angle.cos() * 0.7], -1).requires_grad_()
    sin = torch.cat([angle.sin(), angle.sin() + 0.3], -1).requires_grad_()
    dq, dk = torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8)
    q_out, k_out = torch.ops.transfuse.rotary_pair(x, k, cos, sin)
    ours = torch.autograd.grad((q_out * dq).sum() + (k_out * dk).sum(), (x, k, cos, sin))
    ref = torch.autograd.grad((rotary_ref(x, cos, sin) * dq).sum() + (rotary_ref(k, cos, sin) * dk).sum(), (x, k, cos, sin))
    for a, b in zip(ours, ref):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    single = torch.autograd.grad((torch.ops.transfuse.rotary(x, cos, sin) * dq).sum(), (x, cos, sin))
    single_ref = torch.autograd.grad((rotary_ref(x, cos, sin) * dq).sum(), (x, cos, sin))
    for a, b in zip(single, single_ref):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    torch.library.opcheck(torch.ops.transfuse.rotary_pair.default, (x, k, cos, sin))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["promoted", "narrowed"])
def test_rotary_of_half_x_by_fp32_tables(out_dtype, device):
    """Autocast's case: bf16 x, fp32 cos/sin. Eager promotes to fp32; the kernel's fp32 arithmetic
    gives that (rounded once to out_dtype), and its gradient comes back in x's dtype."""
    x, cos, sin = _inputs(2, 3, 5, 16, torch.bfloat16, device, True)
    cos, sin = cos.float(), sin.float()
    eager = _eager(x, cos, sin)
    assert eager.dtype == torch.float32
    out = rotary_fwd(x, cos, sin, out_dtype)
    assert out.dtype == out_dtype
    torch.testing.assert_close(out, eager.to(out_dtype), rtol=1e-6 if out_dtype == torch.float32 else 8e-3, atol=1e-6)
    x = x.detach().requires_grad_()
    dy = torch.randn(x.shape, device=device).to(out_dtype)
    (grad,) = torch.autograd.grad((torch.ops.transfuse.rotary(x, cos, sin, out_dtype).float() * dy.float()).sum(), x)
    (eager_grad,) = torch.autograd.grad((_eager(x, cos, sin) * dy.float()).sum(), x)
    x64 = x.detach().double().requires_grad_()
    (exact,) = torch.autograd.grad((_eager(x64, cos.double(), sin.double()) * dy.double()).sum(), x64)
    assert grad.dtype == eager_grad.dtype == torch.bfloat16
    # ours rounds the exact gradient once (within one bf16 ulp of it, elementwise: the interpreter's
    # bf16 stores truncate); eager rounds each term to bf16 before summing them, and is no closer
    assert ((grad.double() - exact).abs() <= exact.abs() * 2 ** -7).all()
    err_ours, err_eager = ((g.double() - exact).abs().max().item() for g in (grad, eager_grad))
    assert err_ours <= 2 * err_eager, (err_ours, err_eager)
    torch.library.opcheck(torch.ops.transfuse.rotary.default, (x, cos, sin, out_dtype))
