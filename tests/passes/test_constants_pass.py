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


class HeadPicker(torch.nn.Module):
    """Falcon's key/value heads: `qkv[..., [-2]]` indexes with a Python list (a host tensor each call)."""

    def forward(self, qkv, cache):
        cache[:, [0, 2]] = qkv[:, [1, 3], :, 0]  # a list index written to, too
        return qkv[:, :, :, [-2]] * 2 + qkv[..., [[0], [1]]].sum() + cache.sum()


def _index_lists(gm: fx.GraphModule) -> int:
    def has_list(a):
        return isinstance(a, list) or (isinstance(a, tuple) and any(has_list(i) for i in a))
    return sum(n.op == "call_function" and len(n.args) > 1 and has_list(n.args[1]) for n in gm.graph.nodes)


def test_index_lists_become_tensors_on_the_device_with_the_same_result():
    torch.manual_seed(0)
    qkv, cache = torch.randn(2, 5, 3, 4), torch.randn(2, 4, 3)
    ref_cache = cache.clone()
    ref = HeadPicker()(qkv, ref_cache)
    model = HeadPicker()
    out = optimize_and_run(model, qkv, cache)[0]
    assert torch.equal(out, ref) and torch.equal(cache, ref_cache)
    graphs = model._transfuse_state.backend.graphs
    assert graphs and all(_index_lists(gm) == 0 for gm in graphs)
    buffers = [b for gm in graphs for name, b in gm.named_buffers() if name.startswith("_transfuse_index_")]
    assert len(buffers) == 4 and all(b.dtype == torch.long and b.device == qkv.device for b in buffers)
