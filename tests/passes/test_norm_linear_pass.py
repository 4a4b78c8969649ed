"""An RMSNorm and the one linear reading it -> transfuse.rms_norm_linear: outputs equal to eager on
one row (the fused GEMV) and on several (the norm kernel, then the linear); a normalised row that is
also read elsewhere, or a linear with a residual, is left as it was. Also the op itself: opcheck,
and the same result whichever path it takes."""

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


def test_normalised_rows_read_elsewhere_stay_unfused():
    torch.manual_seed(0)
    model = PreNormBlock(read_twice=True)
    x, residual = torch.randn(1, 1, 48), torch.randn(1, 1, 48)
    ref, out, rewrites, _ = eager_then_optimized(model, x, residual)
    assert rewrites["RMSNormLinear"] == 1  # the first norm only
    for o, r in zip(out, ref):
        assert rel_err(o, r) < 1e-5


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


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_op_paths_agree(rows):
    """1-2 rows run the fused GEMV, 3 the two kernels: both feed the linear the same rounded rows."""
    x, r, w, eps, offset, cast, W, b, act = _op_args(rows)
    out, summed = torch.ops.transfuse.rms_norm_linear(x, r, w, eps, offset, cast, W, b, act)
    normed, ref_sum = norm_kernels.add_rms_norm_fwd(x, r, w, eps, offset, cast, True)
    torch.testing.assert_close(out, linear_dispatch(normed, W, b, act, None), atol=2e-3, rtol=2e-3)
    assert torch.equal(summed, ref_sum)
