"""LinearEpilogue under torch.autocast: F.linear's operands (fp32 parameters, an fp32 input) are
cast to the autocast dtype in front of transfuse.linear, as autocast casts them, so the GEMM and
its epilogue run in bf16 like eager's instead of silently in fp32."""

import math

import torch

import transfuse
from tests.helpers import optimize_and_run
from tests.passes.test_linear_pass import MLP


def _run_under_autocast(act):
    """(fp32 gold, eager bf16 autocast output, ours, our transfuse.linear nodes) of a two-linear MLP
    with activation `act`, after checking that both linears were rewritten."""
    model = MLP(act, residual=False).eval()
    x = torch.randn(3, 5, 24)
    with torch.no_grad():
        gold = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, rewrites, rejections = optimize_and_run(model, x)
    assert rewrites["LinearEpilogue"] == 2, rejections
    graph = model._transfuse_state.backend.graphs[0].graph
    linears = [n for n in graph.nodes if str(n.target).startswith("transfuse.linear")]
    assert out.dtype == eager.dtype == torch.bfloat16
    err_ours, err_eager = (out.float() - gold).abs().max().item(), (eager.float() - gold).abs().max().item()
    assert err_ours <= 2 * err_eager + 1e-2 * gold.abs().max().item(), (err_ours, err_eager)
    return linears


def test_autocast_linears_run_in_the_autocast_dtype():
    linears = _run_under_autocast(torch.nn.functional.gelu)
    assert [n.args[3] for n in linears] == ["gelu", "none"]
    for node in linears:
        operands = [a for a in node.args[:3] if a is not None]
        assert all(a.meta["example_value"].dtype == torch.bfloat16 for a in operands), node.format_node()


def _gelu_new_as_cuda_autocast_runs_it(h):
    """Hugging Face's NewGELUActivation as CUDA autocast evaluates it on a bf16 GEMM result: `pow`
    runs in fp32, so the sum, tanh and product promote and the activation ends in fp32. (CPU
    autocast leaves pow in bf16; the explicit .float() reproduces CUDA's promotion here.)"""
    cube = torch.pow(h.float(), 3.0)
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * cube)))


def test_fp32_activation_read_only_by_casting_linears_is_fused_and_written_narrow():
    linears = _run_under_autocast(_gelu_new_as_cuda_autocast_runs_it)
    assert [n.args[3] for n in linears] == ["gelu_tanh", "none"]
    # the epilogue writes bf16, the second GEMM reads it without a cast in between
    assert linears[0].meta["example_value"].dtype == torch.bfloat16
    assert linears[1].args[0] is linears[0]


class _ActivationAlsoReturned(torch.nn.Module):
    """The fp32 activation also leaves the graph: eager's fp32 values must stay fp32."""

    def __init__(self):
        super().__init__()
        self.fc, self.proj = torch.nn.Linear(24, 40), torch.nn.Linear(40, 24)

    def forward(self, x):
        h = _gelu_new_as_cuda_autocast_runs_it(self.fc(x))
        return self.proj(h), h


def test_fp32_activation_with_an_fp32_reader_is_left_alone():
    model = _ActivationAlsoReturned().eval()
    x = torch.randn(3, 5, 24)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        eager = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (out, h), rewrites, _ = optimize_and_run(model, x)
    graph = model._transfuse_state.backend.graphs[0].graph
    activations = [n.args[3] for n in graph.nodes if str(n.target).startswith("transfuse.linear")]
    assert "gelu_tanh" not in activations
    assert h.dtype == eager[1].dtype == torch.float32
    torch.testing.assert_close(h, eager[1], rtol=2e-2, atol=2e-2)  # the GEMM's own bf16 rounding differs


def test_fp32_activation_fused_in_training_gradients_within_eager_bf16_error():
    torch.manual_seed(0)
    model = MLP(_gelu_new_as_cuda_autocast_runs_it, residual=False).train()
    reference = MLP(_gelu_new_as_cuda_autocast_runs_it, residual=False).train()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(3, 5, 24)
    reference(x).square().sum().backward()  # fp32 gold
    gold = {k: p.grad.clone() for k, p in reference.named_parameters()}
    reference.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference(x).float().square().sum().backward()
    eager = {k: p.grad.clone() for k, p in reference.named_parameters()}
    transfuse.optimize(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().square().sum().backward()
    records = model._transfuse_state.backend.records
    assert sum(r.rewrites["LinearEpilogue"] for r in records) == 1  # the bare proj stays F.linear in training
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32
        err_ours = (p.grad - gold[name]).abs().max().item()
        err_eager = (eager[name] - gold[name]).abs().max().item()
        assert err_ours <= 2 * err_eager + 1e-3 * gold[name].abs().max().item(), (name, err_ours, err_eager)
