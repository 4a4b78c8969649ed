"""SiblingLinears: linears that read one input become one GEMM whose output columns the users read
as slices; users that depend on the unmerged output's layout keep the linears apart, with a reason."""

import torch

from tests.helpers import eager_then_optimized, rel_err


class QKV(torch.nn.Module):
    """Three projections of one (transposed) input, each viewed into heads; `chunked` reads the
    query through as_strided with overlapping windows, the way Longformer/LED chunk their keys and
    queries (the strides come from the tensor at trace time)."""

    def __init__(self, chunked: bool, d: int = 16, heads: int = 2):
        super().__init__()
        self.chunked, self.heads = chunked, heads
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))

    def forward(self, x):  # x: (B, S, d)
        x = x.transpose(0, 1)  # (S, B, d), as LED's encoder attention
        s, b, d = x.shape
        q, k, v = (p(x).view(s, b, self.heads, d // self.heads).transpose(0, 1) for p in (self.q, self.k, self.v))
        q = q.transpose(1, 2).reshape(b * self.heads, s, d // self.heads)  # a view, no copy
        if self.chunked:
            w = 2
            q = q.view(q.size(0), s // (2 * w), 2 * w, q.size(2))
            size, stride = list(q.size()), list(q.stride())
            size[1], stride[1] = size[1] * 2 - 1, stride[1] // 2
            q = q.as_strided(size=size, stride=stride).sum(2).flatten(1)
        return q.sum(-1, keepdim=True) * k.sum() + v.mean()


def test_siblings_merged():
    torch.manual_seed(0)
    ref, out, rewrites, _ = eager_then_optimized(QKV(chunked=False).eval(), torch.randn(2, 8, 16))
    assert rewrites["SiblingLinears"] == 1
    assert rel_err(out, ref) < 1e-5


def test_strided_reader_keeps_linears_apart():
    torch.manual_seed(0)
    ref, out, rewrites, rejections = eager_then_optimized(QKV(chunked=True).eval(), torch.randn(2, 8, 16))
    assert rewrites["SiblingLinears"] == 0
    assert any(r.pattern == "SiblingLinears" and "reads the strides" in r.reason for r in rejections), rejections
    assert rel_err(out, ref) < 1e-5
