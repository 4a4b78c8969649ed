"""optimize() drops Dynamo's per-module guards (transfuse/guards.py): every change those guards would
have seen must still reach the output, through transfuse's own checks."""

import pytest
import torch

import transfuse
from tests.helpers import rel_err, tiny_bert_twins
from tests.models.registry import REGISTRY
from transfuse.guards import ModuleWatch


def _pair():
    """An optimized model, an eager copy with the same weights, and inputs, after one call."""
    model, eager, ids = tiny_bert_twins()
    transfuse.optimize(model)
    with torch.no_grad():
        model(input_ids=ids)
    return model, eager, ids


def _same(model, eager, ids, **kwargs):
    with torch.no_grad():
        out, ref = model(input_ids=ids, **kwargs), eager(input_ids=ids, **kwargs)
    assert rel_err(out.last_hidden_state, ref.last_hidden_state) < 1e-5
    return out, ref


def test_forward_hook_added_after_optimize_runs():
    model, eager, ids = _pair()
    double = lambda module, inputs, output: output * 2  # noqa: E731
    for m in (model, eager):
        m.encoder.layer[0].output.dense.register_forward_hook(double)
    _same(model, eager, ids)


def test_swapped_submodule_is_used():
    model, eager, ids = _pair()
    torch.manual_seed(1)
    new = torch.nn.Linear(*reversed(model.encoder.layer[1].output.dense.weight.shape))
    model.encoder.layer[1].output.dense = new
    eager.encoder.layer[1].output.dense = new
    _same(model, eager, ids)


def test_config_change_after_optimize_is_seen():
    model, eager, ids = _pair()
    model.config.output_hidden_states = True
    eager.config.output_hidden_states = True
    out, ref = _same(model, eager, ids)
    assert out.hidden_states is not None and len(out.hidden_states) == len(ref.hidden_states)


def test_output_capturing_hooks_are_installed_before_the_call_that_asks():
    """Transformers 5 registers its hidden-state hooks inside the first call that asks for them,
    which Dynamo's code compiled by earlier calls does not see (on torch 2.11 MBart then returned
    no decoder_hidden_states). They are installed before that call: the model is traced afresh."""
    model, eager, ids = _pair()
    before = model._transfuse_state.backend
    assert not getattr(model, "_output_capturing_hooks_installed", False)
    out, ref = _same(model, eager, ids, output_hidden_states=True)
    assert model._output_capturing_hooks_installed
    assert model._transfuse_state.backend is not before  # the hooks were a change seen before the call
    assert len(out.hidden_states) == len(ref.hidden_states) == 3
    for got, want in zip(out.hidden_states, ref.hidden_states):
        assert rel_err(got, want) < 1e-5
    out, ref = _same(model, eager, ids)  # plain calls after it: the inert hooks, the same answer
    assert out.hidden_states is None and ref.hidden_states is None


def test_train_mode_after_optimize_is_seen_then_eval_works():
    model, eager, ids = _pair()
    model.train()
    eager.train()
    torch.manual_seed(3)
    with torch.no_grad():
        out = model(input_ids=ids).last_hidden_state
    torch.manual_seed(3)
    with torch.no_grad():
        ref = eager(input_ids=ids).last_hidden_state
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5)  # dropout is PyTorch's: the same masks
    assert "in training mode is not the identity" in transfuse.report(model)
    model.eval()
    eager.eval()
    _same(model, eager, ids)


def test_module_guards_option_keeps_dynamo_guards():
    model, eager, ids = tiny_bert_twins()
    transfuse.optimize(model, module_guards=True)
    _same(model, eager, ids)
    assert model._transfuse_state.backend.options["module_guards"] is True


def test_module_watch_sees_each_kind_of_change():
    model = REGISTRY[0].build("sdpa")
    watch = ModuleWatch(model)
    assert not watch.changed()
    layer = model.encoder.layer[0].attention.self
    layer.register_buffer("extra", torch.ones(1))
    assert watch.changed()
    watch.snapshot()
    layer.query.weight = torch.nn.Parameter(layer.query.weight.detach().clone())
    assert watch.changed()
    watch.snapshot()
    watch.in_call = True  # what the forward registers itself is Dynamo's to see
    layer.register_buffer("during_call", torch.ones(1))
    watch.in_call = False
    assert not watch.changed()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        assert watch.changed()
    finally:
        handle.remove()
    assert not watch.changed()


def test_deleted_model_releases_its_graphs():
    """Dynamo keeps every backend (and its cache entries the traced graph) alive; the tensors
    transfuse put on the graph (merged weights, key lengths) and its runners must go with the model."""
    import gc
    import weakref

    model, _, ids = _pair()
    backend = model._transfuse_state.backend
    gm = backend.graphs[0]
    held = [weakref.ref(t) for name, t in gm.named_buffers() if name.startswith("_transfuse")]
    assert held, "the tiny BERT has merged QKV weights on its graph"
    del model
    gc.collect()
    assert not backend.runners and not backend.graphs
    assert all(ref() is None for ref in held)


def test_restore_releases_and_keeps_working():
    model, eager, ids = _pair()
    backend = model._transfuse_state.backend
    transfuse.restore(model)
    assert not backend.graphs
    _same(model, eager, ids)

