"""Embedding lookups summed into a layer norm -> transfuse.embedding_layer_norm, with outputs equal to
eager; look-alikes are left alone with a reason. (The BERT-family models themselves are in
tests/models/test_encoders.py.)"""

import pytest
import torch

from tests.helpers import eager_then_optimized, rel_err

PATTERN = "EmbeddingLayerNorm"


class Embeddings(torch.nn.Module):
    """BertEmbeddings reduced to its arithmetic, and the variations that must not match."""

    def __init__(self, style: str, hidden: int = 40):
        super().__init__()
        self.style = style
        self.words = torch.nn.Embedding(31, hidden, padding_idx=0, max_norm=1.0 if style == "max_norm" else None)
        self.types = torch.nn.Embedding(2, hidden)
        self.positions = torch.nn.Embedding(16, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        if style == "mixed_dtypes":
            self.types.half()  # words + types promotes to fp32

    def forward(self, ids):
        positions = torch.arange(ids.shape[1])[None]            # (1, S): broadcast against ids
        types = torch.zeros_like(ids)
        if self.style == "positions_first":                     # pos + (words + types): still a chain
            return self.norm(self.positions(positions) + (self.words(ids) + self.types(types)))
        if self.style == "two_sums":                            # (w + t) + (p + p): not a chain
            p = self.positions(positions)
            return self.norm((self.words(ids) + self.types(types)) + (p + self.positions(positions)))
        if self.style == "scaled":                              # an addend that is not a lookup
            return self.norm(self.words(ids) * 2.0 + self.positions(positions))
        s = self.words(ids) + self.types(types) + self.positions(positions)
        if self.style == "sum_returned":                        # the sum is read elsewhere
            return self.norm(s), s
        return self.norm(s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("style", ["bert", "positions_first"])
def test_matches(style, dtype):
    model = Embeddings(style).eval().to(dtype)
    ids = torch.randint(0, 31, (2, 7))
    ref, out, rewrites, rejections = eager_then_optimized(model, ids)
    assert rewrites[PATTERN] == 1, rejections
    assert out.dtype == ref.dtype
    if dtype == torch.float32:
        assert rel_err(out, ref) < 1e-6
    else:  # the same roundings as eager: a last-bit flip at most where the statistics differ
        torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("style,reason", [
    ("max_norm", "max_norm"),
    ("two_sums", "two sums"),
    ("scaled", "not an embedding"),
    ("sum_returned", "read elsewhere"),
    ("mixed_dtypes", "mixed dtypes"),  # an fp16 table promoted to fp32 by the add
])
def test_look_alikes_left_alone(style, reason):
    model = Embeddings(style).eval()
    ids = torch.randint(1, 31, (2, 7))
    ref, out, rewrites, rejections = eager_then_optimized(model, ids)
    assert rewrites[PATTERN] == 0
    assert any(r.pattern == PATTERN and reason in r.reason for r in rejections), rejections
    for got, want in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
        assert rel_err(got, want) < 1e-6
