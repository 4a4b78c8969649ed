"""branchless.py: data-dependent guards (`if not torch.isfinite(h).all(): h = clamp(h)`) recompiled as
selects give the guard's values for every input, trace without a graph break, and guards whose body
is not pure stay as written."""

import pytest
import torch
import transformers

import transfuse
from transfuse import branchless


class BartStyle(torch.nn.Module):
    """BART's encoder-layer guard (transformers/models/bart/modeling_bart.py, BartEncoderLayer)."""

    def forward(self, hidden_states):
        hidden_states = hidden_states * 2
        if hidden_states.dtype == torch.float16 and not torch.isfinite(hidden_states).all():
            clamp_value = torch.finfo(hidden_states.dtype).max - 1000
            hidden_states = torch.clamp(hidden_states, min=-clamp_value, max=clamp_value)
        return hidden_states + 1


class DetrStyle(torch.nn.Module):
    """DETR's spelling: nested in a Python test, two reductions joined by `or`."""

    def forward(self, x, scale: float = 1.0):
        x = x * scale
        if self.training:
            if torch.isinf(x).any() or torch.isnan(x).any():
                bound = torch.finfo(x.dtype).max - 1000
                x = torch.clamp(x, min=-bound, max=bound)
        return x - 1


class InPlace(torch.nn.Module):
    def forward(self, x):
        if not torch.isfinite(x).all():
            x = x.clamp_(-1, 1)  # in-place: running it unconditionally would change x
        return x


class CallsHelper(torch.nn.Module):
    def forward(self, x):
        if torch.isnan(x).any():
            x = _fix(x)  # not a torch function: may have side effects
        return x


class BoundInside(torch.nn.Module):
    def forward(self, x):
        if torch.isnan(x).any():
            y = torch.nan_to_num(x)  # y is unbound when the guard does not fire
        return x + y  # noqa: F821


def _fix(x):
    return torch.nan_to_num(x)


def _inputs(dtype):
    big = torch.finfo(dtype).max / 2 - 10  # doubled: past the clamp bound, still finite
    base = torch.randn(3, 5, dtype=dtype)
    with_big = base.clone()
    with_big[0, 1] = big
    with_inf = with_big.clone()
    with_inf[2, 3] = float("inf")
    with_nan = with_big.clone()
    with_nan[1, 0] = float("nan")
    return {"finite": base, "big finite": with_big, "inf": with_inf, "nan": with_nan}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_bart_guard_gives_the_guards_values_for_every_input(dtype):
    module = BartStyle()
    found = branchless.rewrite_forward(BartStyle.forward)
    assert found is not None and found[1] == 1
    fn = found[0]
    for name, x in _inputs(dtype).items():
        ref, out = BartStyle.forward(module, x), fn(module, x)
        assert torch.equal(torch.isnan(ref), torch.isnan(out)), name
        assert torch.equal(torch.nan_to_num(ref), torch.nan_to_num(out)), name
    # the guard fired where it should (and only there): the big finite value is clamped with the inf
    xs = _inputs(torch.float16)
    kept, clamped = fn(module, xs["big finite"]), fn(module, xs["inf"])
    assert kept[0, 1] > 65000 and clamped[0, 1] < 64600 and not torch.isinf(clamped).any()


def test_or_of_two_reductions_under_a_python_test():
    module = DetrStyle().train()
    fn, count = branchless.rewrite_forward(DetrStyle.forward)
    assert count == 1
    for training in (True, False):
        module.train(training)
        for name, x in _inputs(torch.float16).items():
            ref, out = DetrStyle.forward(module, x, 2.0), fn(module, x, 2.0)
            assert torch.equal(torch.nan_to_num(ref), torch.nan_to_num(out)), (training, name)
    assert fn.__defaults__ == DetrStyle.forward.__defaults__


@pytest.mark.parametrize("cls", [InPlace, CallsHelper, BoundInside])
def test_guards_whose_body_is_not_pure_stay_as_written(cls):
    assert branchless.rewrite_forward(cls.forward) is None


def test_rewritten_forward_traces_in_one_graph():
    module = BartStyle()
    fn, _ = branchless.rewrite_forward(BartStyle.forward)
    x = _inputs(torch.float16)["inf"]
    with pytest.raises(Exception):  # the guard as written breaks the graph
        torch.compile(module, backend="eager", fullgraph=True)(x)
    torch._dynamo.reset()
    module.forward = fn.__get__(module)
    out = torch.compile(module, backend="eager", fullgraph=True)(x)
    assert torch.equal(out, BartStyle.forward(module, x))


def test_bart_fp16_traces_whole_and_restore_puts_the_forwards_back(device):
    """A tiny BART in fp16: the encoder layers' guard made branchless, so the forward is one graph
    with no break, each guard one clamp_if_nonfinite; logits equal to fp16 eager's; the report names
    the rewrite; restore() removes it."""
    config = transformers.BartConfig(
        d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64, forced_eos_token_id=None,
        vocab_size=97, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config).eval().half().to(device)
    ids = torch.randint(3, 97, (2, 9), device=device)
    decoder_ids = torch.randint(3, 97, (2, 5), device=device)
    with torch.no_grad():
        ref = model(input_ids=ids, decoder_input_ids=decoder_ids, use_cache=False).logits.float()
        transfuse.optimize(model)
        # use_cache=False: on torch 2.11 Dynamo breaks at the DynamicCache a cached call creates
        # (transformers' config.get_text_config deep-copies), which is not what this test is about
        out = model(input_ids=ids, decoder_input_ids=decoder_ids, use_cache=False).logits.float()
    layers = model.model.encoder.layers
    assert all("forward" in layer.__dict__ for layer in layers)
    text = transfuse.report(model)
    assert "BranchlessGuard: 2 module forward(s)" in text and "BartEncoderLayer (1)" in text
    assert "graph breaks: 0" in text
    records = model._transfuse_state.backend.records
    assert len(records) == 1 and records[0].rewrites["OverflowSelect"] == 2  # one kernel per guard
    assert (out - ref).abs().max() / ref.abs().max() < 5e-3  # fp16 against fp16 eager
    transfuse.restore(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_disable_keeps_the_guards_as_written(device):
    model = torch.nn.Sequential(BartStyle()).to(device)
    transfuse.optimize(model, disable=("BranchlessGuard",))
    assert "forward" not in model[0].__dict__


def _selects_after_the_clamp_pass(cls, device):
    """(graph module, rewrites) of cls's rewritten forward traced by Dynamo, after passes/clamp.py and
    dead-code removal, checked to give the forward as written on every input."""
    from transfuse.passes import clamp
    from transfuse.passes.graph import remove_dead_code
    from transfuse.passes.manager import PassContext

    module = cls()
    module.forward = branchless.rewrite_forward(cls.forward)[0].__get__(module)
    graphs = []
    torch._dynamo.reset()
    torch.compile(module, backend=lambda gm, ex: graphs.append((gm, ex)) or gm.forward, fullgraph=True)(
        _inputs(torch.float16)["inf"].to(device))
    gm, example_inputs = graphs[0]
    ctx = PassContext(gm=gm, example_inputs=example_inputs, options={})
    clamp.run(ctx)
    remove_dead_code(gm.graph)
    gm.recompile()
    for x in _inputs(torch.float16).values():
        x = x.to(device)
        assert torch.equal(torch.nan_to_num(gm(x)[0]), torch.nan_to_num(cls.forward(module, x)))
    return gm, ctx.rewrites


def test_overflow_select_pass_leaves_one_op_and_no_dead_guard(device):
    """The select Dynamo traces from the rewritten guard becomes one clamp_if_nonfinite, and what the
    guard computed before it (isfinite, all, logical_not, clamp) is gone from the graph."""
    gm, rewrites = _selects_after_the_clamp_pass(BartStyle, device)
    assert rewrites["OverflowSelect"] == 1
    targets = [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert torch.ops.transfuse.clamp_if_nonfinite.default in targets
    assert not {torch.isfinite, torch.logical_not, torch.clamp, torch.where, "all"} & set(targets), targets


class LongT5Style(torch.nn.Module):
    """LongT5's block: three guards that each bind the same temporary (`clamp_value`), one of them
    inside a Python branch; `torch.isinf(h).any()` alone as the test."""

    def forward(self, h, cross: bool = True):
        h = h * 2
        if h.dtype == torch.float16 and torch.isinf(h).any():
            clamp_value = torch.finfo(h.dtype).max - 1000
            h = torch.clamp(h, min=-clamp_value, max=clamp_value)
        if cross:
            h = h + 1
            if h.dtype == torch.float16 and torch.isinf(h).any():
                clamp_value = torch.finfo(h.dtype).max - 1000
                h = torch.clamp(h, min=-clamp_value, max=clamp_value)
        h = h - 3
        if h.dtype == torch.float16 and torch.isinf(h).any():
            clamp_value = torch.finfo(h.dtype).max - 1000
            h = torch.clamp(h, min=-clamp_value, max=clamp_value)
        return h


class MaybeBound(torch.nn.Module):
    def forward(self, x, flag: bool = False):
        if flag:
            y = x * 2
        if torch.isnan(x).any():
            y = torch.nan_to_num(x)  # y's old value may not exist: the guard must stay as written
        return y


def test_guards_sharing_a_temporary_each_become_a_select(device):
    """Before, the second guard's select read `clamp_value` from the first guard's body, which only
    exists when the first one fired (a NameError on every finite input)."""
    module = LongT5Style()
    fn, count = branchless.rewrite_forward(LongT5Style.forward)
    assert count == 3
    for cross in (True, False):
        for name, x in _inputs(torch.float16).items():
            ref, out = LongT5Style.forward(module, x, cross), fn(module, x, cross)
            assert torch.equal(torch.nan_to_num(ref), torch.nan_to_num(out)), (cross, name)
    assert branchless.rewrite_forward(MaybeBound.forward) is None
    # the `isinf(h).any()` select is clamp_if_inf with no bound when nothing is found
    gm, rewrites = _selects_after_the_clamp_pass(LongT5Style, device)
    assert rewrites["OverflowSelect"] == 3


class Indexes(torch.nn.Module):
    def forward(self, x):
        if torch.isnan(x).any():
            x = x - torch.nonzero(torch.isnan(x))[0, 0]  # raises on a finite x if it always ran
        return x


def test_a_body_that_could_raise_when_always_run_stays_as_written():
    assert branchless.rewrite_forward(Indexes.forward) is None
