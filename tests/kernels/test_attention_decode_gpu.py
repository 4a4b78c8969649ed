"""kernels/attention_decode.py on a GPU at decode sizes (through attention_fwd, which takes it for a
few query rows): error against the fp32 reference no worse than twice PyTorch's own error in the
dtype plus a small atol, key splits from the heuristic (long caches) and forced, inside a CUDA graph."""

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.test_attention_decode import _decode
from transfuse.kernels.attention import attention_fwd, attention_mask_summary_fwd
from transfuse.kernels.attention_decode import num_splits
from transfuse.reference.attention import attention_ref

pytestmark = pytest.mark.gpu

ATOL = {torch.float16: 1e-3, torch.bfloat16: 2e-3, torch.float32: 1e-4}


def _static_cache_mask(batch, seqlen_q, cache_len, filled, dtype, left_pad=0):
    """Hugging Face's static-cache mask: finfo.min over the unfilled tail (and a left-padded row)."""
    mask = torch.zeros(batch, 1, seqlen_q, cache_len, dtype=dtype, device="cuda")
    mask[..., filled:] = torch.finfo(dtype).min
    if left_pad:
        mask[0, ..., :left_pad] = torch.finfo(dtype).min
    return mask


def _torch_err(q, k, v, mask, scale, filled, ref):
    """SDPA in q's dtype over the filled keys (its own rounding), against the fp32 reference."""
    group = q.shape[1] // k.shape[1]
    kk = k[:, :, :filled].repeat_interleave(group, 1)
    vv = v[:, :, :filled].repeat_interleave(group, 1)
    m = mask[..., :filled] if mask is not None else None
    theirs = F.scaled_dot_product_attention(q, kk, vv, attn_mask=m, scale=scale)
    return (theirs.float() - ref).abs().max().item()


def _check(out, q, k, v, mask, scale, filled, key_len=None):
    ref = attention_ref(q.float(), k.float(), v.float(), mask, scale, False, True, key_len=key_len)
    err = (out.float() - ref).abs().max().item()
    if q.dtype == torch.float32:
        assert err <= ATOL[torch.float32], err
        return
    torch_err = _torch_err(q, k, v, mask, scale, filled, ref)
    assert err <= 2 * torch_err + ATOL[q.dtype], f"err {err:.3e} vs torch {torch_err:.3e}"


# name, batch, nheads, nheads_kv, head_dim
GEOMETRIES = [
    ("llama-1.1b", 1, 32, 4, 64),
    ("llama-1.1b", 8, 32, 4, 64),
    ("llama-1.1b", 32, 32, 4, 64),
    ("llama-7b", 4, 32, 32, 128),
    ("gemma-2b", 2, 8, 1, 256),
    ("phi-2", 3, 32, 32, 80),
    ("qwen2-0.5b", 5, 14, 2, 64),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cache_len, filled", [(256, 161), (4096, 3001), (4096, 40)])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"{g[0]}-b{g[1]}")
def test_static_cache_step(geometry, cache_len, filled, dtype):
    """One query row per head over a static cache whose mask hides the unfilled tail, with and
    without the mask summary (which trims the key range), and with key_len instead of a mask."""
    _, batch, nheads, nheads_kv, head_dim = geometry
    q = torch.randn(batch, nheads, 1, head_dim, dtype=dtype, device="cuda")
    k = torch.randn(batch, nheads_kv, cache_len, head_dim, dtype=dtype, device="cuda")
    v = torch.randn(batch, nheads_kv, cache_len, head_dim, dtype=dtype, device="cuda")
    scale = head_dim ** -0.5
    mask = _static_cache_mask(batch, 1, cache_len, filled, dtype, left_pad=5 if batch > 1 else 0)
    summary = attention_mask_summary_fwd(mask, 1, cache_len)
    for s in (None, summary):
        _check(attention_fwd(q, k, v, mask, s, scale, False, False), q, k, v, mask, scale, filled)
    key_len = torch.tensor([filled], dtype=torch.int32, device="cuda")
    out = attention_fwd(q, k, v, None, None, scale, False, True, key_len=key_len)
    _check(out, q, k, v, None, scale, filled, key_len=filled)


@pytest.mark.parametrize("splits", [1, 2, 7, 64])
def test_forced_splits_agree(splits):
    """Any split count gives the one-split result to within fp32 summation order."""
    q = torch.randn(2, 32, 1, 64, dtype=torch.float16, device="cuda")
    k = torch.randn(2, 4, 2048, 64, dtype=torch.float16, device="cuda")
    v = torch.randn(2, 4, 2048, 64, dtype=torch.float16, device="cuda")
    mask = _static_cache_mask(2, 1, 2048, 1500, torch.float16)
    one = _decode(q, k, v, mask, None, 0.125, True, 1)
    many = _decode(q, k, v, mask, None, 0.125, True, splits)
    assert (one.float() - many.float()).abs().max().item() <= 2e-3


def test_speculative_rows_fp32_and_sinks():
    """Four query rows per head (GQA 8 -> 32 rows a program), fp32, and GPT-OSS's sinks."""
    q = torch.randn(2, 16, 4, 64, device="cuda")
    k = torch.randn(2, 2, 1000, 64, device="cuda")
    v = torch.randn(2, 2, 1000, 64, device="cuda")
    mask = _static_cache_mask(2, 4, 1000, 700, torch.float32)
    out = attention_fwd(q, k, v, mask, None, 0.125, False, True)
    _check(out, q, k, v, mask, 0.125, 700)
    sinks = torch.randn(16, device="cuda") * 3
    out = attention_fwd(q, k, v, mask, None, 0.125, False, True, sinks=sinks)
    ref = attention_ref(q, k, v, mask, 0.125, False, True, sinks=sinks)
    assert (out - ref).abs().max().item() <= ATOL[torch.float32]


def test_cuda_graph_replays_follow_key_len():
    """Captured once for a 4096-key cache (several splits), replayed as the filled length grows:
    each replay attends exactly the keys filled so far."""
    q = torch.randn(1, 32, 1, 64, dtype=torch.float16, device="cuda")
    k = torch.randn(1, 4, 4096, 64, dtype=torch.float16, device="cuda")
    v = torch.randn(1, 4, 4096, 64, dtype=torch.float16, device="cuda")
    assert num_splits(4, 4096, q.device) > 1
    key_len = torch.tensor([10], dtype=torch.int32, device="cuda")
    attention_fwd(q, k, v, None, None, 0.125, False, True, key_len=key_len)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_fwd(q, k, v, None, None, 0.125, False, True, key_len=key_len)
    for filled in (10, 257, 1024, 4095, 4096):
        key_len.fill_(filled)
        graph.replay()
        _check(out, q, k, v, None, 0.125, filled, key_len=filled)
