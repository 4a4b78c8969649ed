"""Cache-length increments -> one _foreach_add_ at the end of the graph, only where nothing later
in the graph reads the length; the tensors end with the values eager gives them."""

import torch
import torch.fx as fx

from transfuse.passes import cache_length
from transfuse.passes.graph import written_inputs
from transfuse.passes.manager import PassContext


def _graph(fn, *inputs):
    gm = fx.symbolic_trace(fn)
    for node, value in zip((n for n in gm.graph.nodes if n.op == "placeholder"), inputs):
        node.meta["example_value"] = value
    return gm


def _lengths():
    return torch.tensor([3]), torch.tensor([3]), torch.tensor([5])


def layers(a, b, c, x):
    y = x + a  # each layer reads its length, then bumps it
    a.add_(1)
    y = y * b
    b.add_(1)
    z = y + c
    c.add_(1)
    return z + c  # c is read after its increment: it stays where it is


def test_increments_move_to_one_launch_at_the_end():
    a, b, c = _lengths()
    x = torch.randn(4)
    expected = layers(*(t.clone() for t in (a, b, c)), x)
    gm = _graph(layers, a, b, c, x)
    ctx = PassContext(gm=gm, example_inputs=[a, b, c, x], options={})
    cache_length.run(ctx)
    gm.recompile()
    assert ctx.rewrites["CacheLengths"] == 2
    nodes = list(gm.graph.nodes)
    foreach = [n for n in nodes if n.target is torch.ops.aten._foreach_add_.Scalar]
    assert len(foreach) == 1 and nodes.index(foreach[0]) == len(nodes) - 2  # just before the output
    assert sum(n.op == "call_method" and n.target == "add_" for n in nodes) == 1  # c's
    assert written_inputs(gm) == {0, 1, 2}
    out = gm(a, b, c, x)
    torch.testing.assert_close(out, expected)
    assert (a.item(), b.item(), c.item()) == (4, 4, 6)


def test_a_single_increment_is_left_alone():
    a = torch.tensor([2])

    def one(a, x):
        a.add_(1)
        return x * 2

    gm = _graph(one, a, torch.randn(3))
    ctx = PassContext(gm=gm, example_inputs=[a, torch.randn(3)], options={})
    cache_length.run(ctx)
    assert not ctx.rewrites
