"""transfuse.report(model): what it counts on graphs written in unusual ways."""

import torch

import transfuse


def test_linear_with_keyword_operands_is_optimized_and_counted():
    # I-BERT's modules call F.linear(x, weight=..., bias=...): the report's FLOP count read the
    # weight positionally and optimize() raised IndexError at the first call.
    class KeywordLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 24)

        def forward(self, x):
            return torch.nn.functional.linear(x, weight=self.proj.weight, bias=self.proj.bias).relu()

    torch.manual_seed(0)
    model = KeywordLinear().eval()
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        want = model(x)
        transfuse.optimize(model)
        got = model(x)
    assert torch.allclose(got, want, atol=1e-5)
    assert "matmul/attention FLOPs in transfuse kernels: 100.0%" in transfuse.report(model), transfuse.report(model)
