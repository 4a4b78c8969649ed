"""An RMSNorm and the linear reading it -> transfuse.rms_norm_linear: outputs equal to eager on
one row (the fused GEMV) and on several (the norm kernel, then the linear); a normalised row that is
also read elsewhere (a post-norm layer's residual: BERT, BART) comes out of the fused op as well;
a linear with a residual is left as it was. Also the op itself: opcheck, and the same result
whichever path it takes."""

import pytest
import torch

from tests.helpers import eager_then_optimized, rel_err
from transfuse.kernels import norm as norm_kernels
from transfuse.ops.gemm import linear_dispatch


class PreNormBlock(torch.nn.Module):
    """A Llama-style block written as Hugging Face writes it: add, RMSNorm (fp32 statistics, cast
    before the weight), then a QKV-like pair of linears on the normalised rows."""

    def __init__(self, n: int = 48, read_twice: bool = False):
        super().__init__()
        self.read_twice = read_twice
        self.w1 = torch.nn.Parameter(torch.rand(n) + 0.5)
        self.w2 = torch.nn.Parameter(torch.rand(n) + 0.5)
        self.up = torch.nn.Linear(n, 80, bias=False)
        self.gate = torch.nn.Linear(n, 80, bias=False)
        self.down = torch.nn.Linear(80, n, bias=False)

    @staticmethod
    def norm(x, w):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * h.to(x.dtype)

    def forward(self, x, residual):
        h = self.norm(x, self.w1)
        y = self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))
        s = residual + y
        h2 = self.norm(s, self.w2)
        out = self.up(h2)
        if self.read_twice:
            out = out + h2.sum(-1, keepdim=True)
        return out, s


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_linear_matches_eager(rows, dtype):
    torch.manual_seed(0)
    model = PreNormBlock().to(dtype)
    x, residual = torch.randn(1, rows, 48).to(dtype), torch.randn(1, rows, 48).to(dtype)
    ref, out, rewrites, _ = eager_then_optimized(model, x, residual)
    assert rewrites["RMSNormLinear"] == 2
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    for o, r in zip(out, ref):
        assert rel_err(o, r) < tol


def test_normalised_rows_read_elsewhere_are_returned_too():
    torch.manual_seed(0)
    model = PreNormBlock(read_twice=True)
    x, residual = torch.randn(1, 1, 48), torch.randn(1, 1, 48)
    ref, out, rewrites, _ = eager_then_optimized(model, x, residual)
    assert rewrites["RMSNormLinear"] == 2  # the second with store_normed: h2 is summed as well
    for o, r in zip(out, ref):
        assert rel_err(o, r) < 1e-5


class PostNormLayer(torch.nn.Module):
    """A BERT/BART-style post-norm layer: h = LayerNorm(x + attn_out(x)); then the feed-forward reads
    h, and h is its residual; the second LayerNorm feeds a linear and is returned as well."""

    def __init__(self, n: int = 40, ffn: int = 72):
        super().__init__()
        self.attn_out = torch.nn.Linear(n, n)
        self.ln1 = torch.nn.LayerNorm(n)
        self.fc1 = torch.nn.Linear(n, ffn)
        self.fc2 = torch.nn.Linear(ffn, n)
        self.ln2 = torch.nn.LayerNorm(n)
        self.next_qkv = torch.nn.Linear(n, 3 * n)
        for norm in (self.ln1, self.ln2):  # not the identity: a wrong weight or bias shows
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
            torch.nn.init.uniform_(norm.bias, -0.5, 0.5)

    def forward(self, x):
        h = self.ln1(x + self.attn_out(x))
        h = self.ln2(h + self.fc2(torch.nn.functional.gelu(self.fc1(h))))
        return self.next_qkv(h), h


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_post_norm_layer(rows, dtype):
    """1-2 rows: each LayerNorm in its linear's GEMV, which also stores the normalised rows; 5 rows:
    the norm kernel, then the linear."""
    torch.manual_seed(0)
    model = PostNormLayer().to(dtype)
    x = torch.randn(1, rows, 40).to(dtype)
    ref, out, rewrites, _ = eager_then_optimized(model, x)
    assert rewrites["LayerNormLinear"] == 2
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    for o, r in zip(out, ref):
        assert rel_err(o, r) < tol
    # both norms' rows are read again (store_normed) and neither sum is (store_sum=False): the
    # unfused path must not write a residual sum nobody reads
    fused = [n for gm in model._transfuse_state.backend.graphs for n in gm.graph.nodes
             if n.target is torch.ops.transfuse.layer_norm_linear.default]
    assert [n.args[8:] for n in fused] == [(True, False)] * 2


def _op_args(rows, residual=True):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 40, generator=g).half()
    r = torch.randn(rows, 40, generator=g).half() if residual else None
    w = (torch.rand(40, generator=g) + 0.5).half()
    W = (torch.randn(24, 40, generator=g) / 7).half()
    return x, r, w, 1e-6, 0.0, True, W, None, "none"


@pytest.mark.parametrize("residual", [True, False])
def test_op_opcheck(residual):
    torch.library.opcheck(torch.ops.transfuse.rms_norm_linear.default, _op_args(1, residual))


@pytest.mark.parametrize("rows", [2, 3])
def test_op_opcheck_store_normed(rows):
    """store_normed with the sum unread (store_sum=False, a post-norm layer), on the fused GEMV (2
    rows) and on the two kernels (3 rows)."""
    torch.library.opcheck(torch.ops.transfuse.layer_norm_linear.default,
                          (*_layer_op_args(rows), True, False))
    out, summed, normed = torch.ops.transfuse.layer_norm_linear(*_layer_op_args(rows), True, False)
    assert summed.numel() == 0 and normed.shape == (rows, 40)


def _layer_op_args(rows):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(rows, 40, generator=g) + 2).half()
    r = torch.randn(rows, 40, generator=g).half()
    w, b = (torch.rand(40, generator=g) + 0.5).half(), torch.randn(40, generator=g).half()
    W = (torch.randn(24, 40, generator=g) / 7).half()
    return x, r, w, b, 1e-5, W, None, "none"


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("store_normed", [False, True])
def test_op_paths_agree(rows, store_normed):
    """1-2 rows run the fused GEMV, 3 the two kernels: both feed the linear the same rounded rows,
    and return them when asked to."""
    x, r, w, eps, offset, cast, W, b, act = _op_args(rows)
    out, summed, normed_out = torch.ops.transfuse.rms_norm_linear(x, r, w, eps, offset, cast, W, b, act, store_normed)
    normed, ref_sum = norm_kernels.add_rms_norm_fwd(x, r, w, eps, offset, cast, True)
    torch.testing.assert_close(out, linear_dispatch(normed, W, b, act, None), atol=2e-3, rtol=2e-3)
    assert torch.equal(summed, ref_sum)
    if store_normed:
        torch.testing.assert_close(normed_out, normed, atol=0, rtol=2e-3)
    else:
        assert normed_out.numel() == 0


@pytest.mark.parametrize("rows", [1, 3])
def test_layer_op_paths_agree_store_normed(rows):
    x, r, w, b, eps, W, bias, act = _layer_op_args(rows)
    out, summed, normed_out = torch.ops.transfuse.layer_norm_linear(x, r, w, b, eps, W, bias, act, True)
    normed, ref_sum = norm_kernels.add_layer_norm_fwd(x, r, w, b, eps, True)
    torch.testing.assert_close(normed_out, normed, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out, linear_dispatch(normed, W, bias, act, None), atol=2e-3, rtol=2e-3)
    assert torch.equal(summed, ref_sum)
