"""Norm kernels at real sizes on a GPU, against an fp32 reference with a tolerance relative to
PyTorch's own error in the same dtype. Run: PYTHONPATH=src python3 -m pytest -q -m gpu tests/kernels/test_norm_gpu.py"""

import pytest
import torch
import torch.nn.functional as F

from transfuse.kernels.norm import MAX_N, add_layer_norm_fwd, add_rms_norm_fwd, layer_norm_fwd, rms_norm_fwd
from transfuse.reference.norm import layer_norm_ref, rms_norm_ref

pytestmark = pytest.mark.gpu

# (rows, hidden): BERT-base/large at 128 x 128 tokens, Llama-class widths, decode-time single rows
SIZES = [
    (16384, 768),
    (16384, 1024),
    (8192, 2048),
    (16384, 4096),
    (4096, 5120),
    (1, 4096),
    (3, 8192),
    (37, 12288),
]
DTYPES = [(torch.float16, 1e-3), (torch.bfloat16, 1e-2)]


def _randn(shape, dtype, scale=1.0, shift=0.0):
    return (scale * torch.randn(shape, device="cuda") + shift).to(dtype)


def _check(ours, torch_same, gold, atol):
    """Within twice torch's own error to the fp32 reference, and equal to torch's result in the
    same dtype except where a rounding flips on the last bit of the statistics."""
    assert ours.shape == gold.shape and ours.dtype == torch_same.dtype and ours.is_contiguous()
    err_ours = (ours.float() - gold).abs().max().item()
    err_torch = (torch_same.float() - gold).abs().max().item()
    assert err_ours <= 2 * err_torch + atol, f"err {err_ours:.3g} vs torch {err_torch:.3g}"
    rel_ours = ((ours.float() - gold).norm() / gold.norm()).item()
    rel_torch = ((torch_same.float() - gold).norm() / gold.norm()).item()
    assert rel_ours <= 2 * rel_torch + 1e-6, f"relative err {rel_ours:.3g} vs torch {rel_torch:.3g}"
    mismatched = (ours != torch_same).sum().item()
    assert mismatched <= max(0.01 * ours.numel(), 2), f"{mismatched} of {ours.numel()} differ from torch"


@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("rows,n", SIZES)
def test_layer_norm(rows, n, dtype, atol):
    x = _randn((rows, n), dtype, scale=2.0, shift=0.5)
    weight, bias = _randn((n,), dtype), _randn((n,), dtype)
    out = layer_norm_fwd(x, weight, bias, 1e-12)  # BERT's eps
    gold = layer_norm_ref(x.float(), weight.float(), bias.float(), 1e-12)
    _check(out, F.layer_norm(x, (n,), weight, bias, 1e-12), gold, atol)


@pytest.mark.parametrize("store_sum", [False, True])
@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("rows,n", SIZES)
def test_add_layer_norm(rows, n, dtype, atol, store_sum):
    x, residual = _randn((rows, n), dtype), _randn((rows, n), dtype, scale=3.0)
    weight, bias = _randn((n,), dtype), _randn((n,), dtype)
    out, s = add_layer_norm_fwd(x, residual, weight, bias, 1e-5, store_sum)
    eager_sum = x + residual
    if store_sum:
        assert torch.equal(s, eager_sum)  # rounded as eager rounds, bf16 included
    else:
        assert s.shape == (0,)
    gold = layer_norm_ref(x.float() + residual.float(), weight.float(), bias.float(), 1e-5)
    _check(out, F.layer_norm(eager_sum, (n,), weight, bias, 1e-5), gold, atol)


@pytest.mark.parametrize("flavour", ["llama", "gemma", "torch"])
@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("rows,n", SIZES)
def test_rms_norm(rows, n, dtype, atol, flavour):
    x = _randn((rows, n), dtype, scale=4.0)
    if flavour == "llama":
        weight, offset, cast_before_weight = _randn((n,), dtype), 0.0, True
    elif flavour == "gemma":
        weight, offset, cast_before_weight = _randn((n,), dtype, scale=0.1), 1.0, False
    else:  # F.rms_norm with an fp32 weight
        weight, offset, cast_before_weight = torch.randn(n, device="cuda"), 0.0, False
    out = rms_norm_fwd(x, weight, 1e-6, offset, cast_before_weight)
    gold = rms_norm_ref(x.float(), weight.float(), 1e-6, offset, cast_before_weight)
    if flavour == "torch":
        torch_same = F.rms_norm(x, (n,), weight, 1e-6)
    else:
        torch_same = rms_norm_ref(x, weight, 1e-6, offset, cast_before_weight)  # the HF module's ops, eager on GPU
    _check(out, torch_same, gold, atol)


@pytest.mark.parametrize("store_sum", [False, True])
@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("rows,n", SIZES)
def test_add_rms_norm(rows, n, dtype, atol, store_sum):
    x, residual = _randn((rows, n), dtype), _randn((rows, n), dtype, scale=3.0)
    weight = _randn((n,), dtype)
    out, s = add_rms_norm_fwd(x, residual, weight, 1e-5, 0.0, True, store_sum)
    eager_sum = x + residual
    if store_sum:
        assert torch.equal(s, eager_sum)
    gold = rms_norm_ref(x.float() + residual.float(), weight.float(), 1e-5, 0.0, True)
    _check(out, rms_norm_ref(eager_sum, weight, 1e-5, 0.0, True), gold, atol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_three_dim_strided_input(dtype):
    # (batch, seq, hidden) seen through a transpose of a (seq, batch, hidden) buffer
    x = _randn((512, 8, 768), dtype).transpose(0, 1)
    residual = _randn((8, 512, 768), dtype)
    weight, bias = _randn((768,), dtype), _randn((768,), dtype)
    out, s = add_layer_norm_fwd(x, residual, weight, bias, 1e-12, True)
    assert torch.equal(s, x + residual)
    ref_out, _ = add_layer_norm_fwd(x.contiguous(), residual, weight, bias, 1e-12, True)
    torch.testing.assert_close(out, ref_out)


def test_offsets_past_2_to_31_elements():
    # 32771 rows of 65536: the last rows start beyond 2**31 elements, so a 32-bit row offset wraps
    rows, n = 2**31 // MAX_N + 3, MAX_N
    x = torch.randn(rows, n, device="cuda", dtype=torch.float16)
    weight = torch.randn(n, device="cuda", dtype=torch.float16)
    out = rms_norm_fwd(x, weight, 1e-6, 0.0, True)
    # A wrapped offset reads another row: errors of order 1. One fp16 rounding step (seen on an H100:
    # 4 of 196,608 elements one ulp apart from the reference) is fine.
    for part in (slice(0, 2), slice(rows - 3, rows)):
        torch.testing.assert_close(out[part], rms_norm_ref(x[part], weight, 1e-6, 0.0, True), rtol=2e-3, atol=2e-3)
    del out
    out, s = add_layer_norm_fwd(x, x, weight, None, 1e-5, True)
    for part in (slice(0, 2), slice(rows - 3, rows)):
        torch.testing.assert_close(out[part], layer_norm_ref(x[part] + x[part], weight, None, 1e-5),
                                   rtol=2e-3, atol=2e-3)
        assert torch.equal(s[part], x[part] + x[part])


def test_under_cuda_graph_capture():
    x, residual = _randn((4096, 4096), torch.bfloat16), _randn((4096, 4096), torch.bfloat16)
    weight = _randn((4096,), torch.bfloat16)
    add_rms_norm_fwd(x, residual, weight, 1e-6, 0.0, True, True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, s = add_rms_norm_fwd(x, residual, weight, 1e-6, 0.0, True, True)
    x.copy_(_randn((4096, 4096), torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(s, x + residual)
    torch.testing.assert_close(out, rms_norm_ref(x + residual, weight, 1e-6, 0.0, True))
