"""torch.ops.transfuse.attention / attention_mask_summary: registration, opcheck, fake shapes and strides."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import transfuse.ops.attention  # noqa: F401  (registers the ops)
from transfuse.kernels.attention import SUMMARY_BLOCK_M, SUMMARY_BLOCK_N

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def test_schemas():
    assert str(torch.ops.transfuse.attention.default._schema) == (
        "transfuse::attention(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? mask_summary, "
        "float scale, bool is_causal, bool masked_rows_zero, Tensor? key_len=None, Tensor? sinks=None) -> Tensor")
    assert str(torch.ops.transfuse.attention_mask_summary.default._schema) == (
        "transfuse::attention_mask_summary(Tensor mask, SymInt seqlen_q, SymInt seqlen_k) -> Tensor")


def _inputs(device, dtype=torch.float32):
    batch, nheads, nheads_kv, seqlen_q, seqlen_k, head_dim = 2, 4, 2, 11, 70, 16
    q = torch.randn(batch, seqlen_q, nheads, head_dim, dtype=dtype, device=device).transpose(1, 2)
    k = torch.randn(batch, nheads_kv, seqlen_k, head_dim, dtype=dtype, device=device)
    v = torch.randn(batch, nheads_kv, seqlen_k, head_dim, dtype=dtype, device=device)
    keep = torch.arange(seqlen_k, device=device)[None, :] < torch.tensor([70, 30], device=device)[:, None]
    bool_mask = keep[:, None, None, :]
    additive = torch.zeros(seqlen_q, seqlen_k, device=device)
    additive[:, 65:] = torch.finfo(torch.float32).min
    return q, k, v, bool_mask, additive


def test_opcheck_attention(device):
    q, k, v, bool_mask, additive = _inputs(device)
    summarise = torch.ops.transfuse.attention_mask_summary
    samples = [
        (q, k, v, None, None, 0.25, False, True),
        (q, k, v, None, None, 0.25, True, False),
        (q, k, v, bool_mask, summarise(bool_mask, 11, 70), 0.25, False, True),
        (q, k, v, additive, None, 0.25, True, False),
        (q, k, v, bool_mask, summarise(bool_mask, 11, 70), 0.25, False, True, torch.tensor([41], dtype=torch.int32, device=device)),
        (q, k, v, additive, None, 0.25, True, False, None, torch.randn(4, device=device)),  # sinks, one per head
    ]
    for args in samples:
        torch.library.opcheck(torch.ops.transfuse.attention.default, args)


def test_opcheck_mask_summary(device):
    _, _, _, bool_mask, additive = _inputs(device)
    for mask in (bool_mask, additive):
        torch.library.opcheck(torch.ops.transfuse.attention_mask_summary.default, (mask, 11, 70))


def test_fake_matches_real(device):
    q, k, v, bool_mask, additive = _inputs(device)
    summary = torch.ops.transfuse.attention_mask_summary(bool_mask, 11, 70)
    real = torch.ops.transfuse.attention(q, k, v, bool_mask, summary, 0.25, False, True)
    real_summary = torch.ops.transfuse.attention_mask_summary(additive, 11, 70)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv, fm, fs = (mode.from_tensor(t) for t in (q, k, v, bool_mask, summary))
        fake = torch.ops.transfuse.attention(fq, fk, fv, fm, fs, 0.25, False, True)
        fake_summary = torch.ops.transfuse.attention_mask_summary(mode.from_tensor(additive), 11, 70)
    assert fake.shape == real.shape == q.shape
    assert fake.stride() == real.stride() == torch.empty(2, 11, 4, 16).transpose(1, 2).stride()
    assert fake.dtype == real.dtype
    assert fake_summary.shape == real_summary.shape == (1, 1, -(-11 // SUMMARY_BLOCK_M), -(-70 // SUMMARY_BLOCK_N) + 1)
    assert fake_summary.dtype == real_summary.dtype == torch.int8


def test_output_reshapes_as_a_view(device):
    """The model's `out.transpose(1, 2).reshape(B, S, H * D)` after attention must not copy."""
    q, k, v, _, _ = _inputs(device)
    out = torch.ops.transfuse.attention(q, k, v, None, None, 0.25, False, True)
    flat = out.transpose(1, 2).reshape(2, 11, 4 * 16)
    assert flat.data_ptr() == out.data_ptr() and flat.is_contiguous()


def test_mask_summary_for_reuses_only_at_equal_key_length():
    from transfuse.ops.attention import mask_summary_for

    mask = torch.randn(2, 1, 3, 70) > 0
    first = torch.ops.transfuse.attention_mask_summary(mask, 3, 70)
    assert mask_summary_for(first, 70, mask, 3, 70) is first
    shorter = mask_summary_for(first, 70, mask[..., :40], 3, 40)
    assert torch.equal(shorter, torch.ops.transfuse.attention_mask_summary(mask[..., :40], 3, 40))
