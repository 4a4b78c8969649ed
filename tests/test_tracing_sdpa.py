"""Only math SDPA is enabled while Dynamo traces a transfuse forward; the user's flags everywhere else."""

import copy

import pytest
import torch

import transfuse
from transfuse import tracing_sdpa
from tests.helpers import rewrite_counts, tiny_bert_twins


@pytest.fixture(autouse=True)
def _every_call_traces(monkeypatch):
    """These tests look at what happens while Dynamo traces: a trace that another test of the run
    saved (trace_cache.py, on by default) would be loaded instead, and nothing traced."""
    monkeypatch.setenv("TRANSFUSE_TRACE_CACHE", "0")


def _user_flags():
    return tracing_sdpa._flags()


def test_start_callback_switches_to_math_only_inside_a_transfuse_forward(monkeypatch):
    monkeypatch.setenv(tracing_sdpa.ENV, "math")
    tracing_sdpa.install()
    before = _user_flags()
    assert any(on for name, on in before.items() if name != "math_sdp")  # the test means something
    tracing_sdpa._on_compile_start()  # outside a transfuse forward: nothing changes
    assert _user_flags() == before
    with tracing_sdpa.inside_forward():
        tracing_sdpa._on_compile_start()
        assert _user_flags() == {name: name == "math_sdp" for name in before}
        tracing_sdpa.restore()  # the backend's first step
        assert _user_flags() == before
        tracing_sdpa._on_compile_start()
    assert _user_flags() == before  # leaving the forward restores, even with no backend call


def test_optimized_model_traces_with_math_only_and_keeps_the_users_flags(monkeypatch):
    monkeypatch.setenv(tracing_sdpa.ENV, "math")
    model, eager, ids = tiny_bert_twins()
    torch.backends.cuda.enable_flash_sdp(False)  # a user's choice, kept through the trace
    try:
        user = _user_flags()
        at_start, at_backend = [], []
        original_call = transfuse.backend.Backend.__call__

        def backend_call(self, gm, example_inputs):
            result = original_call(self, gm, example_inputs)
            at_backend.append(_user_flags())
            return result

        monkeypatch.setattr(transfuse.backend.Backend, "__call__", backend_call)
        transfuse.optimize(model)
        torch._dynamo.reset()  # a clean list of compile callbacks, ours first (record reads what ours set)
        tracing_sdpa.install()
        handler = torch._dynamo.callback.callback_handler
        record = lambda *_: at_start.append(_user_flags())  # noqa: E731 - runs after tracing_sdpa's
        handler.register_start_callback(record)
        try:
            with torch.no_grad():
                out = model(ids).last_hidden_state
                ref = eager(ids).last_hidden_state
        finally:
            handler.remove_start_callback(record)
        assert at_start == [{name: name == "math_sdp" for name in user}]
        assert at_backend == [user]
        assert _user_flags() == user
        assert rewrite_counts(model)["TorchSDPA"] > 0
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    finally:
        torch.backends.cuda.enable_flash_sdp(True)


def test_as_is_leaves_the_flags_alone_during_the_trace(monkeypatch):
    monkeypatch.setenv(tracing_sdpa.ENV, "as-is")
    model, _, ids = tiny_bert_twins()
    transfuse.optimize(model)
    seen = []
    handler = torch._dynamo.callback.callback_handler
    record = lambda *_: seen.append(_user_flags())  # noqa: E731
    handler.register_start_callback(record)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handler.remove_start_callback(record)
    assert seen and all(flags == _user_flags() for flags in seen)


def test_callbacks_come_back_after_dynamo_reset():
    model, _, ids = tiny_bert_twins()
    transfuse.optimize(model)
    torch._dynamo.reset()  # clears every compile callback
    handler = torch._dynamo.callback.callback_handler
    assert tracing_sdpa._on_compile_start not in handler.start_callbacks
    with torch.no_grad():
        model(ids)
    assert tracing_sdpa._on_compile_start in handler.start_callbacks
    assert tracing_sdpa._on_compile_end in handler.end_callbacks


def test_auto_means_cuda_under_a_torch_whose_choice_guards(monkeypatch):
    monkeypatch.delenv(tracing_sdpa.ENV, raising=False)
    monkeypatch.setattr(tracing_sdpa, "CHOICE_GUARDS_BATCH", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not tracing_sdpa.enabled()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert tracing_sdpa.enabled()
    monkeypatch.setattr(tracing_sdpa, "CHOICE_GUARDS_BATCH", False)
    assert not tracing_sdpa.enabled()
    monkeypatch.setenv(tracing_sdpa.ENV, "as-is")
    assert not tracing_sdpa.enabled()
    monkeypatch.setenv(tracing_sdpa.ENV, "mathh")
    with pytest.raises(ValueError, match="TRANSFUSE_TRACE_SDPA='mathh'"):
        tracing_sdpa.enabled()


def _dynamo_settings():
    import torch.fx.experimental._config as fx_config

    return torch._dynamo.config.automatic_dynamic_shapes, fx_config.backed_size_oblivious


def test_dynamo_settings_apply_only_while_a_transfuse_forward_traces():
    import torch.fx.experimental._config as fx_config

    settings = tracing_sdpa.inside_forward([(torch._dynamo.config, {"automatic_dynamic_shapes": False}),
                                            (fx_config, {"backed_size_oblivious": True})])
    before = _dynamo_settings()
    assert before == (True, False)  # torch's defaults: the test means something
    tracing_sdpa._on_compile_start()  # outside a transfuse forward: nothing changes
    assert _dynamo_settings() == before
    with settings:
        assert _dynamo_settings() == before  # a call that does not trace reads nothing, pays nothing
        tracing_sdpa._on_compile_start()
        assert _dynamo_settings() == (False, True)
        tracing_sdpa.restore()  # the backend's first step gives back the SDPA flags only
        assert _dynamo_settings() == (False, True)
        tracing_sdpa._on_compile_end()
        assert _dynamo_settings() == before
        tracing_sdpa._on_compile_start()
    assert _dynamo_settings() == before  # leaving the forward restores, even without a compile end


def test_optimized_model_traces_with_its_dynamo_settings(monkeypatch):
    model, eager, ids = tiny_bert_twins()
    seen = []
    original_call = transfuse.backend.Backend.__call__

    def backend_call(self, gm, example_inputs):
        seen.append(_dynamo_settings())
        return original_call(self, gm, example_inputs)

    monkeypatch.setattr(transfuse.backend.Backend, "__call__", backend_call)
    transfuse.optimize(model)
    before = _dynamo_settings()
    with torch.no_grad():
        out = model(ids).last_hidden_state
        assert _dynamo_settings() == before
        ref = eager(ids).last_hidden_state
    assert seen == [(False, True)]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_a_trace_without_gradients_calls_the_stand_in_and_the_graph_gets_sdpa_back(monkeypatch):
    """In a no-grad trace, F.scaled_dot_product_attention is the stand-in op while Dynamo traces; the
    backend receives SDPA nodes again (the attention pass matches them as always), and the function is
    the user's again after the trace."""
    monkeypatch.delenv(tracing_sdpa.ENV, raising=False)
    model, eager, ids = tiny_bert_twins()
    transfuse.optimize(model)
    seen_during, untraced = [], []
    original_untrace = tracing_sdpa.untrace
    record = lambda *_: seen_during.append(torch.nn.functional.scaled_dot_product_attention)  # noqa: E731
    torch._dynamo.reset()
    tracing_sdpa.install()
    handler = torch._dynamo.callback.callback_handler
    handler.register_start_callback(record)

    def spy(gm):
        count = original_untrace(gm)
        untraced.append(count)
        assert not any(n.target is tracing_sdpa._TRACED or n.target is tracing_sdpa._TRACED.default
                       for n in gm.graph.nodes)
        return count

    monkeypatch.setattr(tracing_sdpa, "untrace", spy)
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    try:
        with torch.no_grad():
            out = model(ids, attention_mask=mask).last_hidden_state
            ref = eager(ids, attention_mask=mask).last_hidden_state
    finally:
        handler.remove_start_callback(record)
    assert seen_during == [tracing_sdpa._TRACED]
    assert untraced == [2]  # both layers' SDPA calls went through the stand-in
    assert torch.nn.functional.scaled_dot_product_attention is tracing_sdpa._SDPA
    assert rewrite_counts(model)["TorchSDPA"] == 2
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], rtol=1e-4, atol=1e-4)


def test_no_stand_in_with_gradients_or_when_asked_for_math(monkeypatch):
    tracing_sdpa.install()
    for env, grad in (("auto", True), ("math", False), ("as-is", False)):
        monkeypatch.setenv(tracing_sdpa.ENV, env)
        with tracing_sdpa.inside_forward(), torch.set_grad_enabled(grad):
            tracing_sdpa._on_compile_start()
            assert torch.nn.functional.scaled_dot_product_attention is tracing_sdpa._SDPA, env
            tracing_sdpa.restore()


def test_the_stand_in_computes_sdpa_with_its_gradients():
    """Another thread calling SDPA while a trace runs gets the stand-in: it must give SDPA's values
    and, with dropout, SDPA's own gradients (the mask drawn once)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, requires_grad=True) for _ in range(3))
    mask = torch.rand(2, 1, 5, 5) > 0.3
    mask[..., 0] = True
    got = torch.ops.transfuse.traced_sdpa(q, k, v, attn_mask=mask, scale=0.2)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2)
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    expected = torch.autograd.grad(want.square().sum(), (q, k, v))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e)
    out = torch.ops.transfuse.traced_sdpa(q, k, v, dropout_p=0.5)
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    assert torch.isfinite(dq).all() and out.grad_fn is not None
    with torch.no_grad():
        torch.testing.assert_close(torch.ops.transfuse.traced_sdpa(q, k, v, is_causal=True),
                                   torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_untrace_names_the_arguments_as_sdpa_does():
    import torch.fx as fx

    graph = fx.Graph()
    q, k, v, m = (graph.placeholder(n) for n in "qkvm")
    graph.output(graph.call_function(tracing_sdpa._TRACED, (q, k, v, m, 0.0, True), {"scale": 0.5, "enable_gqa": False}))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    assert tracing_sdpa.untrace(gm) == 1
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert node.target is torch.nn.functional.scaled_dot_product_attention
    assert node.args == (q, k, v) and node.kwargs == {"attn_mask": m, "is_causal": True, "scale": 0.5}


def test_untrace_reaches_subgraphs():
    import torch.fx as fx

    inner = fx.Graph()
    q, k, v = (inner.placeholder(n) for n in "qkv")
    inner.output(inner.call_function(tracing_sdpa._TRACED.default, (q, k, v)))
    outer = torch.nn.Module()
    outer.body = fx.GraphModule(torch.nn.Module(), inner)
    graph = fx.Graph()
    graph.output(graph.call_module("body", tuple(graph.placeholder(n) for n in "qkv")))
    gm = fx.GraphModule(outer, graph)
    assert tracing_sdpa.untrace(gm) == 1
    (node,) = [n for n in gm.body.graph.nodes if n.op == "call_function"]
    assert node.target is torch.nn.functional.scaled_dot_product_attention
    x = torch.randn(1, 2, 3, 4)
    torch.testing.assert_close(gm(x, x, x), torch.nn.functional.scaled_dot_product_attention(x, x, x))


def test_the_stand_in_follows_sdpa_under_autocast():
    """Under torch.autocast SDPA runs its floating inputs in the autocast dtype: the stand-in's output
    has the same dtype and values (a trace reads its dtype from there)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8) for _ in range(3))
    mask = torch.randn(2, 1, 5, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.ops.transfuse.traced_sdpa(q, k, v, attn_mask=mask)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        fake_mode = torch._subclasses.FakeTensorMode()
        with fake_mode:
            fq, fk, fv, fm = (fake_mode.from_tensor(t) for t in (q, k, v, mask))
            fake = torch.ops.transfuse.traced_sdpa(fq, fk, fv, attn_mask=fm)
    assert want.dtype == torch.bfloat16  # the test means something: autocast casts SDPA
    assert got.dtype == fake.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


def test_overlapping_traces_on_two_threads_leave_the_users_state(monkeypatch):
    """Two threads' traces overlap (two optimized models, a thread each): the first to start saves the
    user's SDPA flags, function and Dynamo settings, the last to end puts them back. Saved per thread,
    the second would have saved the first one's changes as the user's and kept them for good."""
    import threading

    monkeypatch.setenv(tracing_sdpa.ENV, "math")  # the flags switch too, not only the stand-in
    monkeypatch.setattr(tracing_sdpa, "stand_in_enabled", lambda: True)
    tracing_sdpa.install()
    user_flags, user_dynamic = _user_flags(), torch._dynamo.config.automatic_dynamic_shapes
    settings = [(torch._dynamo.config, {"automatic_dynamic_shapes": not user_dynamic})]
    order = threading.Barrier(2)
    seen, errors = {}, []

    def trace(name, first):
        try:
            with tracing_sdpa.inside_forward(settings), torch.no_grad():
                # a starts, b starts, a ends, b ends
                if not first:
                    order.wait()
                tracing_sdpa._on_compile_start()
                seen[name] = (torch.nn.functional.scaled_dot_product_attention, _user_flags())
                if first:
                    order.wait()
                order.wait()
                if not first:
                    order.wait()
                tracing_sdpa._on_compile_end()
                if first:
                    order.wait()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=trace, args=("a", True)), threading.Thread(target=trace, args=("b", False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    math_only = {name: name == "math_sdp" for name in user_flags}
    assert seen["a"] == seen["b"] == (tracing_sdpa._TRACED, math_only)
    assert torch.nn.functional.scaled_dot_product_attention is tracing_sdpa._SDPA
    assert _user_flags() == user_flags
    assert torch._dynamo.config.automatic_dynamic_shapes == user_dynamic


def test_matmul_of_an_expanded_batch_traces_without_a_batch_guard():
    """tracing_matmul.py: inside a transfuse trace without gradients, `a @ b` on 3-d operands with the
    same batch (and a 3-d operand times a matrix) makes no guard on the batch, gives torch.matmul's
    values, and matmul's own decomposition is back once the trace ends."""
    from torch._C import DispatchKey

    from transfuse import tracing_matmul

    if not tracing_matmul.available():
        pytest.skip("this torch has no Python decomposition of matmul")

    class Rotary(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.rand(4), persistent=False)
            self.head = torch.nn.Linear(8, 8, bias=False)  # an LM head on the last position

        def forward(self, x, position_ids):
            inv = self.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
            freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
            return self.head(x[:, -1:, :]) + torch.cat((freqs, freqs), -1)[:, -1:, :]

    torch.manual_seed(0)
    model = Rotary().eval()
    eager = copy.deepcopy(model)
    transfuse.optimize(model)
    with torch.no_grad():
        for batch in (3, 1, 2):
            x, pos = torch.randn(batch, 5, 8), torch.arange(5).repeat(batch, 1)
            assert torch.allclose(model(x, pos), eager(x, pos), atol=1e-6)
    assert sum(len(b.records) for b in model._transfuse_state.backends) == 1
    # torch's own decomposition is back once the traces end
    assert torch.ops.aten.matmul.default.py_kernels[DispatchKey.CompositeImplicitAutograd] is tracing_matmul._ORIGINAL
