"""`a += b` on a temporary becomes `a + b` (so that `scores += bias` attention matches); an in-place
update anyone could observe is left alone."""

import torch

from tests.helpers import eager_then_optimized, optimize_and_run, rel_err


class BiasedScores(torch.nn.Module):
    """MPNet's form: scores = q @ k^T / sqrt(d); scores += position_bias; softmax; @ v."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.bias = torch.nn.Parameter(torch.randn(1, 4, 1, 1))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / 8**0.5
        scores += self.bias * torch.arange(t, dtype=x.dtype)[None, None, None, :]
        return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, 32)


class Observed(torch.nn.Module):
    """In-place updates whose effect is visible: on the input itself, and on a temporary read twice."""

    def forward(self, x):
        y = x * 2
        z = y + 0  # a second reader of y before the in-place update
        y += 1
        x.add_(0)  # the caller's tensor: never rewritten
        return y + z


def test_scores_plus_bias_becomes_attention():
    torch.manual_seed(0)
    model = BiasedScores().eval()
    x = torch.randn(2, 7, 32)
    ref, out, rewrites, _ = eager_then_optimized(model, x)
    assert rewrites["InplaceArithmetic"] == 1 and rewrites["ManualAttention"] == 1
    assert rel_err(out, ref) < 1e-5


def test_observable_updates_left_alone():
    model = Observed().eval()
    x = torch.randn(3, 5)
    with torch.no_grad():
        ref = model(x.clone())
    out, rewrites, _ = optimize_and_run(model, x.clone())
    assert rewrites["InplaceArithmetic"] == 0
    assert torch.equal(out, ref)
