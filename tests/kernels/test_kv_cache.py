"""transfuse.kernels.kv_cache (a static cache's write of new keys and values) against Hugging
Face's arange + index_copy_, on the CPU through Triton's interpreter and on the GPU (marked gpu); its
rotary-fused form against rotary_pair + kv_cache_write."""

import pytest
import torch

from transfuse.kernels.kv_cache import kv_cache_write_fwd, rotary_kv_cache_write_fwd
from transfuse.reference.kv_cache import kv_cache_write_ref, rotary_kv_cache_write_ref


def _case(device, dtype, n, start):
    torch.manual_seed(0)
    keys = torch.randn(2, 3, 40, 24, device=device).to(dtype)
    values = torch.randn(2, 3, 40, 24, device=device).to(dtype)
    kv = torch.randn(2, n, 6, 24, device=device).to(dtype)  # (B, n, 2H, D): strided slices, transposed
    k, v = kv[:, :, :3].transpose(1, 2), kv[:, :, 3:].transpose(1, 2)
    return keys, values, k, v, torch.tensor(start, device=device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,start", [(1, 0), (1, 17), (7, 5), (40, 0)])
def test_kv_cache_write_matches_index_copy(device, dtype, n, start):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    keys, values, k, v, at = _case(device, dtype, n, start)
    ref_keys, ref_values = keys.clone(), values.clone()
    kv_cache_write_ref(ref_keys, ref_values, k, v, at)
    torch.ops.transfuse.kv_cache_write(keys, values, k, v, at)
    assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("n,start", [(1, 17), (7, 5)])
def test_kv_cache_write_values_with_their_own_head_dim(device, n, start):
    """DeepSeek's latent attention caches keys of one head dim (24 here, 192 in the model) and values
    of another (40; 128): each written with its own, as index_copy_ writes them."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    keys, values = torch.randn(2, 3, 40, 24, device=device), torch.randn(2, 3, 40, 40, device=device)
    k, v = torch.randn(2, 3, n, 24, device=device), torch.randn(2, n, 3, 40, device=device).transpose(1, 2)
    at = torch.tensor(start, device=device)
    ref_keys, ref_values = keys.clone(), values.clone()
    kv_cache_write_ref(ref_keys, ref_values, k, v, at)
    torch.ops.transfuse.kv_cache_write(keys, values, k, v, at)
    assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)
    torch.library.opcheck(torch.ops.transfuse.kv_cache_write.default, (keys, values, k, v, at))
    with pytest.raises(ValueError, match="do not fit the cache"):
        kv_cache_write_fwd(keys, values, k, v[..., :24], at)


def test_kv_cache_write_rejects_bad_input_and_opcheck():
    keys, values, k, v, at = _case("cpu", torch.float32, 2, 3)
    with pytest.raises(ValueError, match="do not fit the cache"):
        kv_cache_write_fwd(keys, values, k[:, :2], v[:, :2], at)
    with pytest.raises(ValueError, match="one integer"):
        kv_cache_write_fwd(keys, values, k, v, torch.tensor(3.0))
    torch.library.opcheck(torch.ops.transfuse.kv_cache_write.default, (keys, values, k, v, at))


def _rotary_case(device, dtype, batch_cos, S, D, start, L=9):
    """Llama's decode inputs at odd sizes: GQA (4 query heads, 2 KV heads), q/k/v strided slices of one
    merged QKV output, transposed; cos/sin per batch row (B, 1, S, D) or shared (1, 1, S, D)."""
    torch.manual_seed(0)
    qkv = torch.randn(2, S, 4 + 2 + 2, D, device=device).to(dtype)  # (B, S, Hq + 2 Hk, D)
    q, k, v = qkv[:, :, :4].transpose(1, 2), qkv[:, :, 4:6].transpose(1, 2), qkv[:, :, 6:].transpose(1, 2)
    angle = torch.randn(2 if batch_cos else 1, 1, S, D // 2, device=device)
    angle = torch.cat((angle, angle), dim=-1)
    keys, values = torch.randn(2, 2, L, D, device=device).to(dtype), torch.randn(2, 2, L, D, device=device).to(dtype)
    return keys, values, q, k, v, angle.cos().to(dtype), angle.sin().to(dtype), torch.tensor(start, device=device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("S,D,start,batch_cos", [(1, 16, 4, True), (5, 80, 3, False), (5, 16, 6, True)])
def test_rotary_kv_cache_write_equals_rotary_pair_then_write(device, dtype, S, D, start, batch_cos):
    """Bit for bit rotary_pair + kv_cache_write (start + S past the cache's 9 positions in the last
    case: those are dropped), and the plain-PyTorch reference."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    keys, values, q, k, v, cos, sin, at = _rotary_case(device, dtype, batch_cos, S, D, start)
    two_keys, two_values = keys.clone(), values.clone()
    q_rot, k_rot = torch.ops.transfuse.rotary_pair(q, k, cos, sin)
    torch.ops.transfuse.kv_cache_write(two_keys, two_values, k_rot, v, at)
    ref_keys, ref_values = keys.clone(), values.clone()
    ref_q = rotary_kv_cache_write_ref(ref_keys, ref_values, q, k, v, cos, sin, at)
    out = torch.ops.transfuse.rotary_kv_cache_write(keys, values, q, k, v, cos, sin, at)
    assert out.is_contiguous() and out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(out, q_rot) and torch.equal(keys, two_keys) and torch.equal(values, two_values)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    for ours, ref in ((out, ref_q), (keys, ref_keys), (values, ref_values)):
        torch.testing.assert_close(ours.float(), ref.float(), **tol)


def test_rotary_kv_cache_write_rejects_bad_input_and_opcheck():
    keys, values, q, k, v, cos, sin, at = _rotary_case("cpu", torch.float32, True, 2, 16, 3)
    with pytest.raises(ValueError, match="keys are torch.float16"):
        rotary_kv_cache_write_fwd(keys.half(), values, q, k, v, cos, sin, at)
    with pytest.raises(ValueError, match="unit stride"):
        rotary_kv_cache_write_fwd(keys.transpose(2, 3).contiguous().transpose(2, 3), values, q, k, v, cos, sin, at)
    with pytest.raises(ValueError, match="must match pairwise"):
        rotary_kv_cache_write_fwd(keys, values[:, :, :5], q, k, v, cos, sin, at)
    torch.library.opcheck(torch.ops.transfuse.rotary_kv_cache_write.default, (keys, values, q, k, v, cos, sin, at))
