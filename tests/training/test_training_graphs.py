"""A training graph run as AOTAutograd's forward and backward graphs (runtime/training_graphs.py),
forced on the CPU with optimize(training_graphs=True): every training op's autograd formula
traces with fake tensors, and whole models follow eager through AdamW steps with gradient
accumulation, dropout and graph breaks. The CUDA-graph half runs in test_training_graphs_gpu.py; here
its compilers run up to torch's own skip check, which turns CUDA graphs off for CPU tensors."""

from __future__ import annotations

import copy
import operator
import weakref

import pytest
import torch
from functorch.compile import aot_function, nop

import transfuse
from tests.helpers import rewrite_counts
from tests.training.test_training import _grad_errors, _hf_gpt2, _llama, _nanogpt, _step
from transfuse.bench.nanogpt import GPT
from transfuse.ops.cross_entropy import linear_cross_entropy
from transfuse.passes.graph import static_inputs
from transfuse.runtime import training_graphs
from transfuse.runtime.training_graphs import TrainingGraphs

ops = torch.ops.transfuse

# ---------------------------------------------------------------------------------------------
# Every op a training graph holds, with every input that can get a gradient requiring one: the
# register_autograd formulas must trace under AOTAutograd (fake tensors, symbolic sizes).


def _t(*shape, grad=True):
    return torch.randn(*shape).requires_grad_(grad)


def _op_cases():
    b, h, s, d, n = 2, 4, 7, 16, 24
    ids = torch.randint(0, 37, (2 * s,))
    ids[:3] = -100
    return {
        "attention_train-causal": (lambda q, k, v: ops.attention_train(q, k, v, None, 0.25, True),
                                   (_t(b, h, s, d), _t(b, 2, s, d), _t(b, 2, s, d))),
        "attention_train-bias": (lambda q, k, v, bias: ops.attention_train(q, k, v, bias, 0.25, False),
                                 (_t(b, h, s, d), _t(b, h, s, d), _t(b, h, s, d), _t(1, h, s, s))),
        "layer_norm": (lambda x, w, bias: ops.layer_norm(x, w, bias, 1e-5), (_t(b, s, n), _t(n), _t(n))),
        "add_layer_norm-sum": (lambda x, r, w, bias: ops.add_layer_norm(x, r, w, bias, 1e-5, True),
                               (_t(b, s, n), _t(b, s, n), _t(n), _t(n))),
        "add_layer_norm": (lambda x, r, w, bias: ops.add_layer_norm(x, r, w, bias, 1e-5, False)[0],
                           (_t(b, s, n), _t(b, s, n), _t(n), _t(n))),
        "rms_norm": (lambda x, w: ops.rms_norm(x, w, 1e-6, 0.0, True), (_t(b, s, n), _t(n))),
        "add_rms_norm-sum": (lambda x, r, w: ops.add_rms_norm(x, r, w, 1e-6, 1.0, False, True),
                             (_t(b, s, n), _t(b, s, n), _t(n))),
        "rotary-tables": (lambda x, cos, sin: ops.rotary(x, cos, sin),
                          (_t(b, h, s, d), _t(1, 1, s, d), _t(1, 1, s, d))),
        "rotary_pair": (lambda q, k, cos, sin: ops.rotary_pair(q, k, cos, sin),
                        (_t(b, h, s, d), _t(b, 2, s, d), _t(1, 1, s, d, grad=False), _t(1, 1, s, d, grad=False))),
        "cross_entropy-mean": (lambda logits, t: ops.cross_entropy(logits, t, -100, 0.1, "mean"), (_t(2 * s, 37), ids)),
        "cross_entropy-none": (lambda logits, t: ops.cross_entropy(logits, t, -100, 0.0, "none"), (_t(2 * s, 37), ids)),
        "linear_cross_entropy-fused": (lambda x, w, bias, t: linear_cross_entropy(x, w, bias, t, -100, 0.1, "mean", 16),
                                       (_t(2 * s, n), _t(37, n), _t(37), ids)),
        "linear_cross_entropy-none": (lambda x, w, t: linear_cross_entropy(x, w, None, t, -100, 0.0, "none"),
                                      (_t(2 * s, n), _t(37, n), ids)),
        "linear_train-gelu-residual": (lambda x, w, bias, r: ops.linear_train(x, w, bias, "gelu_tanh", r),
                                       (_t(b, s, n), _t(32, n), _t(32), _t(b, s, 32))),
        "linear_train-silu_mul": (lambda x, w: ops.linear_train(x, w, None, "silu_mul", None),
                                  (_t(b, s, n), _t(32, n))),
        "linear_train-none": (lambda x, w, bias: ops.linear_train(x, w, bias, "none", None),
                              (_t(b, s, n), _t(32, n), _t(32))),
    }


@pytest.mark.parametrize("case", sorted(_op_cases()))
def test_every_training_op_traces_under_aot_autograd(case):
    fn, inputs = _op_cases()[case]

    def loss(*args):
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        return sum((o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs if o.numel())

    wanted = [a for a in inputs if a.requires_grad]
    expected = torch.autograd.grad(loss(*inputs), wanted)
    traced = aot_function(loss, fw_compiler=nop, dynamic=True)
    got = torch.autograd.grad(traced(*inputs), wanted)
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, rtol=1e-5, atol=1e-5), case


# ---------------------------------------------------------------------------------------------
# Whole models: AdamW steps with gradient accumulation, as eager


def _forward(model, ids, targets):
    if isinstance(model, GPT):
        return model(ids, targets)[1]
    return model(input_ids=ids, labels=targets).loss


@pytest.mark.parametrize("family", ["nanogpt", "gpt2", "llama"])
def test_adamw_steps_with_gradient_accumulation_equal_eager(family):
    model = {"nanogpt": _nanogpt, "gpt2": _hf_gpt2, "llama": _llama}[family]()
    reference = copy.deepcopy(model)
    transfuse.optimize(model, training_graphs=True)
    # eps 1e-6: Adam's first step moves each weight by lr times the sign of its gradient, and the
    # attention's key bias has an exact gradient of 0 (rounding noise of either sign on both sides),
    # so at eps 1e-8 the two models' key biases part by 2 lr and the second step's gradients by
    # ~4e-4 at hidden 32 (1.4e-5 at hidden 64); at 1e-6 noise-sized gradients barely move (1.2e-5).
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6) for m in (model, reference)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):  # the second step's gradients are taken at the weights AdamW moved
        micro = [torch.randint(0, 97, (2, 12), generator=gen) for _ in range(2)]
        for m in (model, reference):
            for ids in micro:  # two micro-batches, one optimizer step's worth of gradients
                (_forward(m, ids, ids.roll(-1, 1)) / len(micro)).backward()
        errors = _grad_errors(model, reference)
        assert len(errors) == len(list(reference.parameters()))
        assert max(errors.values()) < 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
    ids = torch.randint(0, 97, (2, 12), generator=gen)
    loss, ref_loss = _forward(model, ids, ids.roll(-1, 1)), _forward(reference, ids, ids.roll(-1, 1))
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    # one autograd node for the whole graph, not one per op
    assert type(loss.grad_fn).__name__ == "CompiledFunctionBackward", loss.grad_fn
    report = transfuse.report(model)
    assert "training graphs: 1 " in report and "run as AOTAutograd forward + backward graphs, no CUDA graphs: " \
        "not on a GPU: 1" in report, report
    assert rewrite_counts(model)["LinearEpilogue"] == 2
    # the output projections' bias gradients, summed in the LayerNorm backward kernels (2 blocks)
    assert rewrite_counts(model)["BiasGradInNormBackward"] == {"nanogpt": 4, "gpt2": 4, "llama": 0}[family]
    assert ("bias gradients (in the norm backward)" in report) == (family != "llama"), report
    # one QKV linear: the attention backward writes its gradient in place (Llama has three linears)
    assert rewrite_counts(model)["PackedQKVGrad"] == {"nanogpt": 2, "gpt2": 2, "llama": 0}[family]
    # the MLP's activation (GELU; Llama's silu(gate) * up) recomputed in the backward, not saved
    assert rewrite_counts(model)["RecomputedActivation"] == 2


@pytest.mark.parametrize("family,graphs", [("nanogpt", True), ("gpt2", True), ("nanogpt", False)])
def test_returned_logits_get_their_gradient_outside_the_graph(family, graphs, monkeypatch):
    """The logits a model returns next to its loss leave the graph without a gradient: AOTAutograd's
    backward has no (rows, V) tangent to fill with zeros. Backpropagating the loss alone, and the
    loss plus a term of the logits (ReturnedLogits' backward, joining the graph's through x), give
    eager's gradients."""
    model = {"nanogpt": _nanogpt, "gpt2": _hf_gpt2}[family]()
    reference = copy.deepcopy(model)
    tangents = []
    plain = training_graphs._plain

    def record(gm, inputs):
        tangents.extend(tuple(n.meta["val"].shape) for n in gm.graph.nodes
                        if n.op == "placeholder" and n.name.startswith("tangents"))
        return plain(gm, inputs)

    monkeypatch.setattr(training_graphs, "_plain", record)
    transfuse.optimize(model, training_graphs=graphs)  # False: eager autograd through the graph's ops
    ids = torch.randint(0, 97, (2, 11))
    for with_logits in (False, True):
        for m in (model, reference):
            logits, loss = _step_without_backward(m, ids, ids.roll(-1, 1))
            (loss + (logits * logits.detach().sign()).mean() if with_logits else loss).backward()
        errors = _grad_errors(model, reference)
        assert len(errors) == len(list(reference.parameters()))
        assert max(errors.values()) < 1e-4, (with_logits, sorted(errors.items(), key=lambda kv: -kv[1])[:3])
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
    assert rewrite_counts(model)["ReturnedLogits"] == 1
    assert not any(shape and shape[-1] == 97 for shape in tangents), tangents
    assert bool(tangents) == graphs


@pytest.mark.parametrize("disable", [(), ("recompute_activations",)])
def test_activation_recomputed_in_the_backward_unless_disabled(disable):
    """Linear -> GELU -> Linear: the GELU output is recomputed in the backward from the saved
    pre-activation (RecomputedActivation), or saved as before when the pass is disabled; the
    gradients are eager's either way."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.Linear(48, 16))
    reference = copy.deepcopy(mlp)
    transfuse.optimize(mlp, training_graphs=True, disable=disable)
    x = torch.randn(3, 5, 16)
    for m in (mlp, reference):
        (m(x) * torch.linspace(-1, 1, 16)).sum().backward()
    errors = _grad_errors(mlp, reference)
    assert len(errors) == 4 and max(errors.values()) < 1e-5, errors
    assert rewrite_counts(mlp)["RecomputedActivation"] == (0 if disable else 1)


def _step_without_backward(model, ids, targets):
    if isinstance(model, GPT):
        return model(ids, targets)
    out = model(input_ids=ids, labels=targets)
    return out.logits, out.loss


def test_dropout_draws_the_same_masks_as_eager():
    """native_dropout stays in the forward graph, drawing from the default generator in eager's
    order; its mask is saved for the backward (no draw there)."""
    model = _nanogpt(dropout=0.2)
    reference = copy.deepcopy(model)
    transfuse.optimize(model, training_graphs=True)
    ids = torch.randint(0, 97, (2, 12))
    for seed in (5, 6):
        for m in (model, reference):
            torch.manual_seed(seed)
            _step(m, ids, ids)
        errors = _grad_errors(model, reference)
        assert max(errors.values()) < 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    first = model(ids, ids)[1].item()
    torch.manual_seed(6)
    assert model(ids, ids)[1].item() != pytest.approx(first, rel=1e-6)  # dropout is on


def test_graph_breaks_and_gradient_checkpointing_equal_eager():
    """Hugging Face's checkpointed blocks break the graph: the graphs before and after are two AOT
    graphs, the blocks between them eager (recomputed in the backward)."""
    model = _hf_gpt2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = copy.deepcopy(model)
    transfuse.optimize(model, training_graphs=True)
    ids = torch.randint(0, 97, (2, 13))
    _, loss = _step(model, ids, ids)
    _, ref_loss = _step(reference, ids, ids)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    errors = _grad_errors(model, reference)
    assert max(errors.values()) < 1e-4, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    records = [r for r in model._transfuse_state.backend.records if r.training]
    assert len(records) >= 2 and all(r.training_runtime.startswith("AOTAutograd") for r in records)


def test_new_batch_shape_equals_eager():
    model = _nanogpt()
    reference = copy.deepcopy(model)
    transfuse.optimize(model, training_graphs=True)
    for shape in ((2, 12), (3, 7), (2, 12)):
        ids = torch.randint(0, 97, shape)
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
            _step(m, ids, ids)
        errors = _grad_errors(model, reference)
        assert max(errors.values()) < 1e-4, (shape, sorted(errors.items(), key=lambda kv: -kv[1])[:3])


def test_on_by_default_on_a_gpu_only(monkeypatch):
    from transfuse import backend

    cpu = [torch.zeros(2)]
    assert not backend._training_graphs({}, cpu) and backend._training_graphs({"training_graphs": True}, cpu)
    monkeypatch.setattr(backend, "_on_cuda", lambda inputs: True)
    assert backend._training_graphs({}, cpu) and not backend._training_graphs({"training_graphs": False}, cpu)


def test_off_by_option_and_by_default_on_the_cpu():
    for options, expected in (({"training_graphs": False}, "eager autograd"), ({}, "eager autograd")):
        model = _nanogpt()
        transfuse.optimize(model, **options)
        ids = torch.randint(0, 97, (2, 8))
        _, loss = _step(model, ids, ids)
        assert type(loss.grad_fn).__name__ != "CompiledFunctionBackward"
        assert f"run as {expected}" in transfuse.report(model)


# ---------------------------------------------------------------------------------------------
# The CUDA-graph half, as far as a CPU goes


def test_cuda_graph_compilers_fall_back_on_torchs_own_check(monkeypatch):
    """With cuda_graphs=True on CPU tensors the forward compiler asks torch (the cudagraphs
    backend's check_for_skip), which refuses: both graphs run as plain FX code and the report says
    why. The static inputs it would have handed to cudagraph trees are the parameters."""
    seen = []
    real = training_graphs._static_input_indices
    monkeypatch.setattr(training_graphs, "_static_input_indices", lambda: seen.append(real()) or seen[-1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    runners = []

    def backend(gm, example_inputs):
        runners.append(TrainingGraphs(gm, example_inputs, sorted(static_inputs(gm).values()), cuda_graphs=True))
        return runners[-1]

    x = torch.randn(5, 8)
    torch.compile(model, backend=backend)(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert max(_grad_errors(model, reference).values()) < 1e-5
    (graphs,) = runners
    assert "cpu" in graphs.skipped and "no CUDA graphs" in graphs.describe()
    assert len(seen) == 1 and len(seen[0]) == 4  # two weights, two biases; x is not static


def test_dynamic_sizes_reach_cudagraph_trees_as_ints(monkeypatch):
    """cudagraphify_impl keys a recording on the inputs that are ints when it is set up: the sizes
    of dynamic dims must reach it as ints (at compile time they are SymInts), or every batch size
    would replay the first one's graph (on a GPU: a copy error, or a silent broadcast)."""
    import torch._inductor.cudagraph_trees as trees

    seen = []
    monkeypatch.setattr(trees, "cudagraphify_impl", lambda run, inputs, *a, **k: seen.append(list(inputs)) or run)
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    size = ShapeEnv().create_unbacked_symint()
    gm = torch.fx.symbolic_trace(lambda n, x: x * 2)
    training_graphs._cudagraphify(lambda args: args, gm, [size, 3, torch.ones(2)], [], 0, False, False, set())
    (inputs,) = seen
    assert [type(v) for v in inputs[:2]] == [int, int] and isinstance(inputs[2], torch.Tensor)


def test_unpool_copies_only_gradients_left_in_the_pool():
    """A .grad that is the last backward's output (autograd took it as is) gets memory of its
    own before the next forward; one accumulated elsewhere stays."""
    pooled, own = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    pooled.grad, own.grad = torch.arange(3.0), torch.ones(3)
    graphs = TrainingGraphs.__new__(TrainingGraphs)
    graphs.params = [pooled, own]
    graphs.pooled_ptrs = {pooled.grad.untyped_storage().data_ptr()}
    graphs.pool_owner = None
    before_pooled, before_own = pooled.grad, own.grad
    training_graphs._POOLED.add(graphs)
    training_graphs.unpool_grads()
    assert pooled.grad is not before_pooled and torch.equal(pooled.grad, before_pooled)
    assert pooled.grad.untyped_storage().data_ptr() != before_pooled.untyped_storage().data_ptr()
    assert own.grad is before_own
    assert not training_graphs._POOLED and not graphs.pooled_ptrs


def test_gradients_left_in_a_reset_pool_become_none_with_a_warning():
    """torch._dynamo.reset() between a backward and the next forward frees the cudagraph-tree pool
    that holds the gradients: they are dropped, not copied out of freed memory."""
    class Manager:
        pass

    pooled, own = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    pooled.grad, own.grad = torch.arange(3.0), torch.ones(3)
    graphs = TrainingGraphs.__new__(TrainingGraphs)
    graphs.params, graphs.device_index = [pooled, own], None
    graphs.pooled_ptrs = {pooled.grad.untyped_storage().data_ptr()}
    manager = Manager()
    graphs.pool_owner = weakref.ref(manager)
    del manager  # the reset tree manager is gone
    training_graphs._POOLED.add(graphs)
    with pytest.warns(UserWarning, match="1 parameter gradients that were still in their memory pool"):
        training_graphs.unpool_grads()
    assert pooled.grad is None and torch.equal(own.grad, torch.ones(3))
    assert not training_graphs._POOLED and graphs.pool_owner is None


def test_aot_failure_falls_back_to_eager_autograd(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("no fake impl for this op\nsecond line")

    monkeypatch.setattr(TrainingGraphs, "__init__", refuse)
    model = _nanogpt()
    reference = copy.deepcopy(model)
    transfuse.optimize(model, training_graphs=True)
    ids = torch.randint(0, 97, (2, 8))
    _step(model, ids, ids)
    _step(reference, ids, ids)
    assert max(_grad_errors(model, reference).values()) < 1e-4
    assert "eager autograd through the graph's ops (AOTAutograd failed: RuntimeError: no fake impl for this op)" \
        in transfuse.report(model)


def test_bias_grad_pass_on_torch_2_11s_graphs(monkeypatch):
    """Two shapes of torch 2.11's CUDA autocast backward graphs, simulated here on the CPU's before
    the pass: the getitem nodes carry no fake value, and a bf16 projection's gradient is summed
    straight into its fp32 bias, sum(g, [0], True, dtype=float32) (rounded back to bf16 after, so that
    the step's numbers stay eager's). The pass takes the four bias sums all the same, with the norm
    backward's column sum in fp32, and the gradients stay within eager bf16's error."""
    from transfuse.passes import backward_bias_grad

    original = backward_bias_grad.run
    aten = torch.ops.aten

    def as_on_cuda(gm):
        for node in list(gm.graph.nodes):
            if node.target is operator.getitem:
                node.meta.pop("val", None)
            elif node.target is aten.sum.dim_IntList and not node.kwargs and \
                    node.meta["val"].dtype == torch.bfloat16:
                with gm.graph.inserting_after(node):
                    back = gm.graph.call_function(aten._to_copy.default, (node,), {"dtype": torch.bfloat16})
                node.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
                node.kwargs = {"dtype": torch.float32}
                back.meta["val"] = node.meta["val"]
                node.meta["val"] = node.meta["val"].float()
        gm.recompile()
        return original(gm)

    monkeypatch.setattr(backward_bias_grad, "run", as_on_cuda)
    model = _nanogpt()
    fp32, eager = copy.deepcopy(model), copy.deepcopy(model)
    transfuse.optimize(model, training_graphs=True)
    ids = torch.randint(0, 97, (2, 11))
    _step(fp32, ids, ids)
    for m in (eager, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _step(m, ids, ids)
    ours, theirs = _grad_errors(model, fp32), _grad_errors(eager, fp32)
    worst = max(ours, key=lambda n: ours[n] - 2 * theirs[n])
    assert ours[worst] <= 2 * theirs[worst] + 1e-2, (worst, ours[worst], theirs[worst])
    assert rewrite_counts(model)["BiasGradInNormBackward"] == 4
