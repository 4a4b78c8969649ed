"""Tensors built on the host and copied to the GPU inside a graph -> built where they are used.

Hugging Face code sometimes builds an index tensor on the CPU and moves it over, for example
ProphetNet's relative positions: `torch.arange(1, n + 1).unsqueeze(0).repeat(b, s, 1).to(device)`.
Eager runs that copy on every call; CUDA graph capture refuses it ("Cannot copy between CPU and CUDA
tensors during CUDA graph capture"). Two rewrites keep the values exactly:

- fold: when every size in the host chain is a plain int, the chain is computed once, here, on the
  CPU exactly as eager computes it, and the copy becomes a constant buffer on the device;
- move: when a size is symbolic (Dynamo's dynamic shapes) and every tensor in the chain holds
  integers or booleans, the chain's factories (arange, zeros, full...) build on the device instead,
  and the ops after them follow. Integer arithmetic gives the same values on either device.
- fold the values, move the shape: when only shape ops (expand, view, indexing...) read a symbolic
  size, every part computed from plain numbers is folded into a device constant and the shape ops
  run on the device. Phi-MoE's rotary embedding, for one, builds its inverse frequencies on the CPU at
  every call and expands them to the batch's size: `inv_freq[None, :, None].expand(b, -1, 1).to(x.device)`.
  Shape ops move values without computing any, so the device gives the CPU's values bit for bit.

A constant the graph reads as an attribute (transformers' sliding-window caches make
`torch.tensor(window)` on the CPU and move it; constants.py has already made it a buffer) is a leaf
of a chain like a factory call.

A chain that does none of these (a float computation with a symbolic size, a CPU tensor the caller
passes in, a random op) is left as written: `host_copies()` finds its copy, and the backend then runs that
graph without CUDA graphs and says so in the report.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from transfuse.passes.graph import _hashable, method_name, replace_by_buffer, tensor_meta

# Factories that build a tensor from Python numbers: `device=` says where.
_FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.eye, torch.tensor}
# Ops that draw random numbers: folding or moving them would change which numbers a call gets.
_RANDOM = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.bernoulli, torch.normal,
           torch.multinomial, torch.rand_like, torch.randn_like, torch.randint_like, torch.poisson}
_RANDOM_METHODS = {"random_", "uniform_", "normal_", "bernoulli", "bernoulli_", "exponential_",
                   "geometric_", "log_normal_", "cauchy_", "multinomial"}
_EXACT_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
# Ops that only rearrange or repeat their input's values: the same result on any device.
_SHAPE_METHODS = {"expand", "expand_as", "view", "reshape", "unsqueeze", "squeeze", "permute", "transpose",
                  "contiguous", "flatten", "repeat", "t"}
_SHAPE_FUNCTIONS = {torch.unsqueeze, torch.squeeze, torch.reshape, torch.permute, torch.transpose,
                    torch.flatten, torch.t, operator.getitem}


def _on_host(node) -> bool:
    meta = tensor_meta(node) if isinstance(node, fx.Node) else None
    return meta is not None and meta.device.type == "cpu"


def _is_copy(node: fx.Node) -> bool:
    """`x.to(...)` / `x.cuda()` of a host tensor whose result is on another device."""
    moves = ((node.op == "call_method" and method_name(node) in ("to", "cuda"))
             or (node.op == "call_function" and node.target in (torch.Tensor.to, torch.Tensor.cuda)))
    if not moves:
        return False
    out = tensor_meta(node)
    return bool(node.args) and _on_host(node.args[0]) and out is not None and out.device.type != "cpu"


def host_copies(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's copies of host tensors to another device (what CUDA graph capture refuses)."""
    return [n for n in gm.graph.nodes if _is_copy(n)]


def _chain(start: fx.Node) -> tuple[list[fx.Node], bool] | None:
    """The host nodes `start` is computed from, in graph order, and whether a size among their
    arguments is symbolic; None when one of them cannot be rebuilt (a graph input on the CPU, a
    module call, a random or in-place op)."""
    seen: set[fx.Node] = set()
    stack, symbolic = [start], False
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "get_attr":
            continue  # a constant of the graph: no inputs
        if node.op not in ("call_function", "call_method"):
            return None
        name = method_name(node) if node.op == "call_method" else None
        if name is not None and (name.endswith("_") or name in _RANDOM_METHODS):
            return None
        if node.op == "call_function" and (node.target in _RANDOM if _hashable(node.target) else True):
            return None
        for inp in node.all_input_nodes:
            if _on_host(inp):
                stack.append(inp)
            elif tensor_meta(inp) is not None:
                return None  # a device tensor feeding a host op: not a chain of its own
            else:
                symbolic = True  # a size or scalar computed in the graph
    order = {n: i for i, n in enumerate(start.graph.nodes)}
    return sorted(seen, key=order.__getitem__), symbolic


def _evaluate(gm: fx.GraphModule, chain: list[fx.Node]) -> torch.Tensor:
    """Runs the chain on the CPU, as eager would; returns the value of its last node."""
    return _values(gm, chain)[chain[-1]]


def _values(gm: fx.GraphModule, chain: list[fx.Node]) -> dict[fx.Node, object]:
    """Every node of the chain (in graph order), run on the CPU as eager would, and its value."""
    env: dict[fx.Node, object] = {}
    for node in chain:
        if node.op == "get_attr":
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            env[node] = value
            continue
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if node.op == "call_method":
            env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            env[node] = node.target(*args, **kwargs)
    return env


def _set_device_meta(node: fx.Node, device: torch.device) -> None:
    """The node's recorded value, moved to `device` (under its fake mode), for later readers."""
    meta = node.meta.get("example_value")
    mode = getattr(meta, "fake_mode", None)
    if mode is None:
        return
    with mode:
        node.meta["example_value"] = meta.to(device)


def _names_device(node: fx.Node) -> bool:
    return (node.op == "call_method" and method_name(node) == "cpu") or "device" in node.kwargs or any(
        isinstance(a, (torch.device, str)) for a in node.args[1:])


def _move(chain: list[fx.Node], device: torch.device) -> bool:
    """Builds the chain on `device`: factories get `device=`, device moves inside the chain (to the
    CPU) go. False, with nothing changed, where a node names a device some other way."""
    factories, moves = [], []
    for node in chain:
        meta = tensor_meta(node)
        if meta.dtype not in _EXACT_DTYPES:
            return False
        tensor_inputs = [i for i in node.all_input_nodes if tensor_meta(i) is not None]
        if node.op == "call_function" and node.target in _FACTORIES and not tensor_inputs:
            factories.append(node)
        elif not tensor_inputs:
            return False  # builds a host tensor some way this pass does not know
        elif _names_device(node):
            # `.to("cpu")` / `.cpu()` inside the chain: dropped once the chain is on the device
            if not (node.op == "call_method" and method_name(node) in ("to", "cpu")
                    and meta.dtype == tensor_meta(node.args[0]).dtype):
                return False
            moves.append(node)
    for node in factories:
        node.kwargs = {**node.kwargs, "device": device}
    for node in moves:
        node.replace_all_uses_with(node.args[0])
        node.graph.erase_node(node)
    for node in chain:
        if not getattr(node, "_erased", False):
            _set_device_meta(node, device)
    return True


def _moves_only(node: fx.Node) -> bool:
    """An op that rearranges its input's values without computing any (and names no device)."""
    if node.op == "call_method":
        return method_name(node) in _SHAPE_METHODS
    return node.op == "call_function" and _hashable(node.target) and node.target in _SHAPE_FUNCTIONS and not any(
        isinstance(i, fx.Node) and tensor_meta(i) is not None for i in node.all_input_nodes[1:])


def _fold_values_move_shapes(gm: fx.GraphModule, chain: list[fx.Node], device: torch.device) -> bool:
    """Folds what the chain computes from plain numbers into device constants and runs the rest,
    shape ops reading a symbolic size, on the device. False, with nothing changed, where something
    other than a shape op reads a symbolic size (or a value computed from one)."""
    members = set(chain)
    fixed_set: set[fx.Node] = set()
    for node in chain:  # graph order: fixed when every input is a fixed node (no symbolic size)
        if all(i in fixed_set for i in node.all_input_nodes):
            fixed_set.add(node)
    shaped = [n for n in chain if n not in fixed_set]
    if not shaped or not all(_moves_only(n) and n.args and n.args[0] in members for n in shaped):
        return False
    frontier = [n for n in chain if n in fixed_set and any(u not in fixed_set for u in n.users)]
    values = _values(gm, [n for n in chain if n in fixed_set])  # before any node is replaced
    for node in frontier:  # its fixed readers, if any, are dead once every frontier node is a constant
        replace_by_buffer(gm, node, "_transfuse_host_", values[node].to(device))
    for node in shaped:
        _set_device_meta(node, device)
    for node in reversed(chain):
        if node in fixed_set and not getattr(node, "_erased", False) and not node.users:
            gm.graph.erase_node(node)
    return True


def move_host_tensors(gm: fx.GraphModule) -> int:
    """Folds or moves every host chain whose copy is the only thing reading it; returns how many."""
    graph = gm.graph
    done = 0
    for copy in host_copies(gm):
        if getattr(copy, "_erased", False) or not _is_copy(copy):
            continue  # its chain was moved with an earlier copy's
        found = _chain(copy.args[0])
        if found is None:
            continue
        chain, symbolic = found
        members = set(chain)
        # Every reader of the chain is in it, or a copy to the same device: nothing else sees a
        # host tensor become a device tensor.
        out = tensor_meta(copy)
        if any(u not in members and not (_is_copy(u) and tensor_meta(u).device == out.device)
               for n in chain for u in n.users):
            continue
        if not symbolic:
            value = _evaluate(gm, chain).to(device=out.device, dtype=out.dtype)
            replace_by_buffer(gm, copy, "_transfuse_host_", value, recorded=out)
            for node in reversed(chain):
                if not node.users:
                    graph.erase_node(node)
            done += 1
        elif _move(chain, out.device) or _fold_values_move_shapes(gm, chain, out.device):
            done += 1
    return done
