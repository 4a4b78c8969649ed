"""kernels/attention_decode.py (few query rows, GQA groups packed, key axis split) against the fp32 reference."""

import pytest
import torch

from tests.kernels.attention_cases import FP32_MIN, qkv
from transfuse.kernels import attention_decode
from transfuse.kernels.attention import (
    SUMMARY_BLOCK_N,
    _mask_4d_strides,
    attention_empty_out,
    attention_fwd,
    attention_mask_summary_fwd,
)
from transfuse.reference.attention import attention_ref

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # -inf/NaN rows on purpose


def _decode(q, k, v, mask, summary, scale, masked_rows_zero, splits, key_len=None, sinks=None):
    """attention_decode_fwd called directly, so that `splits` is the test's, not the heuristic's."""
    batch, nheads, seqlen_q, _ = q.shape
    out = attention_empty_out(q, v)
    strides = _mask_4d_strides(mask, batch, nheads, seqlen_q, k.shape[2]) if mask is not None else (0, 0, 0, 0)
    s_strides = (0, 0)
    if summary is not None:
        s_strides = tuple(summary.stride(i) if summary.shape[i] != 1 else 0 for i in (0, 1))
    num_summary_k = -(-k.shape[2] // SUMMARY_BLOCK_N)
    return attention_decode.attention_decode_fwd(
        q, k, v, out, mask, strides, summary, s_strides, SUMMARY_BLOCK_N, num_summary_k,
        key_len, sinks, scale, masked_rows_zero, splits=splits)


def _masks(batch, nheads, seqlen_q, seqlen_k, device):
    """A left-padding bool mask, a static cache's finfo.min mask over its unfilled tail (per head, so
    the summary differs across a GQA group) and a dense additive bias."""
    pad = torch.ones(batch, 1, 1, seqlen_k, dtype=torch.bool, device=device)
    pad[0, ..., :7] = False
    tail = torch.zeros(batch, nheads, seqlen_q, seqlen_k, device=device)
    tail[..., seqlen_k - 40:] = FP32_MIN
    tail[:, 1, ..., 90:] = FP32_MIN  # one head sees fewer keys
    bias = torch.randn(batch, nheads, seqlen_q, seqlen_k, device=device)
    return {"pad_bool_B11S": pad, "tail_min_BHQS": tail, "bias_BHQS": bias}


CASES = [
    # batch, nheads, nheads_kv, seqlen_q, seqlen_k, head_dim, head_dim_v
    (2, 8, 2, 1, 150, 64, 64),   # GQA 4: one program per KV head reads K/V once for 4 query heads
    (1, 4, 4, 3, 137, 80, 80),   # MHA, three rows (speculative), head dim padded to 128
    (2, 6, 1, 1, 130, 40, 24),   # MQA 6, odd head dims, values narrower than keys
]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("mask_name", [None, "pad_bool_B11S", "tail_min_BHQS", "bias_BHQS"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_decode_matches_reference(case, mask_name, splits, device):
    batch, nheads, nheads_kv, seqlen_q, seqlen_k, head_dim, head_dim_v = case
    q, k, _ = qkv(batch, nheads, nheads_kv, seqlen_q, seqlen_k, head_dim, torch.float32, device)
    v = torch.randn(batch, nheads_kv, seqlen_k, head_dim_v, device=device)
    mask = _masks(batch, nheads, seqlen_q, seqlen_k, device)[mask_name] if mask_name else None
    ref = attention_ref(q, k, v, mask, 0.3, False, True)
    for summary in ([None, attention_mask_summary_fwd(mask, seqlen_q, seqlen_k)] if mask is not None else [None]):
        out = _decode(q, k, v, mask, summary, 0.3, True, splits)
        assert out.stride() == attention_empty_out(q, v).stride()
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_within_torch_error(dtype, device):
    q, k, v = (t.to(dtype) for t in qkv(2, 8, 2, 1, 150, 64, torch.float32, device))
    mask = _masks(2, 8, 1, 150, device)["tail_min_BHQS"]
    ref = attention_ref(q.float(), k.float(), v.float(), mask, 0.125, False, True)
    torch_err = (attention_ref(q, k, v, mask, 0.125, False, True).float() - ref).abs().max().item()
    for splits in (1, 3):
        out = _decode(q, k, v, mask, None, 0.125, True, splits)
        assert out.dtype == dtype
        assert (out.float() - ref).abs().max().item() <= 2 * torch_err + 1e-3


@pytest.mark.parametrize("splits", [1, 4])
def test_key_len_reads_no_key_past_it(splits, device):
    """Keys from key_len on are never read (NaN there changes nothing), also when the filled length
    is shorter than one split's share (the other splits see no key and weigh 0 in the combine)."""
    q, k, v = qkv(2, 4, 2, 1, 200, 32, torch.float32, device)
    for key_len in (1, 20, 133):
        kk, vv = k.clone(), v.clone()
        kk[:, :, key_len:] = float("nan")
        vv[:, :, key_len:] = float("nan")
        n = torch.tensor([key_len], dtype=torch.int32, device=device)
        out = _decode(q, kk, vv, None, None, 0.2, True, splits, key_len=n)
        torch.testing.assert_close(out, attention_ref(q, k, v, None, 0.2, False, True, key_len=key_len),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_rows_that_see_no_key_and_sinks(splits, device):
    """A row masked entirely by -inf gives 0 (masked_rows_zero) or NaN as eager's softmax does; by
    finfo.min, eager's uniform weights (the summary's dense flag makes every block visited); sinks
    join each row's softmax once, after the splits are combined."""
    q, k, v = qkv(2, 4, 2, 1, 150, 32, torch.float32, device)
    sinks = torch.tensor([0.5, -1.0, 3.0, 40.0], device=device)
    for fill in (float("-inf"), FP32_MIN):
        mask = torch.zeros(2, 4, 1, 150, device=device)
        mask[..., 100:] = fill
        mask[1, 2] = fill  # this row sees no key
        summary = attention_mask_summary_fwd(mask, 1, 150)
        for masked_rows_zero in (True, False):
            for sink in (None, sinks):
                ref = attention_ref(q, k, v, mask, 0.3, False, masked_rows_zero, sinks=sink)
                for s in (None, summary):
                    out = _decode(q, k, v, mask, s, 0.3, masked_rows_zero, splits, sinks=sink)
                    assert torch.equal(out.isnan(), ref.isnan())
                    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_attention_fwd_takes_this_kernel_for_decode_rows_only(monkeypatch, device):
    """One to eight query rows per head, at most 64 per KV group, no causal triangle; the
    environment switch sends everything to the prefill kernel."""
    calls = []
    real = attention_decode.attention_decode_fwd
    monkeypatch.setattr("transfuse.kernels.attention.attention_decode_fwd",
                        lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    for shape, is_causal, taken in [((1, 8, 2, 1), False, True), ((1, 4, 4, 8), False, True),
                                    ((1, 4, 4, 9), False, False), ((1, 32, 2, 4), False, True), ((1, 32, 2, 5), False, False),
                                    ((1, 4, 4, 1), True, False)]:
        batch, nheads, nheads_kv, seqlen_q = shape
        q, k, v = qkv(batch, nheads, nheads_kv, seqlen_q, 40, 16, torch.float32, device)
        calls.clear()
        out = attention_fwd(q, k, v, None, None, 0.25, is_causal, True)
        assert bool(calls) == taken, shape
        torch.testing.assert_close(out, attention_ref(q, k, v, None, 0.25, is_causal, True), atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("TRANSFUSE_DECODE_ATTENTION", "0")
    calls.clear()
    q, k, v = qkv(1, 8, 2, 1, 40, 16, torch.float32, device)
    attention_fwd(q, k, v, None, None, 0.25, False, True)
    assert not calls


def test_split_count_on_a_gpu_grows_with_the_keys_and_fills_the_gpu(monkeypatch):
    monkeypatch.setattr(attention_decode, "INTERPRET", False)
    monkeypatch.setattr(attention_decode, "num_sms", lambda device: 132)
    cuda = torch.device("cuda", 0)
    assert attention_decode.num_splits(32, 256, cuda) == 1       # batch 8 x 4 KV heads, short cache
    assert attention_decode.num_splits(32, 2048, cuda) == 8      # 2048 / 256 keys
    assert attention_decode.num_splits(4, 32768, cuda) == 64     # capped
    assert attention_decode.num_splits(64, 4096, cuda) == 5      # 320 programs fill the GPU twice
    assert attention_decode.num_splits(256, 4096, cuda) == 1     # a wave already



def test_with_a_mask_on_a_gpu_only_past_one_wave_or_split(monkeypatch):
    """Masked calls stay with the prefill kernel (its summary skips the mask of filled blocks) unless
    its programs would exceed one wave or the key axis is split; unmasked calls always come here."""
    monkeypatch.setattr(attention_decode, "INTERPRET", False)
    monkeypatch.setattr(attention_decode, "num_sms", lambda device: 132)
    cuda = torch.device("cuda", 0)
    applies = attention_decode.decode_applies
    assert not applies(1, 32, 4, 1, 256, False, True, cuda)      # llama b1, short cache: 32 programs
    assert applies(1, 32, 4, 1, 256, False, False, cuda)         # the same with key_len, no mask
    assert applies(8, 32, 4, 1, 256, False, True, cuda)          # 256 programs: two waves
    assert applies(1, 32, 4, 1, 4096, False, True, cuda)         # split
    assert not applies(1, 12, 12, 1, 256, False, True, cuda)     # gpt2 b1
    assert not applies(8, 32, 4, 1, 256, True, False, cuda)      # causal
