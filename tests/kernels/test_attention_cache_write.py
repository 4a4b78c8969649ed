"""attention_fwd(..., new_kv=(k, v, cos, sin, start)): a decode step's (rotary +) KV-cache write fused
into the decode attention (kernels/attention_decode.py), against the two references it replaces:
rotary_kv_cache_write_ref (kv_cache_write_ref without tables), then attention_ref on the written cache. The cache holds NaN at the
positions being written, so a program that read such a row before (or while) it is written shows."""

import pytest
import torch

from tests.kernels.attention_cases import FP32_MIN
from transfuse.kernels import attention_decode
from transfuse.kernels.attention import attention_fwd, attention_mask_summary_fwd
from transfuse.reference.attention import attention_ref
from transfuse.reference.kv_cache import kv_cache_write_ref, rotary_kv_cache_write_ref


def _step(batch, nheads, nheads_kv, n, cache_len, head_dim, dtype, device):
    """Unrotated q, k, v as views of one (batch, n, (HQ + 2 HK) * D) linear output, as a merged Q/K/V
    linear gives them, HF-style cos/sin (batch, 1, n, D) at per-row positions, and a cache whose
    unwritten tail is NaN."""
    cols = (nheads + 2 * nheads_kv) * head_dim
    qkv = torch.randn(batch, n, cols, device=device).to(dtype)
    q, k, v = qkv.split([nheads * head_dim, nheads_kv * head_dim, nheads_kv * head_dim], dim=-1)
    q, k, v = (t.view(batch, n, -1, head_dim).transpose(1, 2) for t in (q, k, v))
    positions = torch.arange(n, device=device) + torch.randint(5, 30, (batch, 1), device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = positions[..., None].float() * inv_freq
    emb = torch.cat((angles, angles), dim=-1)[:, None]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    keys = torch.randn(batch, nheads_kv, cache_len, head_dim, device=device).to(dtype)
    values = torch.randn(batch, nheads_kv, cache_len, head_dim, device=device).to(dtype)
    return q, k, v, cos, sin, keys, values


def _run(q, k, v, cos, sin, keys, values, start, mask, summary, scale, key_len=None, sinks=None, splits=None,
         monkeypatch=None, rotary=True):
    """(fused output, its cache) and (reference output, its cache); `start` an int; rotary=False: a
    plain cache write, q as it is."""
    filled = keys.clone(), values.clone()
    for t in filled:
        t[:, :, start:start + q.shape[2]] = float("nan")  # the rows the write replaces
    ref_keys, ref_values = (t.float() for t in filled)  # the references in fp32
    start_t = torch.tensor(start, dtype=torch.int64, device=q.device)
    if rotary:
        q_rot = rotary_kv_cache_write_ref(ref_keys, ref_values, q.float(), k.float(), v.float(), cos.float(),
                                          sin.float(), start_t)
    else:
        fits = torch.arange(k.shape[2], device=k.device) + start < keys.shape[2]
        kv_cache_write_ref(ref_keys, ref_values, k.float()[:, :, fits], v.float()[:, :, fits], start_t)
        q_rot = q.float()
    kl = int(key_len.item()) if key_len is not None else None
    ref = attention_ref(q_rot, ref_keys, ref_values, mask, scale, False, True,
                        key_len=kl, sinks=sinks)
    if splits is not None:
        real = attention_decode.attention_decode_fwd
        monkeypatch.setattr("transfuse.kernels.attention.attention_decode_fwd",
                            lambda *a, **kw: real(*a, **dict(kw, splits=splits)))
    keys_out, values_out = filled
    out = attention_fwd(q, keys_out, values_out, mask, summary, scale, False, True, key_len, sinks,
                        new_kv=(k, v, cos, sin, start_t) if rotary else (k, v, None, None, start_t))
    return out, keys_out, values_out, ref, ref_keys, ref_values


CASES = [
    # batch, nheads, nheads_kv, n (new tokens), cache_len, head_dim
    (3, 4, 2, 1, 70, 32),    # GQA 2, one token (a decode step)
    (2, 6, 1, 3, 45, 16),    # MQA, three new tokens (speculative)
    (1, 2, 2, 1, 40, 64),    # MHA
]


@pytest.mark.parametrize("rotary", [True, False], ids=["rotary", "plain"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("mask_name", [None, "pad_bool", "static_min"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_fused_write_matches_write_then_attention(case, mask_name, splits, rotary, device, monkeypatch):
    batch, nheads, nheads_kv, n, cache_len, head_dim = case
    q, k, v, cos, sin, keys, values = _step(batch, nheads, nheads_kv, n, cache_len, head_dim, torch.float32, device)
    start = 33 if cache_len > 40 else 20
    if mask_name == "pad_bool":  # left padding and the keys written so far (a bool (B, 1, n, L) mask)
        mask = torch.zeros(batch, 1, n, cache_len, dtype=torch.bool, device=device)
        mask[..., : start + n] = True
        mask[0, ..., :4] = False
    elif mask_name == "static_min":  # HF StaticCache's finfo.min over the unfilled tail, per head
        mask = torch.zeros(batch, nheads, n, cache_len, device=device)
        mask[..., start + n:] = FP32_MIN
        mask[:, 0, ..., :2] = FP32_MIN
    else:
        mask = None
    key_len = torch.tensor([start + n], dtype=torch.int32, device=device) if mask is None else None
    summaries = [None, attention_mask_summary_fwd(mask, n, cache_len)] if mask is not None else [None]
    for summary in summaries:
        out, ko, vo, ref, rk, rv = _run(q, k, v, cos, sin, keys, values, start, mask, summary, 0.3, key_len,
                                        splits=splits, monkeypatch=monkeypatch, rotary=rotary)
        torch.testing.assert_close(ko[:, :, : start + n], rk[:, :, : start + n], atol=0, rtol=0)
        torch.testing.assert_close(vo[:, :, : start + n], rv[:, :, : start + n], atol=0, rtol=0)
        assert torch.equal(ko[:, :, start + n:], keys[:, :, start + n:])  # nothing else written
        assert torch.equal(vo[:, :, start + n:], values[:, :, start + n:])
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_new_keys_past_the_cache_are_dropped_and_sinks_join_once(device):
    """A write that runs past the cache's end keeps the positions that fit (as the write kernel does),
    and the attention sees only the cache's keys; sinks are added once, whichever split holds the
    new keys."""
    q, k, v, cos, sin, keys, values = _step(2, 4, 2, 3, 40, 16, torch.float32, device)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=device)
    out, ko, vo, ref, rk, rv = _run(q, k, v, cos, sin, keys, values, 38, None, None, 0.25, sinks=sinks)
    torch.testing.assert_close(ko, rk, atol=0, rtol=0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_cache_bits_and_output_within_torch_error(dtype, device):
    """The cache gets rotary(k) rounded once to its dtype (the write kernel's bits); the output is
    within twice PyTorch's own error of fp32."""
    q, k, v, cos, sin, keys, values = _step(3, 8, 2, 1, 80, 32, dtype, device)
    out, ko, vo, ref, rk, rv = _run(q, k, v, cos, sin, keys, values, 50, None, None, 0.125,
                                    key_len=torch.tensor([51], dtype=torch.int32, device=device))
    from transfuse.kernels.kv_cache import rotary_kv_cache_write_fwd

    wk, wv = keys.clone(), values.clone()
    start = torch.tensor(50, device=device)
    q_rot = rotary_kv_cache_write_fwd(wk, wv, q, k, v, cos, sin, start)
    assert torch.equal(ko[:, :, :51], wk[:, :, :51]) and torch.equal(vo[:, :, :51], wv[:, :, :51])
    torch_out = attention_ref(q_rot, wk, wv, None, 0.125, False, True, key_len=51)  # in dtype
    torch_err = (torch_out.float() - ref).abs().max().item()
    assert out.dtype == dtype
    assert (out.float() - ref).abs().max().item() <= 2 * torch_err + 1e-3


@pytest.mark.parametrize("rotary", [True, False], ids=["rotary", "plain"])
def test_prefill_rows_run_the_write_kernel_first(rotary, device, monkeypatch):
    """More new rows than a decode step (or a causal call): the write kernel, then the prefill
    attention on the written cache; same result as the references."""
    calls = []
    real = attention_decode.attention_decode_fwd
    monkeypatch.setattr("transfuse.kernels.attention.attention_decode_fwd",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, cos, sin, keys, values = _step(2, 4, 2, 12, 40, 16, torch.float32, device)
    out, ko, vo, ref, rk, rv = _run(q, k, v, cos, sin, keys, values, 10, None, None, 0.25,
                                    key_len=torch.tensor([22], dtype=torch.int32, device=device), rotary=rotary)
    assert not calls
    torch.testing.assert_close(ko[:, :, :22], rk[:, :, :22], atol=0, rtol=0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
