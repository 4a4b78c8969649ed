"""Host tensors copied to the device inside a graph (ProphetNet's relative positions) are built on
the device, or folded to a constant; what cannot be is left and reported. On a machine without a
GPU the "device" here is `meta`: the pass only asks that the copy leaves the CPU."""

import torch
import torch.fx as fx

from transfuse.passes.host_tensors import _chain, _evaluate, host_copies, move_host_tensors


def _traced(fn, x: torch.Tensor, dynamic: bool) -> fx.GraphModule:
    """The graph Dynamo gives a backend for fn(x), with its recorded values."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=True)(x)
    torch._dynamo.reset()
    return graphs[0]


def _relative_positions(x):
    """ProphetNet's form: an arange on the CPU, shaped there, then moved to x's device."""
    b, n = x.shape
    return x + torch.arange(1, n + 1).unsqueeze(0).repeat(b, 1).to(x.device) * 3


def _calls(gm, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def test_static_chain_folds_into_a_device_constant_with_eager_values():
    gm = _traced(_relative_positions, torch.randn(2, 5, device="meta"), dynamic=False)
    (copy,) = host_copies(gm)
    chain, symbolic = _chain(copy.args[0])
    assert not symbolic
    assert torch.equal(_evaluate(gm, chain), torch.arange(1, 6).unsqueeze(0).repeat(2, 1))
    assert move_host_tensors(gm) == 1
    gm.recompile()
    assert not host_copies(gm) and not _calls(gm, torch.arange)
    buffers = dict(gm.named_buffers())
    assert list(buffers) == ["_transfuse_host_0"]
    assert buffers["_transfuse_host_0"].shape == (2, 5) and buffers["_transfuse_host_0"].device.type == "meta"
    assert buffers["_transfuse_host_0"].dtype == torch.int64


def test_symbolic_integer_chain_is_built_on_the_device():
    gm = _traced(_relative_positions, torch.randn(2, 5, device="meta"), dynamic=True)
    assert any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in gm.graph.nodes)
    assert move_host_tensors(gm) == 1
    gm.recompile()
    assert not host_copies(gm)
    (arange,) = _calls(gm, torch.arange)
    assert arange.kwargs["device"] == torch.device("meta")
    assert arange.meta["example_value"].device.type == "meta"
    # the graph still serves another shape: its size inputs (traced as 2 and 5) given as 3 and 7
    sizes = [{2: 3, 5: 7}[int(n.meta["example_value"])] for n in gm.graph.nodes
             if n.op == "placeholder" and isinstance(n.meta["example_value"], torch.SymInt)]
    assert gm(*sizes, torch.randn(3, 7, device="meta"))[0].shape == (3, 7)


def test_cpu_moves_inside_the_chain_go_with_it():
    def fn(x):
        positions = torch.arange(x.shape[1]).to("cpu").unsqueeze(0).cpu()
        return x + positions.to(x.device)

    gm = _traced(fn, torch.randn(2, 5, device="meta"), dynamic=True)
    assert move_host_tensors(gm) == 1
    gm.recompile()
    assert not host_copies(gm)
    assert not any(n.op == "call_method" and n.target == "cpu" for n in gm.graph.nodes)


def test_float_chain_with_a_symbolic_size_stays_and_is_found():
    # float arithmetic may round differently on the device: left as written, the copy reported
    def fn(x):
        n = x.shape[1]
        return x + (torch.arange(n).float() / n).to(x.device)

    gm = _traced(fn, torch.randn(2, 5, device="meta"), dynamic=True)
    assert move_host_tensors(gm) == 0
    assert len(host_copies(gm)) == 1


def test_host_tensor_read_on_the_host_too_stays():
    def fn(x):
        positions = torch.arange(x.shape[1])
        return x + positions.to(x.device), positions.sum()

    gm = _traced(fn, torch.randn(2, 5, device="meta"), dynamic=True)
    assert move_host_tensors(gm) == 0 and len(host_copies(gm)) == 1


def test_random_chain_stays():
    def fn(x):
        return x + torch.rand(x.shape[1]).to(x.device)

    gm = _traced(fn, torch.randn(2, 5, device="meta"), dynamic=False)
    assert move_host_tensors(gm) == 0 and len(host_copies(gm)) == 1


def _rotary_frequencies(x):
    """Phi-MoE's form: inverse frequencies computed on the CPU at every call, expanded to the batch."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float) / 8))
    return inv_freq[None, :, None].expand(x.shape[0], -1, 1).to(dtype=torch.float32, device=x.device)


def test_values_fold_and_shape_ops_with_a_symbolic_size_move_to_the_device():
    gm = _traced(_rotary_frequencies, torch.randn(2, 5, device="meta"), dynamic=True)
    (copy,) = host_copies(gm)
    chain, symbolic = _chain(copy.args[0])
    assert symbolic
    assert move_host_tensors(gm) == 1
    gm.recompile()
    assert not host_copies(gm) and not _calls(gm, torch.arange)
    (name,) = [n for n, _ in gm.named_buffers()]
    folded = dict(gm.named_buffers())[name]
    assert folded.device.type == "meta" and folded.shape == (1, 4, 1) and folded.dtype == torch.float32
    # the graph reads only x's batch size (traced as 2): given as 3
    (size,) = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert isinstance(size.meta["example_value"], torch.SymInt)
    (out,) = gm(3)
    assert out.shape == (3, 4, 1) and out.device.type == "meta"


def test_the_folded_part_holds_the_values_eager_computes_on_the_cpu():
    gm = _traced(_rotary_frequencies, torch.randn(2, 5, device="cpu"), dynamic=True)
    # on the CPU there is no copy; the chain up to the expand is what would be folded
    (getitem,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "getitem"]
    chain, symbolic = _chain(getitem)
    assert not symbolic
    want = (1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float) / 8)))[None, :, None]
    assert torch.equal(_evaluate(gm, chain), want)


def test_arithmetic_after_a_symbolic_shape_op_stays():
    def fn(x):
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float) / 8))
        return (inv_freq[None, :].expand(x.shape[0], -1) * 2.0).to(x.device)

    gm = _traced(fn, torch.randn(2, 5, device="meta"), dynamic=True)
    assert move_host_tensors(gm) == 0 and len(host_copies(gm)) == 1


def test_a_literal_constant_moved_to_the_device_folds():
    # transformers' sliding-window cache layer: torch.tensor(window) on the CPU, moved at first use;
    # constants.py has made the literal a buffer before this pass runs
    from transfuse.passes.constants import hoist_literal_tensors

    def fn(x):
        return x + 1, torch.tensor(4096, dtype=torch.long).to(x.device)

    gm = _traced(fn, torch.randn(2, 5, device="meta"), dynamic=True)
    assert hoist_literal_tensors(gm) == 1 and len(host_copies(gm)) == 1
    assert move_host_tensors(gm) == 1
    gm.recompile()
    assert not host_copies(gm)
    folded = [b for n, b in gm.named_buffers() if n.startswith("_transfuse_host_")]
    assert len(folded) == 1 and folded[0].device.type == "meta" and folded[0].dtype == torch.long
