"""passes.graph.static_inputs: which graph inputs are the module's parameters and buffers."""

import types

import torch
import torch.fx as fx
from torch._guards import GuardSource

from transfuse.passes.graph import static_inputs


def _input(graph: fx.Graph, name: str, value, guard: GuardSource) -> fx.Node:
    node = graph.placeholder(name)
    node.meta["example_value"] = value
    node.meta["grapharg"] = types.SimpleNamespace(source=types.SimpleNamespace(guard_source=guard))
    return node


def test_a_size_lifted_from_a_module_attribute_is_not_a_parameter():
    """Dynamo lifts the size of a module's tensor attribute (RecurrentGemma's recurrent state) as a
    SymInt input whose source is the module's: the backend read it as a weight (.dtype) and failed.
    An int stands in for the SymInt here."""
    graph = fx.Graph()
    weight = _input(graph, "weight", torch.randn(4, 4), GuardSource.LOCAL_UNSPECIALIZED_NN_MODULE)
    _input(graph, "state_size", 3, GuardSource.LOCAL_UNSPECIALIZED_NN_MODULE)
    x = _input(graph, "x", torch.randn(2, 4), GuardSource.LOCAL)
    graph.output(graph.call_function(torch.nn.functional.linear, (x, weight)))
    assert static_inputs(fx.GraphModule(torch.nn.Module(), graph)) == {weight: 0}


def test_dynamo_inputs_of_a_submodule_are_found():
    """The same on a graph Dynamo traced (read inside the backend: Dynamo drops the grapharg meta
    once it returns): the submodule's weight and bias, not the input."""
    class Parent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x)

    found = []

    def backend(gm, example_inputs):
        found.extend(sorted(n.name for n in static_inputs(gm)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(Parent(), backend=backend)(torch.randn(2, 4))
    torch._dynamo.reset()
    assert len(found) == 2 and any("weight" in n for n in found) and any("bias" in n for n in found), found
