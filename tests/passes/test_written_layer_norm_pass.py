"""Layer norm written out by hand -> transfuse.layer_norm / add_layer_norm, outputs equal to eager;
look-alikes are left alone."""

import pytest
import torch

from tests.helpers import eager_then_optimized, rel_err


class Written(torch.nn.Module):
    def __init__(self, style: str, n: int = 48, eps: float = 1e-7):
        super().__init__()
        self.style, self.eps = style, eps
        self.weight = torch.nn.Parameter(torch.randn(n) * 0.3 + 1)
        self.bias = torch.nn.Parameter(torch.randn(n) * 0.1)
        self.proj = torch.nn.Linear(n, n)

    def norm(self, x):
        s = self.style
        if s == "deberta":  # DebertaLayerNorm: fp32 statistics, cast, then scale and shift
            h = x.float()
            mean = h.mean(-1, keepdim=True)
            variance = (h - mean).pow(2).mean(-1, keepdim=True)
            h = (h - mean) / torch.sqrt(variance + self.eps)
            return self.weight * h.to(x.dtype) + self.bias
        if s == "rsqrt_var":  # torch.var, rsqrt, shift before... no: scale then shift
            mean = x.mean(dim=-1, keepdim=True)
            var = x.var(dim=-1, keepdim=True, unbiased=False)
            return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias
        if s == "no_affine":
            u = x.mean(-1, keepdim=True)
            return (x - u) / torch.sqrt(((x - u) * (x - u)).mean(-1, keepdim=True) + self.eps)
        if s == "unbiased_var":  # not layer norm: Bessel-corrected variance
            mean = x.mean(dim=-1, keepdim=True)
            return (x - mean) / torch.sqrt(x.var(dim=-1, keepdim=True) + self.eps) * self.weight
        if s == "rows":  # statistics over dim 1: not a per-row norm
            u = x.mean(1, keepdim=True)
            return (x - u) / torch.sqrt((x - u).pow(2).mean(1, keepdim=True) + self.eps)
        raise ValueError(s)

    def forward(self, x):
        y = self.norm(x)
        r = x + self.proj(y)
        return self.norm(r) + r


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("style", ["deberta", "rsqrt_var", "no_affine"])
def test_written_layer_norm(style, dtype):
    torch.manual_seed(0)
    model = Written(style).eval().to(dtype)
    x = (torch.randn(2, 5, 48) * 2 + 0.5).to(dtype)
    ref, out, rewrites, _ = eager_then_optimized(model, x)
    assert rewrites["WrittenLayerNorm"] == 1 and rewrites["ResidualWrittenLayerNorm"] == 1
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 3e-3)


@pytest.mark.parametrize("style", ["unbiased_var", "rows"])
def test_look_alikes_left_alone(style):
    torch.manual_seed(0)
    model = Written(style).eval()
    x = torch.randn(2, 5, 48)
    ref, out, rewrites, _ = eager_then_optimized(model, x)
    assert rewrites["WrittenLayerNorm"] == 0 and rewrites["ResidualWrittenLayerNorm"] == 0
    assert rel_err(out, ref) < 1e-5
