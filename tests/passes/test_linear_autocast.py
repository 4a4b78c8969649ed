"""LinearEpilogue under torch.autocast: F.linear's operands (fp32 parameters, an fp32 input) are
cast to the autocast dtype in front of transfuse.linear, as autocast casts them, so the GEMM and
its epilogue run in bf16 like eager's instead of silently in fp32."""

import torch

from tests.helpers import optimize_and_run
from tests.passes.test_linear_pass import MLP


def test_autocast_linears_run_in_the_autocast_dtype():
    model = MLP(torch.nn.functional.gelu, residual=False).eval()
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
    assert [n.args[3] for n in linears] == ["gelu", "none"]
    for node in linears:
        operands = [a for a in node.args[:3] if a is not None]
        assert all(a.meta["example_value"].dtype == torch.bfloat16 for a in operands), node.format_node()
    assert out.dtype == eager.dtype == torch.bfloat16
    err_ours, err_eager = (out.float() - gold).abs().max().item(), (eager.float() - gold).abs().max().item()
    assert err_ours <= 2 * err_eager + 1e-2 * gold.abs().max().item(), (err_ours, err_eager)
