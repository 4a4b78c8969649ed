"""Dynamo's trace kept on disk (trace_cache.py): a second model, or a second process, with the same
model and inputs loads the trace instead of tracing, and gives eager's outputs for its own weights."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import transfuse
from tests.helpers import graph_records, rel_err, tiny_bert_twins
from transfuse import trace_cache
from transfuse.backend import TransfuseError
from transfuse.runtime import precompile

pytestmark = pytest.mark.skipif(not trace_cache.available(), reason="this torch has no ahead-of-time Dynamo compile")


def _status(model) -> str:
    return model._transfuse_state.trace_cache.describe()


def _runners(model) -> list:
    return [r for b in model._transfuse_state.backends for r in b.runners]


def _run(model, eager, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state, \
            eager(input_ids=ids, attention_mask=mask).last_hidden_state


def _mask(batch, seq, cut):
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, cut:] = 0  # padding in the last row: the key mask is part of what is traced
    return mask


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRANSFUSE_CACHE_DIR", str(tmp_path))
    return tmp_path / "traces"


def test_a_second_model_loads_the_trace_and_reads_its_own_weights(cache):
    first, eager, ids = tiny_bert_twins()
    transfuse.optimize(first, trace_cache=True)
    out, ref = _run(first, eager, ids, _mask(2, 7, 4))
    assert rel_err(out, ref) < 1e-5
    assert "traced in" in _status(first) and "saved as" in _status(first), _status(first)
    assert len(list(cache.glob("*.trace"))) == 1

    second, eager2, _ = tiny_bert_twins()  # the same architecture, other random weights
    assert not torch.equal(second.embeddings.word_embeddings.weight, first.embeddings.word_embeddings.weight)
    transfuse.optimize(second, trace_cache=True)
    out, ref = _run(second, eager2, ids, _mask(2, 7, 4))
    assert rel_err(out, ref) < 1e-5
    assert "loaded" in _status(second), _status(second)
    # the loaded graph names its nodes otherwise, but is the same graph to the precompile's marker
    # (a second process would dry-run every bucket again otherwise)
    traced, loaded = (precompile.graph_fingerprint(_runners(m)[0].fn) for m in (first, second))
    assert traced == loaded and _runners(first)[0].fn.code != _runners(second)[0].fn.code
    # another batch and length: the same trace (dynamic sizes), a bucket of its own
    ids3 = torch.randint(3, 97, (3, 11))
    out, ref = _run(second, eager2, ids3, _mask(3, 11, 6))
    assert rel_err(out, ref) < 1e-5
    assert "2 call(s) served, 0 refused" in _status(second), _status(second)
    float_mask = _mask(2, 7, 4).float()  # another dtype than the trace's: its guards refuse the call
    out, ref = _run(second, eager2, ids, float_mask)
    assert rel_err(out, ref) < 1e-5  # traced as usual, through torch.compile
    assert "2 call(s) served, 1 refused" in _status(second), _status(second)
    assert "the first refusal: tensor 'L['kwargs']['attention_mask']' dtype mismatch" in _status(second), _status(second)
    records = graph_records(second)
    # the passes made the same rewrites on the loaded graph as on the traced one (then the refused
    # call's own trace)
    assert len(records) == 2 and records[0].rewrites == graph_records(first)[0].rewrites, records
    assert records[0].rewrites.get("TorchSDPA") == first.config.num_hidden_layers


def test_a_fresh_process_loads_the_trace(cache, tmp_path):
    first, eager, ids = tiny_bert_twins()
    transfuse.optimize(first, trace_cache=True)
    _run(first, eager, ids, _mask(2, 7, 4))
    script = textwrap.dedent("""
        import torch, transfuse
        from tests.helpers import rel_err, tiny_bert_twins
        model, eager, ids = tiny_bert_twins()
        transfuse.optimize(model, trace_cache=True)
        mask = torch.ones(2, 7, dtype=torch.long); mask[-1, 4:] = 0
        with torch.no_grad():
            err = rel_err(model(input_ids=ids, attention_mask=mask).last_hidden_state,
                          eager(input_ids=ids, attention_mask=mask).last_hidden_state)
        print("ERR", err)
        print("STATUS", model._transfuse_state.trace_cache.describe())
    """)
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{root / 'src'}", TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("ERR", "STATUS")))
    assert float(lines["ERR"]) < 1e-5
    assert "loaded" in lines["STATUS"] and "1 call(s) served" in lines["STATUS"], lines["STATUS"]


def test_a_changed_config_is_traced_anew(cache):
    first, eager, ids = tiny_bert_twins()
    transfuse.optimize(first, trace_cache=True)
    _run(first, eager, ids, _mask(2, 7, 4))
    other, eager2, _ = tiny_bert_twins()
    for model in (other, eager2):  # an epsilon the trace baked in as a constant
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.eps = 0.25
    transfuse.optimize(other, trace_cache=True)
    out, ref = _run(other, eager2, ids, _mask(2, 7, 4))
    assert rel_err(out, ref) < 1e-5
    assert "traced in" in _status(other), _status(other)
    assert len(list(cache.glob("*.trace"))) == 2
    # Hugging Face's attention implementation is a private config attribute, left out of to_dict():
    # "eager" traces another graph than "sdpa" (a key without it served the sdpa trace here)
    from tests.models.registry import REGISTRY
    manual, manual_eager = REGISTRY[0].build("eager"), REGISTRY[0].build("eager")
    manual_eager.load_state_dict(manual.state_dict())
    transfuse.optimize(manual, trace_cache=True)
    out, ref = _run(manual, manual_eager, ids, _mask(2, 7, 4))
    assert rel_err(out, ref) < 1e-5
    assert "traced in" in _status(manual) and "ManualAttention" in graph_records(manual)[0].rewrites, _status(manual)


class _Breaks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:  # data-dependent control flow: a graph break
            h = h * 2
        return self.b(h)


def test_a_forward_with_a_graph_break_is_remembered_and_runs_as_usual(cache):
    torch.manual_seed(0)
    for attempt in range(2):
        model = _Breaks().eval()
        x = torch.randn(3, 8)
        with torch.no_grad():
            ref = model(x)
            transfuse.optimize(model, trace_cache=True)
            out = model(x)
        assert rel_err(out, ref) < 1e-5
        status = _status(model)
        assert "not used: the forward did not trace as one savable graph" in status, status
        assert ("remembered" in status) == (attempt == 1), status
    assert list(cache.glob("*.refused")) and not list(cache.glob("*.trace"))


def test_inputs_that_are_not_tensors_are_left_to_torch_compile(cache):
    model, eager, ids = tiny_bert_twins()
    transfuse.optimize(model, trace_cache=True)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=_mask(2, 7, 4), output_hidden_states=[True])
        ref = eager(input_ids=ids, attention_mask=_mask(2, 7, 4), output_hidden_states=[True])
    assert rel_err(out.last_hidden_state, ref.last_hidden_state) < 1e-5
    assert "not used: input 'output_hidden_states' is a list" in _status(model), _status(model)


def test_on_by_default_off_by_setting_and_a_bad_setting_is_one_line(monkeypatch):
    monkeypatch.delenv(trace_cache.ENV, raising=False)
    model, _, _ = tiny_bert_twins()
    transfuse.optimize(model)
    assert model._transfuse_state.trace_cache is not None
    off, _, _ = tiny_bert_twins()
    transfuse.optimize(off, trace_cache=False)
    assert off._transfuse_state.trace_cache is None
    monkeypatch.setenv(trace_cache.ENV, "0")
    off, _, _ = tiny_bert_twins()
    transfuse.optimize(off)
    assert off._transfuse_state.trace_cache is None
    monkeypatch.setenv(trace_cache.ENV, "yes")
    other, _, _ = tiny_bert_twins()
    with pytest.raises(TransfuseError, match="TRANSFUSE_TRACE_CACHE='yes': use 1") as info:
        transfuse.optimize(other)
    assert "\n" not in str(info.value)


def _double(module, inputs, output):
    return output * 2


def test_a_forward_hook_is_part_of_the_key(cache):
    hooked, eager, ids = tiny_bert_twins()
    for model in (hooked, eager):  # Dynamo traces the hook into the graph
        model.embeddings.register_forward_hook(_double)
    transfuse.optimize(hooked, trace_cache=True)
    out, ref = _run(hooked, eager, ids, _mask(2, 7, 4))
    assert rel_err(out, ref) < 1e-5 and "traced in" in _status(hooked), _status(hooked)
    plain, plain_eager, _ = tiny_bert_twins()
    transfuse.optimize(plain, trace_cache=True)
    out, ref = _run(plain, plain_eager, ids, _mask(2, 7, 4))
    assert rel_err(out, ref) < 1e-5 and "traced in" in _status(plain), _status(plain)


def test_a_decoder_is_left_to_torch_compile_without_an_attempt(cache):
    # optimize() gives a model with generate() a subclass of its own (runtime/generation.py), which
    # the saved guards cannot name: no attempt (a whole trace of a decoder), torch.compile traces as usual
    import transformers
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=97, n_positions=64)
    torch.manual_seed(0)
    model, eager = transformers.GPT2LMHeadModel(config).eval(), transformers.GPT2LMHeadModel(config).eval()
    eager.load_state_dict(model.state_dict())
    ids = torch.randint(3, 97, (2, 9))
    transfuse.optimize(model, trace_cache=True)
    with torch.no_grad():
        out, ref = model(input_ids=ids).logits, eager(input_ids=ids).logits
    assert rel_err(out, ref) < 1e-5
    assert "not used: a model with generate()" in _status(model), _status(model)
    assert len(graph_records(model)) == 1 and not list(cache.glob("*"))


def test_a_changed_global_makes_the_saved_trace_stale(cache, monkeypatch):
    # Dynamo guards the globals a forward reads by identity, which no saved trace can keep: the
    # attention function Hugging Face's registry gives for "sdpa" here. Checked by value at load: a
    # function registered under that name after the save is another function, so the trace is made
    # again (and replaces the file), and the outputs are the new function's.
    from transformers.modeling_utils import AttentionInterface
    first, eager, ids = tiny_bert_twins()
    transfuse.optimize(first, trace_cache=True)
    _run(first, eager, ids, _mask(2, 7, 4))
    original = AttentionInterface._global_mapping["sdpa"]

    def halved(module, query, key, value, attention_mask, **kwargs):
        out, weights = original(module, query, key, value, attention_mask, **kwargs)
        return out * 0.5, weights

    with monkeypatch.context() as patch:
        patch.setitem(AttentionInterface._global_mapping, "sdpa", halved)
        second, eager2, _ = tiny_bert_twins()
        transfuse.optimize(second, trace_cache=True)
        out, ref = _run(second, eager2, ids, _mask(2, 7, 4))
        assert rel_err(out, ref) < 1e-5
        status = _status(second)
        assert "traced in" in status and "the saved one was stale: " in status, status
        assert "['_global_mapping']['sdpa'] is " in status and "sdpa_attention_forward" in status, status
        assert len(list(cache.glob("*.trace"))) == 1  # replaced
    # the original function again: stale once more, traced with it
    third, eager3, _ = tiny_bert_twins()
    transfuse.optimize(third, trace_cache=True)
    out, ref = _run(third, eager3, ids, _mask(2, 7, 4))
    assert rel_err(out, ref) < 1e-5 and "the saved one was stale" in _status(third), _status(third)


def test_the_saved_trace_is_made_with_the_settings_of_a_transfuse_trace(cache, monkeypatch):
    # the AOT compile runs no compile callbacks: trace_cache applies what they would (tracing_sdpa.py),
    # so the graph saved is the graph torch.compile would trace (the stand-in SDPA, Dynamo's settings)
    import torch.fx.experimental._config as fx_config
    from transfuse import tracing_sdpa
    monkeypatch.delenv(tracing_sdpa.ENV, raising=False)
    seen = []
    original_call = transfuse.backend.Backend.__call__

    def backend_call(self, gm, example_inputs):
        sdpa = [n for n in gm.graph.nodes if n.op == "call_function" and "sdpa" in str(n.target)]
        seen.append((torch._dynamo.config.automatic_dynamic_shapes, fx_config.backed_size_oblivious,
                     torch.nn.functional.scaled_dot_product_attention is tracing_sdpa._TRACED, len(sdpa)))
        return original_call(self, gm, example_inputs)

    monkeypatch.setattr(transfuse.backend.Backend, "__call__", backend_call)
    model, eager, ids = tiny_bert_twins()
    transfuse.optimize(model, trace_cache=True)
    out, ref = _run(model, eager, ids, _mask(2, 7, 4))
    assert rel_err(out, ref) < 1e-5 and "saved as" in _status(model), _status(model)
    # inside the trace: Dynamo's settings and the stand-in, one per layer
    assert seen == [(False, True, True, model.config.num_hidden_layers)], seen
    assert torch.nn.functional.scaled_dot_product_attention is not tracing_sdpa._TRACED


def test_a_module_that_dynamo_names_by_object_id_is_found_again():
    # on a GPU Dynamo reads torch.Tensor through `G['_<id>_c5']`, a name of the saving process only:
    # the saved aliases map it to the module, and the load's check reads it through them
    alias = f"_{id(torch)}_c5"
    checks = [[f"G['{alias}'].Tensor", "CLASS_MATCH", trace_cache._describe(torch.Tensor, "CLASS_MATCH")]]
    refs = trace_cache._module_refs([], checks, {alias: torch, "other": 3})
    assert refs == {alias: "torch"}
    trace_cache._check_globals(checks, {alias: torch})  # holds
    with pytest.raises(trace_cache.StaleGlobals, match="cannot be read now"):
        trace_cache._check_globals(checks, {})  # an alias nobody mapped: stale, traced again
    checks[0][2] = "builtins.int"
    with pytest.raises(trace_cache.StaleGlobals, match=r"is torch.Tensor, the saved trace saw builtins.int"):
        trace_cache._check_globals(checks, {alias: torch})


def test_the_least_recently_used_traces_go_past_the_size_limit(tmp_path):
    import time
    for i, name in enumerate(["old", "used", "new"]):
        (tmp_path / f"{name}.trace").write_bytes(b"x" * 100)
        os.utime(tmp_path / f"{name}.trace", (time.time() - 100 + i, time.time() - 100 + i))
    os.utime(tmp_path / "used.trace")  # loaded just now
    (tmp_path / "broken.refused").write_bytes(b"why")
    trace_cache._evict(tmp_path, limit=250)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.refused", "new.trace", "used.trace"]
    trace_cache._evict(tmp_path, limit=250)  # within the limit: nothing more
    assert len(list(tmp_path.glob("*.trace"))) == 2


def test_a_graph_with_a_tuple_of_views_is_saved(cache):
    # GPT-2 splits its fused QKV: the split's fake value is a tuple of views, each saved as a tensor of
    # its own sizes and strides (the pickler cannot write a view's base with its fake mode)
    import transformers
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=97, n_positions=64)
    ids, mask = torch.randint(3, 97, (2, 7)), _mask(2, 7, 4)
    statuses = []
    for seed in (0, 1):  # the second model, other weights, loads the first one's trace
        torch.manual_seed(seed)
        model, eager = transformers.GPT2Model(config).eval(), transformers.GPT2Model(config).eval()
        eager.load_state_dict(model.state_dict())
        transfuse.optimize(model, trace_cache=True)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            ref = eager(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        keep = mask.bool()
        assert rel_err(out[keep], ref[keep]) < 1e-5
        statuses.append(_status(model))
    assert "saved as" in statuses[0] and "loaded" in statuses[1], statuses
