"""transfuse.kernels.attention against the fp32 reference and against eager PyTorch (interpreter-sized)."""

import pytest
import torch
import torch.nn.functional as F

from transfuse.kernels.attention import (
    SUMMARY_BLOCK_M,
    SUMMARY_BLOCK_N,
    SUMMARY_FLAG_DENSE_ROW,
    SUMMARY_FLAG_DENSE_ROW_CAUSAL,
    attention_fwd,
    attention_mask_summary_fwd,
)
from tests.kernels.attention_cases import FP32_MIN, qkv
from transfuse.reference.attention import attention_mask_summary_ref, attention_ref


# The interpreter runs the kernels in numpy, which warns about the -inf/NaN arithmetic that fully
# masked rows and NaN inputs do on purpose.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _sdpa(q, k, v, mask, scale, is_causal):
    """torch's own attention in q's dtype (GQA by repeating k/v)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)


def _max_err(a, b):
    return (a.float() - b.float()).abs().nan_to_num(0.0).max().item()


def _check(out, q, k, v, mask, scale, is_causal, masked_rows_zero, atol=1e-5):
    """err(ours) <= 2 * err(torch in the same dtype) + atol against the fp32 reference; NaN where it is NaN."""
    ref = attention_ref(q.float(), k.float(), v.float(), mask, scale, is_causal, masked_rows_zero)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert torch.equal(out.isnan(), ref.isnan()), "NaN pattern differs from the reference"
    err = _max_err(out, ref)
    torch_err = 0.0
    if q.dtype != torch.float32:
        torch_err = _max_err(attention_ref(q, k, v, mask, scale, is_causal, masked_rows_zero), ref)
    assert err <= 2 * torch_err + atol, f"err {err:.3e} vs torch {torch_err:.3e}"


def _expected_out_strides(q):
    batch, nheads, seqlen_q, head_dim = q.shape
    return torch.empty(batch, seqlen_q, nheads, head_dim).transpose(1, 2).stride()


SHAPES = [
    # batch, nheads, nheads_kv, seqlen_q, seqlen_k, head_dim
    (2, 3, 3, 37, 37, 64),
    (3, 4, 2, 5, 37, 80),    # GQA 4 -> 2, seqlen_q < seqlen_k, head dim padded to 128
    (2, 4, 1, 37, 19, 32),   # MQA, seqlen_q > seqlen_k
    (1, 2, 2, 16, 16, 16),
    (1, 1, 1, 1, 1, 16),     # ones are specialised by Triton: check they still compile
]


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attention_matches_reference(shape, is_causal, dtype, atol, device):
    q, k, v = qkv(*shape, dtype, device)
    scale = shape[-1] ** -0.5
    out = attention_fwd(q, k, v, None, None, scale, is_causal, True)
    assert out.stride() == _expected_out_strides(q)
    _check(out, q, k, v, None, scale, is_causal, True, atol)


def test_attention_matches_sdpa(device):
    q, k, v = qkv(2, 4, 2, 29, 29, 48, torch.float32, device)
    out = attention_fwd(q, k, v, None, None, 0.3, True, True)
    torch.testing.assert_close(out, _sdpa(q, k, v, None, 0.3, True), atol=1e-5, rtol=1e-5)


# ---- masks -----------------------------------------------------------------------------------------
# seqlen_k = 150 spans three summary columns (SUMMARY_BLOCK_N = 64); seqlen_q = 40 two kernel row blocks.
B, H, SQ, SK = 2, 2, 40, 150


def _padding_bool(device, lengths=(21, 150)):
    keep = torch.arange(SK, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]
    return keep[:, None, None, :]  # (B, 1, 1, Sk)


def _mask_forms(device):
    """name -> mask, every form the op accepts; several have fully masked rows and blocks."""
    pad = _padding_bool(device)
    rand_bool = torch.rand(B, 1, SQ, SK, device=device) > 0.4
    rand_bool[0, 0, 3] = False                          # a fully masked row
    rand_bool[1, 0, :, 64:128] = False                   # a fully masked summary block
    additive_min = torch.zeros(1, 1, SQ, SK, device=device)
    additive_min[..., 90:] = FP32_MIN
    additive_min[..., 7, :] = FP32_MIN                   # a row masked by finite values only
    additive_inf = torch.zeros(SQ, SK, device=device)
    additive_inf[:, :30] = float("-inf")
    additive_inf[5] = float("-inf")                      # a row that softmax turns into NaN
    bias = torch.randn(B, H, SQ, SK, device=device)      # ALiBi-like arbitrary float bias
    bias[..., 140:] = FP32_MIN
    half_min = torch.zeros(B, 1, 1, SK, dtype=torch.float16, device=device)
    half_min[1, ..., 60:] = torch.finfo(torch.float16).min
    return {
        "bool_pad_B11S": pad,
        "bool_B1QS": rand_bool,
        "bool_expanded_stride0": pad.expand(B, H, SQ, SK),
        "add_min_11QS": additive_min,
        "add_inf_QS": additive_inf,
        "add_bias_BHQS": bias,
        "add_fp16_min_B11S": half_min,
        "add_pad_min_B11S": torch.zeros(B, 1, 1, SK, device=device).masked_fill(~pad, FP32_MIN),
    }


MASK_NAMES = list(_mask_forms("cpu"))


@pytest.mark.parametrize("use_summary", [False, True])
@pytest.mark.parametrize("mask_name", MASK_NAMES)
def test_attention_masks(mask_name, use_summary, device):
    mask = _mask_forms(device)[mask_name]
    q, k, v = qkv(B, H, H, SQ, SK, 32, torch.float32, device)
    summary = attention_mask_summary_fwd(mask, SQ, SK) if use_summary else None
    for is_causal, masked_rows_zero in [(False, True), (False, False), (True, True)]:
        out = attention_fwd(q, k, v, mask, summary, 0.2, is_causal, masked_rows_zero)
        _check(out, q, k, v, mask, 0.2, is_causal, masked_rows_zero)


@pytest.mark.parametrize("mask_name", ["bool_B1QS", "add_min_11QS"])
def test_attention_masks_fp16_gqa(mask_name, device):
    mask = _mask_forms(device)[mask_name]
    q, k, v = qkv(B, 4, 2, SQ, SK, 24, torch.float16, device)
    summary = attention_mask_summary_fwd(mask, SQ, SK)
    out = attention_fwd(q, k, v, mask, summary, 0.25, False, True)
    _check(out, q, k, v, mask, 0.25, False, True, atol=2e-3)


# ---- fully masked rows reproduce eager PyTorch -----------------------------------------------------

@pytest.mark.parametrize("use_summary", [False, True])
def test_fully_masked_rows_like_eager(use_summary, device):
    q, k, v = qkv(1, 2, 2, SQ, SK, 16, torch.float32, device)
    scale = 0.25
    keep = torch.rand(SQ, SK, device=device) > 0.3
    keep[4] = False
    keep[:, 64:128] = False
    summarise = (lambda m: attention_mask_summary_fwd(m, SQ, SK)) if use_summary else (lambda m: None)

    # SDPA with a bool mask: all-False rows give zeros (its safe softmax).
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)
    assert eager[:, :, 4].eq(0).all()
    ours = attention_fwd(q, k, v, keep, summarise(keep), scale, False, True)
    torch.testing.assert_close(ours, eager, atol=1e-5, rtol=1e-5)

    # Hand-written softmax with a -inf additive mask: all -inf rows give NaN.
    additive = torch.zeros(SQ, SK, device=device).masked_fill(~keep, float("-inf"))
    eager = torch.softmax(q @ k.transpose(-1, -2) * scale + additive, -1) @ v
    assert eager[:, :, 4].isnan().all() and not eager[:, :, 5].isnan().any()
    ours = attention_fwd(q, k, v, additive, summarise(additive), scale, False, False)
    torch.testing.assert_close(ours, eager, atol=1e-5, rtol=1e-5, equal_nan=True)
    # ... and SDPA with the same -inf mask gives zeros.
    ours = attention_fwd(q, k, v, additive, summarise(additive), scale, False, True)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=scale),
                               atol=1e-5, rtol=1e-5)

    # finfo.min: score + min rounds to min for every key, so the row averages all of v; both flags.
    additive = torch.zeros(SQ, SK, device=device).masked_fill(~keep, FP32_MIN)
    eager = torch.softmax(q @ k.transpose(-1, -2) * scale + additive, -1) @ v
    torch.testing.assert_close(eager[:, :, 4], v.mean(2), atol=1e-5, rtol=1e-5)
    for masked_rows_zero in (False, True):
        ours = attention_fwd(q, k, v, additive, summarise(additive), scale, False, masked_rows_zero)
        torch.testing.assert_close(ours, eager, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            ours, F.scaled_dot_product_attention(q, k, v, attn_mask=additive, scale=scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_summary", [False, True])
def test_rows_fully_masked_only_under_causal(use_summary, device):
    """Row i's visible keys all lie above the diagonal: with finite masking its softmax spreads over j <= i."""
    q, k, v = qkv(1, 1, 1, SQ, SK, 16, torch.float32, device)
    keep = torch.ones(SQ, SK, dtype=torch.bool, device=device)
    keep[20:30, :100] = False            # rows 20..29 only see keys >= 100, all above the diagonal
    for mask in (torch.zeros(SQ, SK, device=device).masked_fill(~keep, FP32_MIN), keep):
        summary = attention_mask_summary_fwd(mask, SQ, SK) if use_summary else None
        if use_summary and mask.dtype != torch.bool:
            assert summary[0, 0, 0, -1] == SUMMARY_FLAG_DENSE_ROW_CAUSAL
        for masked_rows_zero in (False, True):
            out = attention_fwd(q, k, v, mask, summary, 0.3, True, masked_rows_zero)
            _check(out, q, k, v, mask, 0.3, True, masked_rows_zero)
        eager = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True, scale=0.3)
        out = attention_fwd(q, k, v, mask, summary, 0.3, True, True)
        torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_left_padding_causal_dense_rows(dtype, device):
    """Left padding + causal (a batched causal LM): rows i < 64 see no key. With finfo.min masking their
    softmax spreads over j <= i, all in the leading block that the summary would skip; the
    DENSE_ROW_CAUSAL flag must keep it. With a bool mask they are zero (SDPA) and skipping is exact."""
    seqlen = 100
    q, k, v = qkv(1, 2, 2, seqlen, seqlen, 16, torch.float32, device)
    keep = (torch.arange(seqlen, device=device) >= 64).expand(seqlen, seqlen)
    mask = keep if dtype == torch.bool else torch.zeros(seqlen, seqlen, device=device).masked_fill(~keep, FP32_MIN)
    summary = attention_mask_summary_fwd(mask, seqlen, seqlen)
    assert summary[0, 0, 0].tolist() == [0, 2, 0 if dtype == torch.bool else SUMMARY_FLAG_DENSE_ROW_CAUSAL]
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True, scale=0.25)
    out = attention_fwd(q, k, v, mask, summary, 0.25, True, True)
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    if dtype != torch.bool:
        torch.testing.assert_close(out[:, :, 10], v[:, :, :11].mean(2), atol=1e-5, rtol=1e-5)
        summary[..., -1] = 0  # without the flag the leading block is skipped and those rows go wrong
        wrong = attention_fwd(q, k, v, mask, summary, 0.25, True, True)
        assert not torch.allclose(wrong[:, :, :64], eager[:, :, :64], atol=1e-3)
        torch.testing.assert_close(wrong[:, :, 64:], eager[:, :, 64:], atol=1e-5, rtol=1e-5)
    # Non-causal: every row sees keys >= 64, skipping the leading block is exact, no flag needed.
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
    torch.testing.assert_close(attention_fwd(q, k, v, mask, summary, 0.25, False, True), eager, atol=1e-5, rtol=1e-5)


def test_nan_inputs_propagate_like_eager(device):
    q, k, v = qkv(1, 2, 2, 21, 33, 16, torch.float32, device)
    q[0, 0, 3, 5] = float("nan")   # one query row
    k[0, 1, 7, 2] = float("nan")   # one key: every row of head 1
    v[0, 0, 30, 0] = float("nan")  # one value: column 0 of every row of head 0
    eager = F.scaled_dot_product_attention(q, k, v, scale=0.25)
    out = attention_fwd(q, k, v, None, None, 0.25, False, True)
    assert eager.isnan().any() and torch.equal(out.isnan(), eager.isnan())
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5, equal_nan=True)


# ---- layout ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_strided_qkv_from_fused_buffer(dtype, device):
    batch, seqlen, nheads, head_dim = 2, 23, 3, 40
    qkv = torch.randn(batch, seqlen, 3 * nheads * head_dim, dtype=dtype, device=device)
    q, k, v = (t.view(batch, seqlen, nheads, head_dim).transpose(1, 2) for t in qkv.split(nheads * head_dim, -1))
    assert not q.is_contiguous()
    mask = _padding_bool(device, (23, 11))[..., :seqlen]
    out = attention_fwd(q, k, v, mask, attention_mask_summary_fwd(mask, seqlen, seqlen), 0.2, False, True)
    assert out.stride() == _expected_out_strides(q)
    out.transpose(1, 2).view(batch, seqlen, nheads * head_dim)  # a free view: raises if not
    _check(out, q, k, v, mask, 0.2, False, True, atol=1e-5 if dtype == torch.float32 else 2e-3)


def test_non_unit_last_stride(device):
    q, k, v = qkv(1, 2, 2, 9, 9, 16, torch.float32, device)
    qt = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, stride(-1) != 1
    assert qt.stride(-1) != 1
    torch.testing.assert_close(attention_fwd(qt, k, v, None, None, 0.25, False, True),
                               attention_fwd(q, k, v, None, None, 0.25, False, True))


def test_inputs_not_modified(device):
    q, k, v = qkv(1, 2, 2, 9, 9, 16, torch.float32, device)
    mask = torch.rand(9, 9, device=device) > 0.5
    before = [t.clone() for t in (q, k, v, mask)]
    attention_fwd(q, k, v, mask, attention_mask_summary_fwd(mask, 9, 9), 0.25, True, True)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v, mask)))


# ---- the summary --------------------------------------------------------------------------------------

def test_summary_padding_values(device):
    seqlen_q, seqlen_k = 130, 150
    keep = torch.arange(seqlen_k, device=device)[None, :] < torch.tensor([64, 100, 0], device=device)[:, None]
    for mask in (keep[:, None, None, :], torch.zeros(3, 1, 1, seqlen_k, device=device).masked_fill(~keep[:, None, None, :], FP32_MIN)):
        summary = attention_mask_summary_fwd(mask, seqlen_q, seqlen_k)
        assert summary.shape == (3, 1, 2, 4) and summary.dtype == torch.int8
        assert summary[0, 0, :, :3].tolist() == [[2, 0, 0]] * 2
        assert summary[1, 0, :, :3].tolist() == [[2, 1, 0]] * 2
        assert summary[2, 0, :, :3].tolist() == [[0, 0, 0]] * 2
        if mask.dtype == torch.bool:  # bool: skipping is exact for every row, no flags
            assert summary[..., 3].eq(0).all()
        else:  # sequence 2 has no visible key at all and finite masking
            assert summary[0:2, ..., 3].eq(0).all()
            assert summary[2, 0, :, 3].tolist() == [SUMMARY_FLAG_DENSE_ROW | SUMMARY_FLAG_DENSE_ROW_CAUSAL] * 2
        torch.testing.assert_close(summary, attention_mask_summary_ref(mask, seqlen_q, seqlen_k), rtol=0, atol=0)


@pytest.mark.parametrize("mask_name", MASK_NAMES)
def test_summary_matches_reference(mask_name, device):
    mask = _mask_forms(device)[mask_name]
    summary = attention_mask_summary_fwd(mask, SQ, SK)
    expect = attention_mask_summary_ref(mask, SQ, SK)
    assert summary.shape == expect.shape == (mask.shape[0] if mask.dim() == 4 else 1,
                                             mask.shape[1] if mask.dim() == 4 else 1,
                                             -(-SQ // SUMMARY_BLOCK_M), -(-SK // SUMMARY_BLOCK_N) + 1)
    assert torch.equal(summary, expect)


@pytest.mark.parametrize("seqlen_q", [1, 3])
@pytest.mark.parametrize("seqlen_k", [150, 600])
def test_summary_of_decode_rows_matches_reference(seqlen_q, seqlen_k, device):
    """Fewer query rows than a summary block (decode): several key blocks per iteration, the last
    group partial (150 keys: 3 blocks; 600: 10). Every mask form, each with blocks of each class."""
    g = torch.Generator().manual_seed(seqlen_q * 1000 + seqlen_k)
    keep = torch.rand(2, 1, seqlen_q, seqlen_k, generator=g) > 0.3
    keep[0, ..., :64] = True                      # a block with nothing masked
    keep[1, ..., 64:192] = False                  # fully masked blocks
    keep[0, ..., seqlen_k - 5:] = False           # right padding inside the last block
    additive = torch.zeros(2, 1, seqlen_q, seqlen_k).masked_fill(~keep, FP32_MIN)
    additive[1, ..., 0, :] = FP32_MIN             # a row masked by finite values only
    infs = torch.zeros(1, 1, 1, seqlen_k).masked_fill(torch.rand(seqlen_k, generator=g) > 0.5, float("-inf"))
    nans = torch.randn(2, 1, seqlen_q, seqlen_k, generator=g)
    nans[0, 0, 0, seqlen_k // 2] = float("nan")
    for mask in (keep, additive, infs, nans, additive.half()):
        mask = mask.to(device)
        summary = attention_mask_summary_fwd(mask, seqlen_q, seqlen_k)
        assert torch.equal(summary.cpu(), attention_mask_summary_ref(mask, seqlen_q, seqlen_k).cpu()), mask.dtype


@pytest.mark.parametrize("masked_keys, nan_key, expect", [
    (slice(64, None), 100, [2, 0, 0]),   # right padding: trailing blocks
    (slice(0, 64), 10, [0, 2, 2]),       # left padding: leading blocks
])
def test_summary_skips_blocks(masked_keys, nan_key, expect, device):
    """Fully masked leading/trailing blocks are not read with a summary (a NaN value there stays out,
    as in SDPA's flash path); without a summary every block is read and 0 * NaN gives eager's NaN."""
    q, k, v = qkv(1, 1, 1, 16, 150, 16, torch.float32, device)
    keep = torch.ones(16, 150, dtype=torch.bool, device=device)
    keep[:, masked_keys] = False
    v[0, 0, nan_key, 0] = float("nan")
    summary = attention_mask_summary_fwd(keep, 16, 150)
    assert summary[0, 0, 0, :3].tolist() == expect
    out = attention_fwd(q, k, v, keep, summary, 0.25, False, True)
    assert not out.isnan().any()
    _check(out, q, k, v.nan_to_num(0.0), keep, 0.25, False, True)
    assert attention_fwd(q, k, v, keep, None, 0.25, False, True)[..., 0].isnan().all()


def test_summary_no_masking_blocks_skip_the_mask(device):
    """A block marked NO_MASKING is computed without reading the mask (checked with a deliberately wrong summary)."""
    q, k, v = qkv(1, 1, 1, 16, 150, 16, torch.float32, device)
    keep = torch.ones(16, 150, dtype=torch.bool, device=device)
    keep[:, :10] = False
    summary = attention_mask_summary_fwd(keep, 16, 150)
    assert summary[0, 0, 0, 0] == 1
    summary[0, 0, 0, 0] = 2
    out = attention_fwd(q, k, v, keep, summary, 0.25, False, True)
    torch.testing.assert_close(out, attention_ref(q, k, v, None, 0.25, False, True), atol=1e-5, rtol=1e-5)


def test_bad_arguments(device):
    q, k, v = qkv(1, 2, 2, 9, 9, 16, torch.float32, device)
    with pytest.raises(ValueError):
        attention_fwd(q, k, v, torch.ones(3, 9, dtype=torch.bool, device=device), None, 0.25, False, True)
    mask = torch.ones(9, 9, dtype=torch.bool, device=device)
    with pytest.raises(ValueError):
        attention_fwd(q, k, v, mask, attention_mask_summary_fwd(mask, 9, 200), 0.25, False, True)
    with pytest.raises(ValueError):
        attention_fwd(q, k[:, :1].expand(1, 3, 9, 16)[:, :3], v, None, None, 0.25, False, True)


# ---- key_len: the keys of a padded batch end early --------------------------------------------

@pytest.mark.parametrize("mask_name", [None, "bool_pad_B11S", "add_min_11QS", "add_bias_BHQS"])
@pytest.mark.parametrize("key_len", [1, 70, 129])
def test_key_len_ignores_padded_keys(mask_name, key_len, device):
    """Keys from key_len on are padding: never attended, never read (NaN there changes nothing),
    and the real keys give what the unpadded problem gives."""
    mask = _mask_forms(device)[mask_name] if mask_name else None
    q, k, v = qkv(B, H, H, SQ, SK, 32, torch.float32, device)
    k[:, :, key_len:] = float("nan")
    v[:, :, key_len:] = float("nan")
    summary = attention_mask_summary_fwd(mask, SQ, SK) if mask is not None else None
    n = torch.tensor([key_len], dtype=torch.int32, device=device)
    for is_causal, masked_rows_zero in [(False, True), (True, False)]:
        out = attention_fwd(q, k, v, mask, summary, 0.2, is_causal, masked_rows_zero, key_len=n)
        ref = attention_ref(q, k, v, mask, 0.2, is_causal, masked_rows_zero, key_len=key_len)
        assert torch.equal(out.isnan(), ref.isnan())
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, equal_nan=True)


# ---- sinks: one extra logit per head with no value (GPT-OSS) ---------------------------------

def _gpt_oss_eager(q, k, v, mask, sinks, scale):
    """GPT-OSS's eager attention as Hugging Face writes it: the sinks concatenated to the scores,
    the row maximum subtracted, softmax, the sink column dropped."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores + mask
    sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1] @ v


@pytest.mark.parametrize("use_summary", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sinks_match_eager(is_causal, use_summary, device):
    """Sinks take their share of every row (some large, so that the sink is the row's maximum);
    rows that see no key (-inf or finfo.min masks) give 0, as eager's form does; GQA 4 -> 2."""
    q, k, v = qkv(2, 4, 2, SQ, SK, 32, torch.float32, device)
    sinks = torch.tensor([0.5, -1.0, 3.0, 40.0], device=device)
    keep = torch.rand(2, 1, SQ, SK, device=device) > 0.3
    keep[:, :, 5] = False
    keep[:, :, :, 64:128] = False
    for fill in (float("-inf"), FP32_MIN):
        mask = torch.zeros(keep.shape, device=device).masked_fill(~keep, fill)
        summary = attention_mask_summary_fwd(mask, SQ, SK) if use_summary else None
        out = attention_fwd(q, k, v, mask, summary, 0.3, is_causal, False, sinks=sinks)
        causal = torch.ones(SQ, SK, dtype=torch.bool, device=device).triu(1)
        eager = _gpt_oss_eager(q, k, v, mask.masked_fill(causal, float("-inf")) if is_causal else mask, sinks, 0.3)
        assert out[:, :, 5].eq(0).all() and not out.isnan().any()
        torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
        ref = attention_ref(q, k, v, mask, 0.3, is_causal, False, sinks=sinks)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # no mask, fp16 and bf16 within twice torch's own error in the dtype against fp32
    for dtype in (torch.float16, torch.bfloat16):
        qh, kh, vh, sh = q.to(dtype), k.to(dtype), v.to(dtype), sinks.to(dtype)
        out = attention_fwd(qh, kh, vh, None, None, 0.3, is_causal, True, sinks=sh)
        ref = attention_ref(qh.float(), kh.float(), vh.float(), None, 0.3, is_causal, True, sinks=sh.float())
        torch_err = _max_err(attention_ref(qh, kh, vh, None, 0.3, is_causal, True, sinks=sh), ref)
        assert out.dtype == dtype and _max_err(out, ref) <= 2 * torch_err + 2e-3


def test_sinks_must_be_one_per_head(device):
    q, k, v = qkv(1, 4, 2, 5, 5, 16, torch.float32, device)
    with pytest.raises(ValueError, match="one float per query head"):
        attention_fwd(q, k, v, None, None, 0.3, False, True, sinks=torch.zeros(2, device=device))


# ---- value head dim other than the query/key head dim (DeepSeek's multi-head latent attention) --

@pytest.mark.parametrize("head_dims", [(24, 16), (40, 64), (16, 80)], ids=lambda d: f"qk{d[0]}-v{d[1]}")
@pytest.mark.parametrize("is_causal", [False, True])
def test_value_head_dim_differs(head_dims, is_causal, device):
    """q/k of one head dim, v of another (DeepSeek-V3: 192 and 128), GQA 4 -> 2, a padding mask
    read through its summary, a padded key length, and sinks: each against the reference; the
    output takes v's head dim and keeps the layout the next GEMM reads."""
    d_qk, d_v = head_dims
    q, k, _ = qkv(2, 4, 2, SQ, SK, d_qk, torch.float32, device)
    v = torch.randn(2, 2, SK, d_v, device=device)
    mask = _padding_bool(device)
    summary = attention_mask_summary_fwd(mask, SQ, SK)
    out = attention_fwd(q, k, v, mask, summary, 0.2, is_causal, True)
    assert out.shape == (2, 4, SQ, d_v) and out.stride() == _expected_out_strides(out)
    torch.testing.assert_close(out, attention_ref(q, k, v, mask, 0.2, is_causal, True), atol=1e-5, rtol=1e-5)
    n = torch.tensor([100], dtype=torch.int32, device=device)
    sinks = torch.randn(4, device=device)
    out = attention_fwd(q, k, v, None, None, 0.2, is_causal, True, key_len=n, sinks=sinks)
    ref = attention_ref(q, k, v, None, 0.2, is_causal, True, key_len=100, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
