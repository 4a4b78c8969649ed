"""transfuse.kernels.kv_cache (a static cache's write of new keys and values) against Hugging
Face's arange + index_copy_, on the CPU through Triton's interpreter and on the GPU (marked gpu)."""

import pytest
import torch

from transfuse.kernels.kv_cache import kv_cache_write_fwd
from transfuse.reference.kv_cache import kv_cache_write_ref


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


def test_kv_cache_write_rejects_bad_input_and_opcheck():
    keys, values, k, v, at = _case("cpu", torch.float32, 2, 3)
    with pytest.raises(ValueError, match="does not fit the cache"):
        kv_cache_write_fwd(keys, values, k[:, :2], v[:, :2], at)
    with pytest.raises(ValueError, match="one integer"):
        kv_cache_write_fwd(keys, values, k, v, torch.tensor(3.0))
    torch.library.opcheck(torch.ops.transfuse.kv_cache_write.default, (keys, values, k, v, at))
