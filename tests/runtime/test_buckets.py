"""Bucketed padding (runtime/buckets.py + passes/padding.py) on the CPU: the padded run gives exactly
what eager gives, for random shapes and masks, without a new Dynamo trace per shape; what cannot be
padded is refused by meaning and runs at its exact size."""

import dataclasses
import random

import pytest
import torch

import transfuse
from tests.helpers import rel_err
from tests.models.registry import REGISTRY
from transfuse.runtime.buckets import BucketPolicy, PaddedRunner

# The registry's BERT at hidden 32, two heads, whatever the registry's size: padding, not BERT's size,
# is under test here.
BERT = dataclasses.replace(REGISTRY[0], config=dict(REGISTRY[0].config, hidden_size=32, num_attention_heads=2,
                                                    intermediate_size=48))


def _runners(model):
    return [r for b in model._transfuse_state.backends for r in b.runners]


def _buckets(runner, name: str) -> set:
    """(batch, seq) of every bucket used, read through the runner's names of its symbols."""
    names = [runner.plan.names[s] for s in runner.symbols]
    out = set()
    for key in runner.stats:
        sizes = dict(zip(names, key))
        out.add((sizes[f"{name}.size(0)"], sizes[f"{name}.size(1)"]))
    return out


def _traces(model) -> int:
    return sum(len(b.records) for b in model._transfuse_state.backends)


def _random_inputs(vocab, batch, seq, rng, with_mask=True):
    ids = torch.randint(3, vocab, (batch, seq))
    if not with_mask:
        return {"input_ids": ids}
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row in range(batch):
        mask[row, rng.randint(1, seq):] = 0 if rng.random() < 0.5 else 1  # random right padding
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_random_shapes_match_eager_with_one_trace(attn):
    model = BERT.build(attn)
    transfuse.optimize(model)
    rng = random.Random(0)
    shapes = [(2, 9), (3, 17), (1, 5), (4, 30), (3, 3), (2, 64)]
    for batch, seq in shapes:
        inputs = _random_inputs(model.config.vocab_size, batch, seq, rng)
        with torch.no_grad():
            out = model(**inputs)
            ref = model.forward.__wrapped__(**inputs)
        assert out.last_hidden_state.shape == (batch, seq, 32)
        assert rel_err(out.last_hidden_state, ref.last_hidden_state) < 1e-5
        assert rel_err(out.pooler_output, ref.pooler_output) < 1e-5
    assert _traces(model) == 1, "a shape inside the buckets traced again"
    (runner,) = _runners(model)
    assert isinstance(runner, PaddedRunner)
    padded = [key for key, st in runner.stats.items() if st.padded > st.real]
    assert padded, "no call was padded: the test would not notice a padding bug"
    assert _buckets(runner, "input_ids") == {(2, 16), (4, 32), (1, 8), (4, 4), (2, 64)}


def test_no_mask_input_padded_keys_are_ignored():
    """Without an attention_mask nothing in the graph masks the padded keys but key_len."""
    model = BERT.build("sdpa")
    transfuse.optimize(model)
    rng = random.Random(1)
    for batch, seq in [(2, 11), (3, 6)]:
        inputs = _random_inputs(model.config.vocab_size, batch, seq, rng, with_mask=False)
        with torch.no_grad():
            out = model(**inputs).last_hidden_state
            ref = model.forward.__wrapped__(**inputs).last_hidden_state
        assert rel_err(out, ref) < 1e-5


def test_nan_in_one_request_does_not_leak_into_the_next():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 2, 8).unbind(2)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)

    model = Net().eval()
    transfuse.optimize(model)
    bad = torch.randn(2, 15, 16)
    bad[:, 12:] = float("nan")
    with torch.no_grad():
        model(bad)
        x = torch.randn(2, 11, 16)
        out = model(x)
        ref = model.forward.__wrapped__(x)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-5


class _LastToken(torch.nn.Module):
    """Reads the sequence from its end and takes a softmax over it: padding the sequence would
    change both, so the sequence must run at its exact size (the batch may still be padded)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.proj(x)
        return h[:, -1] + torch.softmax(h, dim=1).sum(1)


def test_refused_dimension_runs_exact_and_is_reported():
    model = _LastToken().eval()
    transfuse.optimize(model)
    for batch, seq in [(3, 5), (5, 7), (3, 6)]:
        x = torch.randn(batch, seq, 8)
        with torch.no_grad():
            out = model(x)
            ref = model.forward.__wrapped__(x)
        assert rel_err(out, ref) < 1e-5
    text = transfuse.report(model)
    assert "BucketPadding" in text and "x.size(1)" in text and "from its end" in text
    (runner,) = _runners(model)
    assert _buckets(runner, "x") == {(4, 5), (8, 7), (4, 6)}  # batch padded, seq exact


def test_beyond_the_largest_bucket_runs_exact():
    model = BERT.build("sdpa")
    transfuse.optimize(model, buckets=[8, 16])
    inputs = _random_inputs(model.config.vocab_size, 2, 20, random.Random(2))
    with torch.no_grad():
        out = model(**inputs).last_hidden_state
        ref = model.forward.__wrapped__(**inputs).last_hidden_state
    assert rel_err(out, ref) < 1e-5
    (runner,) = _runners(model)
    assert runner.exact_calls == 1
    assert "beyond the largest bucket" in transfuse.report(model)


def test_warmup_traces_before_the_first_request():
    model = BERT.build("sdpa")
    transfuse.optimize(model, warmup=[(1, 16), (2, 16)])
    assert _traces(model) == 1  # one symbolic trace, batch 1 included
    (runner,) = _runners(model)
    assert _buckets(runner, "input_ids") == {(1, 16), (2, 16)}
    with torch.no_grad():
        for batch, seq in [(1, 7), (3, 12), (2, 16)]:
            model(**_random_inputs(model.config.vocab_size, batch, seq, random.Random(3)))
    assert _traces(model) == 1


def test_bad_options_are_one_line_errors():
    with pytest.raises(ValueError, match="buckets"):
        transfuse.optimize(BERT.build("sdpa"), buckets=[])
    with pytest.raises(transfuse.TransfuseError, match="max_graphs"):
        transfuse.optimize(BERT.build("sdpa"), max_graphs=0)
    with pytest.raises(transfuse.TransfuseError, match="warm-up"):
        transfuse.optimize(_LastToken().eval(), warmup=[(2, 8)])


def test_bucket_policy():
    powers = BucketPolicy()
    assert [powers(n, None) for n in (1, 2, 3, 9, 16, 17)] == [1, 2, 4, 16, 16, 32]
    assert powers(300, 512) == 512 and powers(300, 400) == 400  # never past the guards' bound
    listed = BucketPolicy([64, 16, 128])
    assert [listed(n, None) for n in (1, 16, 17, 128)] == [16, 16, 64, 128]
    assert listed(129, None) is None


def _family(name):
    import transformers

    if name == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=97, n_positions=64,
                                      bos_token_id=1, eos_token_id=2)
        return transformers.GPT2Model, cfg, {"use_cache": False}
    if name == "llama":
        cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                       intermediate_size=48, vocab_size=97, max_position_embeddings=64)
        return transformers.LlamaModel, cfg, {"use_cache": False}
    cfg = transformers.T5Config(d_model=32, d_kv=16, d_ff=48, num_layers=2, num_heads=2, vocab_size=97)
    return transformers.T5EncoderModel, cfg, {}


@pytest.mark.parametrize("family", ["gpt2", "llama", "t5"])
def test_other_families_padded_and_exact(family):
    """Causal decoders (prefill) and T5's relative-position bias: padded to buckets, same outputs,
    left padding in the mask included."""
    cls, cfg, extra = _family(family)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    transfuse.optimize(model)
    for batch, seq in [(2, 9), (3, 13)]:
        ids = torch.randint(3, 97, (batch, seq))
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[-1, :2] = 0
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, **extra)[0]
            ref = model.forward.__wrapped__(input_ids=ids, attention_mask=mask, **extra)[0]
        keep = mask.bool()
        assert rel_err(out[keep], ref[keep]) < 1e-5
    (runner,) = _runners(model)
    assert isinstance(runner, PaddedRunner) and _buckets(runner, "input_ids") == {(2, 16), (4, 16)}
    assert "BucketPadding" not in transfuse.report(model)


class _FakeGraph:
    """Stands in for a captured CUDA graph on the CPU: static input buffers, static outputs that a
    replay overwrites in place, as the real one does."""

    captures = 0

    def __init__(self, fn, args, static_indices, pool, checked=()):
        _FakeGraph.captures += 1
        self.inputs = [(i, a.clone()) for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in static_indices]
        self.args = list(args)
        for i, buf in self.inputs:
            self.args[i] = buf
        self.fn = fn
        self.outputs = fn(*self.args)
        self.graph = self

    def still_valid(self, args):
        return True

    def replay(self):
        for old, new in zip(self.outputs, self.fn(*self.args)):
            if isinstance(old, torch.Tensor):
                old.copy_(new)


def test_graph_mode_routing_on_cpu(monkeypatch):
    """The GPU path of the runner (static buffers filled in their corner, key lengths written, outputs
    sliced and cloned, a returned tensor never overwritten) with the capture faked on the CPU."""
    import transfuse.runtime.buckets as buckets
    from transfuse.runtime import precompile

    # The dry runs of every bucket (tests/runtime/test_precompile.py) would run each bucket's
    # forward through the interpreter here: ~9 min on the 2-core CI machine for nothing under test.
    monkeypatch.setenv(precompile.ENV, "0")
    model = BERT.build("sdpa")
    transfuse.optimize(model)
    rng = random.Random(4)
    with torch.no_grad():
        model(**_random_inputs(model.config.vocab_size, 2, 9, rng))
    (plain,) = _runners(model)
    monkeypatch.setattr(buckets, "_Captured", _FakeGraph)
    _FakeGraph.captures = 0
    graphed = PaddedRunner(plain.fn, plain.plan, plain.static_indices, plain.pool, plain.policy, True, 2)
    model._transfuse_state.backend.runners[0] = graphed  # not used by the compiled closure; keep report sane
    first = None
    for batch, seq in [(2, 9), (3, 12), (2, 9), (4, 30), (2, 16)]:
        inputs = _random_inputs(model.config.vocab_size, batch, seq, rng)
        args = _graph_args(plain, model, inputs)
        with torch.no_grad():
            out = graphed(*args)
            ref = model.forward.__wrapped__(**inputs)
        assert rel_err(out[0], ref.last_hidden_state) < 1e-5
        if first is None:
            first, kept = out[0], out[0].clone()
    assert torch.equal(first, kept)  # later replays wrote into the static outputs, not into ours
    assert _FakeGraph.captures == 3 and graphed.evicted == 1  # buckets (2,16), (4,16), (4,32); cap 2


class _ArgsSeen(Exception):
    pass


def _graph_args(runner, model, inputs):
    """The graph's inputs for these model inputs, as Dynamo would pass them: captured by calling the
    optimized model once with a spy in place of the runner. The spy stops the call there: the run
    itself (every kernel through the interpreter) would only repeat the one under test."""
    seen = {}
    original = runner.__class__.__call__

    def spy(self, *args):
        seen["args"] = args
        raise _ArgsSeen

    runner.__class__.__call__ = spy
    try:
        with torch.no_grad(), pytest.raises(_ArgsSeen):
            model(**inputs)
    finally:
        runner.__class__.__call__ = original
    return seen["args"]


def test_vision_batch_padded_and_clip_eos_pooling_refused():
    """ViT: the convolution keeps samples apart, so its batch is padded. CLIP's text model pools at
    the argmax of input_ids (its EOS token): a reduction over the sequence, which must not be padded."""
    import transformers

    torch.manual_seed(0)
    vit = transformers.ViTModel(transformers.ViTConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                                       intermediate_size=96, image_size=32, patch_size=8)).eval()
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=96, vocab_size=97,
        max_position_embeddings=32, bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    transfuse.optimize(vit)
    transfuse.optimize(clip)
    with torch.no_grad():
        for batch in (2, 3):
            x = torch.randn(batch, 3, 32, 32)
            assert rel_err(vit(pixel_values=x).pooler_output, vit.forward.__wrapped__(pixel_values=x).pooler_output) < 1e-5
            ids = torch.randint(3, 97, (batch, 5 + batch))
            assert rel_err(clip(input_ids=ids).pooler_output, clip.forward.__wrapped__(input_ids=ids).pooler_output) < 1e-5
    (runner,) = _runners(vit)
    assert {key for key in runner.stats} == {(2,), (4,)}
    text = transfuse.report(clip)
    assert "argmax" in text and "reduces over a padded dimension" in text


def test_keyword_arguments_of_a_contraction_are_read():
    """BLOOM's ALiBi: `alibi.baddbmm(batch1=q, batch2=k, ...)` passes its operands by keyword; the
    padding analysis read positions only and crashed the compile."""

    class Scores(torch.nn.Module):
        def forward(self, bias, a, b):
            return bias.baddbmm(batch1=a, batch2=b, beta=1.0, alpha=0.5)

    model = Scores()
    transfuse.optimize(model)
    for n in (5, 9):
        x = (torch.randn(2, n, n), torch.randn(2, n, 3), torch.randn(2, 3, n))
        with torch.no_grad():
            assert rel_err(model(*x), Scores()(*x)) < 1e-6
    assert "contracts over a padded dimension" in transfuse.report(model)


class _DataDependent(torch.nn.Module):
    """A size Dynamo learns from data (`.item()`: an unbacked symbol), tied to the input's sizes
    only by runtime assertions (GPT-Neo's causal-mask slice was one on torch 2.11)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, lengths):
        h = self.proj(x)
        k = lengths.max().item()
        torch._check(k >= 1)
        torch._check(k <= x.shape[1])
        return h[:, :k] * 2


def test_data_dependent_size_runs_exact_and_is_reported():
    model = _DataDependent().eval()
    transfuse.optimize(model)
    with torch._dynamo.config.patch(capture_scalar_outputs=True), torch.no_grad():
        for batch, seq in [(3, 5), (5, 7), (3, 6)]:
            x, lengths = torch.randn(batch, seq, 8), torch.tensor([seq - 1, 2])
            assert rel_err(model(x, lengths), model.forward.__wrapped__(x, lengths)) < 1e-5
    assert "data-dependent size" in transfuse.report(model)
    assert all(not r.plan.paddable for r in _runners(model) if isinstance(r, PaddedRunner))


class _ShiftedPositions(torch.nn.Module):
    """Learned positions looked up at arange(seq) + 2 (OPT's and BART's offset) in a 20-row table."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(20, 8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device) + 2
        return self.proj(x + self.table(positions))


def test_a_position_table_bounds_the_buckets():
    """Positions counted along the sequence and looked up in a table: padded positions must stay in
    the table (on a GPU, one past its end is a device-side assert), so the buckets stop at its last
    row: seq 17 pads to 18 (20 rows, offset 2), not to 32."""
    model = _ShiftedPositions().eval()
    transfuse.optimize(model)
    for batch, seq in [(2, 13), (3, 17), (2, 18)]:
        x = torch.randn(batch, seq, 8)
        with torch.no_grad():
            assert rel_err(model(x), model.forward.__wrapped__(x)) < 1e-5
    (runner,) = _runners(model)
    assert _buckets(runner, "x") == {(2, 16), (4, 18), (2, 18)}


def test_gpt2_positions_bound_the_buckets():
    """GPT-2 counts its positions with an arange (no guard ties the length to its 24-row table):
    seq 17 pads to 24, the table's length, and gives eager's outputs."""
    import transformers

    cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=24, vocab_size=97)
    torch.manual_seed(0)
    model = transformers.GPT2Model(cfg).eval()
    transfuse.optimize(model)
    for batch, seq in [(2, 9), (3, 17)]:
        ids = torch.randint(3, 97, (batch, seq))
        with torch.no_grad():
            out = model(input_ids=ids).last_hidden_state
            ref = model.forward.__wrapped__(input_ids=ids).last_hidden_state
        assert rel_err(out, ref) < 1e-5
    (runner,) = _runners(model)
    assert _buckets(runner, "input_ids") == {(2, 16), (4, 24)}


def test_bert_position_buffers_bound_the_buckets():
    """BERT slices its position and token-type buffers (40 entries here) to the input's length;
    padded past 40 the slices stop growing and the token types no longer expand to the input
    (it raised). Seq 33 pads to 40, not 64, and gives eager's outputs."""
    import transformers

    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48,
                                  max_position_embeddings=40, vocab_size=97)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    transfuse.optimize(model)
    for batch, seq in [(2, 9), (3, 33)]:
        inputs = _random_inputs(97, batch, seq, random.Random(seq))
        with torch.no_grad():
            out = model(**inputs).last_hidden_state
            ref = model.forward.__wrapped__(**inputs).last_hidden_state
        keep = inputs["attention_mask"].bool()
        assert rel_err(out[keep], ref[keep]) < 1e-5
    (runner,) = _runners(model)
    assert _buckets(runner, "input_ids") == {(2, 16), (4, 40)}


class _Router(torch.nn.Module):
    """A mixture-of-experts router, written the way Mixtral's is: top-k of the softmax, the kept
    weights renormalised in place (`/=`: operator.itruediv), experts ordered by `sort()` with its
    default (last) dimension. Every step stays within a token's own experts."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(8, 4)

    def forward(self, x, order_tokens: bool = False):
        probs = self.gate(x).softmax(dim=-1)
        top, index = probs.topk(2)
        top /= top.sum(dim=-1, keepdim=True)
        ordered, _ = index.sort() if not order_tokens else index.sort(dim=1)
        return top * 2, ordered


@pytest.mark.parametrize("order_tokens", [False, True])
def test_a_router_pads_unless_it_sorts_across_tokens(order_tokens):
    model = _Router().eval()
    reference = _Router().eval()
    reference.load_state_dict(model.state_dict())
    transfuse.optimize(model)
    for batch, seq in [(3, 5), (5, 7), (3, 6)]:
        x = torch.randn(batch, seq, 8)
        with torch.no_grad():
            for ours, expected in zip(model(x, order_tokens), reference(x, order_tokens)):
                assert torch.equal(ours, expected) if ours.dtype == torch.long else rel_err(ours, expected) < 1e-6
    (runner,) = _runners(model)
    text = transfuse.report(model)
    if order_tokens:
        assert "sort ('sort') reduces over a padded dimension" in text and "x.size(1)" in text
        assert {seq for _, seq in _buckets(runner, "x")} == {5, 6, 7}  # the sequence runs at its exact size
    else:
        assert "BucketPadding" not in text, text
        assert _buckets(runner, "x") == {(4, 8), (8, 8)}  # batch and sequence padded


def test_key_lengths_written_when_they_change_and_always_inside_a_callers_graph():
    """The key-length buffer is filled only when the length changes; lengths that come back, change
    inside one bucket, or follow a call made for a caller's own graph (whose replays write the buffer
    behind the runner's back) still mask exactly the padded keys."""
    from transfuse.runtime.cuda_graphs import part_of_callers_graph

    model = BERT.build("sdpa")
    transfuse.optimize(model)
    rng = random.Random(2)
    seqs = [9, 9, 12, 9, 12, 12, 11]  # one bucket (16) throughout
    for i, seq in enumerate(seqs):
        inputs = _random_inputs(model.config.vocab_size, 2, seq, rng, with_mask=False)
        with torch.no_grad():
            if i == 4:
                with part_of_callers_graph():
                    out = model(**inputs).last_hidden_state
            else:
                out = model(**inputs).last_hidden_state
            ref = model.forward.__wrapped__(**inputs).last_hidden_state
        assert rel_err(out, ref) < 1e-5, f"call {i} (seq {seq})"
        (runner,) = _runners(model)
        assert (runner._key_len_written is None) == (i >= 4)
    assert _traces(model) == 1


class _AddressCheckingGraph(_FakeGraph):
    """_FakeGraph with the real capture's address rule: it checks its static inputs' addresses at
    every lookup, except those its runner's parameter check covers (`checked`)."""

    def __init__(self, fn, args, static_indices, pool, checked=()):
        super().__init__(fn, args, static_indices, pool)
        self.watched = [i for i in static_indices if i not in set(checked)]
        self.ptrs = [args[i].data_ptr() for i in self.watched]

    def still_valid(self, args):
        return [args[i].data_ptr() for i in self.watched] == self.ptrs


def test_a_moved_parameter_recaptures_the_graph(monkeypatch):
    """Through the optimized model, graphs faked on the CPU: the backend checks the parameters'
    addresses once per call and its runner's graphs rely on that check (GraphCache.param_check). A
    repeated shape replays; a parameter whose storage moved (`p.data = ...`, as load_state_dict's
    copy never does but a user's assignment does) is captured again, and the call gives eager's
    result with the new values."""
    import transfuse.backend as backend
    import transfuse.runtime.buckets as buckets
    from transfuse.runtime import precompile

    monkeypatch.setenv(precompile.ENV, "0")
    monkeypatch.setattr(backend, "_on_cuda", lambda example_inputs: True)
    monkeypatch.setattr(backend, "_graph_safe", lambda gm, example_inputs: True)
    monkeypatch.setattr(buckets, "_Captured", _AddressCheckingGraph)
    _FakeGraph.captures = 0
    model = BERT.build("sdpa")
    transfuse.optimize(model)
    inputs = _random_inputs(model.config.vocab_size, 2, 9, random.Random(5))
    with torch.no_grad():
        model(**inputs)
        model(**inputs)
        assert _FakeGraph.captures == 1  # captured at its first call, replayed at the second
        norm = model.encoder.layer[1].output.LayerNorm
        norm.weight.data = norm.weight.data * 1.5 + 0.25
        out = model(**inputs).last_hidden_state
        ref = model.forward.__wrapped__(**inputs).last_hidden_state
    assert _FakeGraph.captures == 2
    assert rel_err(out, ref) < 1e-5
    (runner,) = _runners(model)
    assert runner.param_check is not None and runner.param_check.epoch == 2
