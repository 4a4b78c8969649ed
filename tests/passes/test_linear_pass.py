"""GEMM epilogues: activations recognised by meaning (probing), residual adds fused, and chains
that are no known activation left as they were."""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import eager_then_optimized, rel_err


def gelu_new(x):  # Hugging Face NewGELUActivation, written out
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTS = {
    "gelu": (F.gelu, "gelu"),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), "gelu_tanh"),
    "gelu_new": (gelu_new, "gelu_tanh"),
    "relu": (torch.relu, "relu"),
    "tanh": (torch.tanh, "tanh"),
    "silu": (F.silu, "silu"),
    "x_sigmoid_x": (lambda x: x * torch.sigmoid(x), "silu"),
    "not_an_activation": (lambda x: x * 2.0 + 1.0, None),
    "quick_gelu": (lambda x: x * torch.sigmoid(1.702 * x), None),
}


class MLP(torch.nn.Module):
    def __init__(self, act, residual: bool):
        super().__init__()
        self.fc = torch.nn.Linear(24, 40)
        self.act, self.residual = act, residual
        self.proj = torch.nn.Linear(40, 24)

    def forward(self, x):
        h = self.act(self.fc(x))
        y = self.proj(h)
        return y + x if self.residual else y


@pytest.mark.parametrize("name", list(ACTS))
def test_activation_by_meaning(name):
    fn, expected = ACTS[name]
    model = MLP(fn, residual=True).eval()
    x = torch.randn(3, 5, 24)
    ref, out, rewrites, _ = eager_then_optimized(model, x)
    gm_code = "\n".join(r.rewrites.__repr__() for r in model._transfuse_state.backend.records)
    assert rewrites["LinearEpilogue"] == 2, gm_code
    assert rel_err(out, ref) < 1e-5
    graph = model._transfuse_state.backend.graphs[0]
    activations = [n.args[3] for n in graph.graph.nodes if str(n.target).startswith("transfuse.linear")]
    assert activations[0] == (expected or "none")
    # The second GEMM takes the residual in its epilogue.
    residuals = [n.args[4] for n in graph.graph.nodes if str(n.target).startswith("transfuse.linear")]
    assert residuals[0] is None and residuals[1] is not None


class Conv1DMLP(torch.nn.Module):
    """GPT-2's MLP as its Conv1D writes it: addmm on flattened rows, viewed back to (batch, seq, N)
    before the activation and the residual add."""

    def __init__(self, act):
        super().__init__()
        self.act = act
        self.w_fc, self.b_fc = torch.nn.Parameter(torch.randn(24, 40) / 5), torch.nn.Parameter(torch.randn(40))
        self.w_proj, self.b_proj = torch.nn.Parameter(torch.randn(40, 24) / 6), torch.nn.Parameter(torch.randn(24))

    @staticmethod
    def conv1d(x, w, b):
        out = torch.addmm(b, x.view(-1, x.size(-1)), w)
        return out.view(x.size()[:-1] + (w.size(-1),))

    def forward(self, x):
        h = self.act(self.conv1d(x, self.w_fc, self.b_fc))
        return x + self.conv1d(h, self.w_proj, self.b_proj)


@pytest.mark.parametrize("name", ["gelu_new", "relu", "not_an_activation"])
def test_activation_and_residual_after_the_row_view(name):
    fn, expected = ACTS[name]
    model = Conv1DMLP(fn).eval()
    x = torch.randn(3, 5, 24)
    ref, out, rewrites, _ = eager_then_optimized(model, x)
    assert rel_err(out, ref) < 1e-5
    graph = model._transfuse_state.backend.graphs[0].graph
    linears = [n for n in graph.nodes if str(n.target).startswith("transfuse.linear")]
    assert [n.args[3] for n in linears] == [expected or "none", "none"]
    assert linears[1].args[4] is not None  # the residual, reshaped to the linear's rows
    leftover = [n for n in graph.nodes if n.op == "call_function" and "tanh" in str(n.target)]
    assert not leftover or expected is None
