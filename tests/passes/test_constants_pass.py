"""Literal tensors in a graph become constants made once (CUDA graph capture refuses the host copy
that `torch.tensor(0.0, device=cuda)` makes on every run)."""

import torch
import torch.fx as fx

from tests.helpers import optimize_and_run
from tests.models.registry import REGISTRY
from transfuse.passes.constants import hoist_literal_tensors


def _graph(requires_grad: bool = False) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    positive = graph.call_function(torch.gt, (x, 0))
    kwargs = {"dtype": torch.float32, **({"requires_grad": True} if requires_grad else {})}
    zero = graph.call_function(torch.tensor, (0.5,), kwargs)
    graph.output(graph.call_function(torch.where, (positive, zero, x)))
    return fx.GraphModule(torch.nn.Module(), graph)


def _literal_calls(gm: fx.GraphModule) -> int:
    return sum(n.op == "call_function" and n.target is torch.tensor for n in gm.graph.nodes)


def test_literal_becomes_a_buffer_with_the_same_value():
    gm = _graph()
    x = torch.randn(7)
    ref = gm(x)
    assert hoist_literal_tensors(gm) == 1
    gm.recompile()
    assert _literal_calls(gm) == 0
    assert torch.equal(gm(x), ref)
    assert [name for name, _ in gm.named_buffers()] == ["_transfuse_literal_0"]


def test_tensor_that_wants_gradients_stays_a_call():
    gm = _graph(requires_grad=True)
    assert hoist_literal_tensors(gm) == 0 and _literal_calls(gm) == 1


def test_eager_bert_mask_leaves_no_literal_in_the_graph():
    # transformers' eager mask: torch.where(mask, torch.tensor(0.0, device=...), finfo.min)
    model = REGISTRY[0].build("eager")
    ids = torch.randint(3, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    optimize_and_run(model, input_ids=ids, attention_mask=mask)
    graphs = model._transfuse_state.backend.graphs
    assert graphs and all(_literal_calls(gm) == 0 for gm in graphs)
