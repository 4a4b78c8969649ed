"""Embedding lookups summed into a LayerNorm (transfuse.kernels.embedding, torch.ops.transfuse.
embedding_layer_norm) against the plain-PyTorch reference. Tiny shapes: on CPU the kernel runs in
Triton's interpreter."""

import pytest
import torch
import torch.nn.functional as F

import transfuse.ops.embedding  # noqa: F401  (registers the op)
from tests.kernels.norm_cases import default_device  # noqa: F401  (default_device: autouse fixture)
from transfuse.kernels.embedding import embedding_layer_norm_fwd
from transfuse.reference.embedding import embedding_layer_norm_ref

B, S = 2, 5
VOCABS = (37, 2, 23)  # words, token types, positions


def _lookups(n, hidden, dtype, index_dtype=torch.int64, shapes=((B, S), (B, S), (1, S))):
    """BERT's three lookups, the first n of them: ids (B, S), token types as an expanded (1, S)
    buffer (stride 0 along the batch), positions (1, S) broadcast against the ids."""
    indices = [
        torch.randint(0, VOCABS[0], shapes[0]),
        torch.randint(0, VOCABS[1], (1, shapes[1][-1])).expand(shapes[1]),
        torch.arange(shapes[2][-1]).expand(shapes[2]),
    ][:n]
    tables = [torch.randn(v, hidden).to(dtype) for v in VOCABS[:n]]
    return [i.to(index_dtype) for i in indices], tables


def _affine(hidden, dtype, has_weight, has_bias):
    weight = (torch.randn(hidden) * 0.5 + 1).to(dtype) if has_weight else None
    bias = torch.randn(hidden).to(dtype) if has_bias else None
    return weight, bias


def _assert_equal_to_reference(out, ref):
    """fp32: the same up to another summation order of the statistics. fp16/bf16: every element
    within one ulp of the reference, and bit for bit almost everywhere (only where the statistics
    differ in their last fp32 bit can a rounding flip)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.is_contiguous()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    ulp = (torch.nextafter(ref, torch.full_like(ref, float("inf"))) - ref).float().abs()
    assert ((out.float() - ref.float()).abs() <= ulp).all()
    mismatched = (out != ref).sum().item()
    assert mismatched <= max(0.01 * out.numel(), 2), f"{mismatched} of {out.numel()} differ from the reference"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,hidden,has_weight,has_bias", [
    (1, 64, True, True), (2, 100, False, True), (3, 80, True, False), (3, 768, True, True),
])
def test_matches_reference(n, hidden, has_weight, has_bias, dtype):
    indices, tables = _lookups(n, hidden, dtype)
    weight, bias = _affine(hidden, dtype, has_weight, has_bias)
    out = embedding_layer_norm_fwd(indices, tables, weight, bias, 1e-5)
    assert out.shape == (B, S, hidden)
    _assert_equal_to_reference(out, embedding_layer_norm_ref(indices, tables, weight, bias, 1e-5))


def test_reference_is_eager_bert_embeddings():
    """The reference is what BertEmbeddings computes: lookups added left to right, F.layer_norm."""
    indices, tables = _lookups(3, 48, torch.float32)
    weight, bias = _affine(48, torch.float32, True, True)
    eager = F.layer_norm(sum(F.embedding(i, t) for i, t in zip(indices, tables)), (48,), weight, bias, 1e-12)
    torch.testing.assert_close(embedding_layer_norm_ref(indices, tables, weight, bias, 1e-12), eager)


@pytest.mark.parametrize("shapes", [
    ((B, S), (1, S), (S,)),            # ids, a (1, S) buffer, 1-D positions
    ((2, 2, S), (1, 1, S), (2, 1, S)),  # three leading dims: the index grid is reshaped
])
def test_int32_indices_and_broadcast_shapes(shapes):
    indices, tables = _lookups(3, 40, torch.float16, torch.int32, shapes=shapes)
    weight, bias = _affine(40, torch.float32, True, True)  # fp32 affine on fp16 tables, as F.layer_norm allows
    out = embedding_layer_norm_fwd(indices, tables, weight, bias, 1e-5)
    assert out.shape == (*torch.broadcast_shapes(*shapes), 40)
    _assert_equal_to_reference(out, embedding_layer_norm_ref(indices, tables, weight, bias, 1e-5))


def test_out_of_range_index_gives_nan_row():
    indices, tables = _lookups(3, 24, torch.float32)
    indices[0] = indices[0].clone()
    indices[0][0, 1] = VOCABS[0]  # one past the end
    indices[0][1, 3] = -1
    out = embedding_layer_norm_fwd(indices, tables, None, None, 1e-5)
    bad = torch.zeros(B, S, dtype=torch.bool)
    bad[0, 1] = bad[1, 3] = True
    assert out[bad].isnan().all() and not out[~bad].isnan().any()
    indices[0] = indices[0].clamp(0, VOCABS[0] - 1)
    _assert_equal_to_reference(out[~bad], embedding_layer_norm_ref(indices, tables, None, None, 1e-5)[~bad])


def test_rejects_mixed_tables():
    indices, tables = _lookups(2, 16, torch.float16)
    with pytest.raises(ValueError, match="one dtype"):
        embedding_layer_norm_fwd(indices, [tables[0], tables[1].float()], None, None, 1e-5)
    with pytest.raises(ValueError, match="1 to 4 lookups"):
        embedding_layer_norm_fwd(indices * 3, tables * 3, None, None, 1e-5)


def test_schema():
    assert str(torch.ops.transfuse.embedding_layer_norm.default._schema) == (
        "transfuse::embedding_layer_norm(Tensor[] indices, Tensor[] tables, Tensor? weight, Tensor? bias, "
        "float eps) -> Tensor")


@pytest.mark.parametrize("dtype,index_dtype,affine", [
    (torch.float32, torch.int64, True), (torch.float16, torch.int32, False),
])
def test_opcheck(dtype, index_dtype, affine):
    indices, tables = _lookups(3, 32, dtype, index_dtype)
    weight, bias = _affine(32, dtype, affine, affine)
    args = (indices, tables, weight, bias, 1e-5)
    torch.library.opcheck(torch.ops.transfuse.embedding_layer_norm.default, args)
    torch.testing.assert_close(torch.ops.transfuse.embedding_layer_norm(*args), embedding_layer_norm_ref(*args))
