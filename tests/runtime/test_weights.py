"""Merged QKV weights never go stale, and the user's parameters keep their values."""

import torch

import transfuse
from tests.helpers import rel_err
from tests.models.registry import REGISTRY


def _model_and_inputs():
    model = REGISTRY[0].build("sdpa")
    ids = torch.randint(3, 97, (2, 6))
    return model, ids


def test_parameters_keep_values_and_memory_does_not_grow():
    model, ids = _model_and_inputs()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    storage_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
    transfuse.optimize(model)
    with torch.no_grad():
        model(input_ids=ids)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    distinct = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert sum(distinct.values()) <= storage_bytes * 1.02


def test_load_state_dict_after_optimize_is_seen():
    model, ids = _model_and_inputs()
    other = REGISTRY[0].build("sdpa")
    transfuse.optimize(model)
    with torch.no_grad():
        model(input_ids=ids)
        model.load_state_dict(other.state_dict())
        out = model(input_ids=ids).last_hidden_state
        ref = other(input_ids=ids).last_hidden_state
    assert rel_err(out, ref) < 1e-5


def test_replaced_parameter_is_seen():
    model, ids = _model_and_inputs()
    transfuse.optimize(model)
    with torch.no_grad():
        model(input_ids=ids)
        layer = model.encoder.layer[1].attention.self
        layer.key.weight = torch.nn.Parameter(torch.randn_like(layer.key.weight))
        out = model(input_ids=ids).last_hidden_state
    transfuse.restore(model)
    with torch.no_grad():
        ref = model(input_ids=ids).last_hidden_state
    assert rel_err(out, ref) < 1e-5


def test_dtype_change_after_optimize_recompiles():
    """model.half() after optimize: correct in the new dtype, whether Dynamo's guards catch the change
    (as on CPU) or transfuse's own check does (seen on an H200, where Dynamo reused the old graph)."""
    model, ids = _model_and_inputs()
    reference = REGISTRY[0].build("sdpa")
    reference.load_state_dict(model.state_dict())
    transfuse.optimize(model)
    with torch.no_grad():
        model(input_ids=ids)
        model.half()
        out = model(input_ids=ids).last_hidden_state
        ref = reference(input_ids=ids).last_hidden_state
    assert out.dtype == torch.float16
    assert rel_err(out, ref) < 5e-3
