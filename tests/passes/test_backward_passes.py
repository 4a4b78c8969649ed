"""The backward-graph passes on small hand-built aten graphs (what AOTAutograd hands
runtime/training_graphs.py): passes/backward_column_sum.py, backward_fp32_grads.py,
backward_packed_qkv.py and backward_views.py. Whole models through them: tests/training/test_training_graphs.py."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from transfuse.passes import backward_column_sum, backward_fp32_grads, backward_packed_qkv, backward_views
from transfuse.passes.manager import backward_registry

aten = torch.ops.aten


def _graph(build, *inputs):
    """An FX graph of aten calls made by build(graph, *placeholders), each node with its fake value;
    an input is a tensor or a (shape, dtype, device) triple (a fake CUDA tensor needs no GPU)."""
    graph = fx.Graph()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else torch.empty(t[0], dtype=t[1], device=t[2])
                 for t in inputs]
        placeholders = []
        for i, fake in enumerate(fakes):
            p = graph.placeholder(f"x{i}")
            p.meta["val"] = fake
            placeholders.append(p)
        outputs = build(graph, *placeholders)
        for node in graph.nodes:
            if node.op == "call_function":
                args = fx.node.map_arg(node.args, lambda n: n.meta["val"])
                kwargs = fx.node.map_arg(node.kwargs, lambda n: n.meta["val"])
                node.meta["val"] = node.target(*args, **kwargs)
        graph.output(tuple(outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_column_sums_become_bias_grad_with_their_dtype_and_shape():
    dy = torch.randn(2, 5, 12, dtype=torch.bfloat16)

    def build(g, x):
        keep = g.call_function(aten.sum.dim_IntList, (x, [0, 1], True))
        widened = g.call_function(aten.sum.dim_IntList, (x, [0, 1]), {"dtype": torch.float32})
        rows_only = g.call_function(aten.sum.dim_IntList, (x, [0], True))  # not a column sum: left alone
        return keep, widened, rows_only

    gm = _graph(build, dy)
    assert backward_column_sum.run(gm) == 2
    keep, widened, rows_only = gm(dy)
    expected = dy.float().sum((0, 1))
    assert keep.shape == (1, 1, 12) and keep.dtype == torch.bfloat16
    assert widened.shape == (12,) and widened.dtype == torch.float32
    torch.testing.assert_close(keep.view(12).float(), expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(widened, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(rows_only, dy.sum(0, keepdim=True))
    assert _targets(gm).count(torch.ops.transfuse.bias_grad.default) == 2


def test_widened_bias_grad_is_summed_in_fp32():
    dy = torch.randn(7, 12, dtype=torch.bfloat16)

    def build(g, x):
        s = g.call_function(aten.sum.dim_IntList, (x, [0], True))
        v = g.call_function(aten.view.default, (s, [12]))
        return (g.call_function(aten._to_copy.default, (v,), {"dtype": torch.float32}),)

    gm = _graph(build, dy)
    assert backward_column_sum.run(gm) == 1 and backward_fp32_grads.run(gm) == 1
    assert aten._to_copy.default not in _targets(gm)
    (out,) = gm(dy)
    assert out.dtype == torch.float32 and out.shape == (12,)
    # one rounding, fp32's: closer to the exact sum than eager's bf16 sum widened after
    exact = dy.double().sum(0)
    assert (out.double() - exact).abs().max() <= (dy.sum(0).double() - exact).abs().max()
    torch.testing.assert_close(out, dy.float().sum(0), rtol=1e-5, atol=1e-5)


def _weight_grad_graph(device, mm_read_elsewhere=False):
    # F.linear's weight gradient under autocast: t(t(mm(t(dy), x))) widened to the fp32 parameter
    dy, x = ((16, 6), torch.bfloat16, device), ((16, 4), torch.bfloat16, device)

    def build(g, dy_node, x_node):
        mm = g.call_function(aten.mm.default, (g.call_function(aten.t.default, (dy_node,)), x_node))
        chain = g.call_function(aten.t.default, (g.call_function(aten.t.default, (mm,)),))
        widened = g.call_function(aten._to_copy.default, (chain,),
                                  {"dtype": torch.float32, "layout": torch.strided, "device": torch.device(device)})
        return (widened, mm) if mm_read_elsewhere else (widened,)

    return _graph(build, dy, x)


def test_weight_gradient_gemm_writes_fp32_on_cuda_only():
    gm = _weight_grad_graph("cuda")
    assert backward_fp32_grads.run(gm) == 1
    targets = _targets(gm)
    assert aten.mm.dtype in targets and aten._to_copy.default not in targets and aten.mm.default not in targets
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0][0]
    assert out.meta["val"].dtype == torch.float32 and tuple(out.meta["val"].shape) == (6, 4)
    # aten.mm.dtype has no CPU kernel: a CPU graph keeps its cast
    gm = _weight_grad_graph("cpu")
    assert backward_fp32_grads.run(gm) == 0 and aten._to_copy.default in _targets(gm)


def test_a_gemm_read_by_anything_else_keeps_its_rounding():
    gm = _weight_grad_graph("cuda", mm_read_elsewhere=True)
    assert backward_fp32_grads.run(gm) == 0 and aten.mm.default in _targets(gm)


def test_backward_passes_are_named_for_disable():
    names = [p.name for p in backward_registry()]
    assert names == ["backward_bias_grad", "backward_packed_qkv", "backward_column_sum", "backward_fp32_grads",
                     "backward_views"]


def test_a_view_traced_on_a_contiguous_tensor_takes_the_strides_a_kernel_returns():
    # Doge's backward: an element-wise backward kernel returned a permuted tensor where the trace
    # had a contiguous one, and the view after it raised inside loss.backward().
    gm = _graph(lambda g, x: [g.call_function(aten.view.default, (g.call_function(aten.mul.Tensor, (x, 2.0)), [12]))],
                torch.randn(3, 4))
    permuted = torch.randn(4, 3).t()  # what the kernel hands over at run time
    try:
        gm(permuted)
        raise AssertionError("the traced view accepted a permuted tensor: this test no longer shows the failure")
    except RuntimeError as e:
        assert "view size is not compatible" in str(e)
    assert backward_views.run(gm) == 1
    assert aten.view.default not in _targets(gm) and aten.reshape.default in _targets(gm)
    (out,) = gm(permuted)
    assert torch.equal(out, (permuted * 2.0).reshape(12))
    contiguous = torch.randn(3, 4)
    (out,) = gm(contiguous)
    assert out._base is not None and torch.equal(out, (contiguous * 2.0).view(12))  # still a view where one fits


def _attention_backward_graph(addend_after_dbias_read: bool):
    """attention_train_bwd's dq, dk (plus an addend, as a returned cache's gradient) and dv through
    HF GPT-2's views into one cat, its dbias read by a node between the backward and the cat."""
    from transfuse.kernels.attention_train import attention_train_fwd

    gen = torch.Generator().manual_seed(3)
    b, t, h, d = 1, 5, 2, 4
    q, k, v = (torch.randn(b, t, h, d, generator=gen).transpose(1, 2) for _ in range(3))
    bias = torch.randn(1, h, t, t, generator=gen)
    out, _, stats = attention_train_fwd(q, k, v, bias, 0.5, True)
    grad_out, extra = torch.randn(out.shape, generator=gen), torch.randn(k.shape, generator=gen)
    ops = torch.ops.transfuse

    def build(g, do, q_, k_, v_, bias_, out_, stats_, extra_):
        bwd = g.call_function(ops.attention_train_bwd.default,
                              (do, q_, k_, v_, bias_, out_, stats_, None, 0.5, True, True))
        dq, dk, dv, dbias = (g.call_function(operator.getitem, (bwd, i)) for i in range(4))
        if not addend_after_dbias_read:
            extra_ = g.call_function(aten.mul.Tensor, (extra_, 1.0))
        dbias_read = g.call_function(aten.mul.Tensor, (dbias, 2.0))
        if addend_after_dbias_read:
            extra_ = g.call_function(aten.mul.Tensor, (extra_, 1.0))
        dk = g.call_function(aten.add.Tensor, (extra_, dk))
        parts = []
        for grad in (dq, dk, dv):
            moved = g.call_function(aten.transpose.int, (grad, 1, 2))
            if grad is dk:
                moved = g.call_function(aten.clone.default, (moved,), {"memory_format": torch.contiguous_format})
            parts.append(g.call_function(aten.view.default, (moved, [b, t, h * d])))
        return g.call_function(aten.cat.default, (parts, 2)), dbias_read

    inputs = (grad_out, q, k, v, bias, out, stats, extra)
    return _graph(build, *inputs), inputs


def test_fused_qkv_gradient_is_written_in_place_after_its_last_input():
    import copy

    gm, inputs = _attention_backward_graph(addend_after_dbias_read=False)
    before = copy.deepcopy(gm)
    assert backward_packed_qkv.run(gm) == 1
    targets = _targets(gm)
    assert aten.cat.default not in targets and aten.clone.default not in targets
    assert torch.ops.transfuse.attention_train_bwd_packed.default in targets
    for ours, theirs in zip(gm(*inputs), before(*inputs)):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # dk's addend is computed after dbias is read: the packed op could not precede that read
    gm, _ = _attention_backward_graph(addend_after_dbias_read=True)
    assert backward_packed_qkv.run(gm) == 0 and aten.cat.default in _targets(gm)
