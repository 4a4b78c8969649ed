"""One compiled graph per module instance when Dynamo reuses a trace across instances.

Dynamo compiles a frame once per code object and, with nn.Module inlining, passes a module's
parameters to the graph as inputs, so the graph it traced for `layers[0].forward` also serves
`layers[1].forward`. That happens when a layer's forward is a frame of its own: after a graph break
inside the layer loop (BART's fp16 guard, `if not torch.isfinite(h).all()`, breaks every encoder
layer). A transfuse graph is not instance-free: merged Q/K/V weights are buffers of the graph and
the parameters are views of them (passes/merge_linears.py), and a CUDA graph holds the addresses it
read. Run for another layer, the graph's copy-in of "replaced" parameters wrote layer 1's weights
into layer 0's buffer (the user's layer-0 weights changed, measured on bart-base fp16: logits 1.5e-1
from fp32's after the first call), and its CUDA graph was captured again at every call.

`Instances` keeps the graph as traced (before the passes) and compiles it again, once, for each set
of parameter objects that arrives: the call's own tensors are the new compile's example inputs, so
each instance gets its own merged buffers and CUDA graphs. Calls with the compile-time parameters
never come here (their addresses match: one C call, see backend.py).
"""

from __future__ import annotations

import collections
import copy
import weakref
from typing import Callable

import torch.fx as fx

MAX_INSTANCES = 64  # compiled copies kept per traced graph (least recently used dropped)


def pristine_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of the traced graph that the passes (which rewrite `gm` in place) leave alone. Nodes
    are new, their metadata (Dynamo's example values and sources) shared."""
    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


class Instances:
    """The compiled graphs of one traced graph, keyed by the identity of its parameter inputs."""

    def __init__(self, pristine: fx.GraphModule, static: list[int], compile_fn: Callable):
        self.pristine = pristine
        self.static = static
        self.compile_fn = compile_fn  # (graph module, example inputs) -> compiled callable
        self.entries: collections.OrderedDict = collections.OrderedDict()

    def owners(self, args) -> list:
        return [weakref.ref(args[i]) for i in self.static]

    def foreign(self, args, owners: list) -> bool:
        """Whether most parameter inputs are not the objects a graph was compiled with: another
        instance's. (A few replaced parameters of the same instance are copied in by the graph.)"""
        differ = sum(args[i] is not ref() for i, ref in zip(self.static, owners))
        return 2 * differ > len(self.static)

    def __call__(self, args):
        key = tuple(id(args[i]) for i in self.static)
        entry = self.entries.get(key)
        if entry is not None and all(args[i] is ref() for i, ref in zip(self.static, entry[0])):
            self.entries.move_to_end(key)
            return entry[1](*args)
        compiled = self.compile_fn(pristine_copy(self.pristine), list(args))
        self.entries[key] = (self.owners(args), compiled)
        while len(self.entries) > MAX_INSTANCES:
            self.entries.popitem(last=False)
        return compiled(*args)
