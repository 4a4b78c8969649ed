"""ProphetNet's generate() through optimize() on the CPU (interpreter), and what it found: a frame
that several layers run after a graph break must keep the guards on its layer's plain attributes.

ProphetNet's n-gram self-attention checks its position ids with a tensor-valued check
(`torch_compilable_check`), which breaks the graph inside every decoder layer, so each layer's
attention forward became a frame of its own. optimize() dropped Dynamo's guards on module state
(guards.py), among them `self.layer_idx == 0`, so decoder layer 1 ran layer 0's trace and appended
its keys to layer 0's cache: the position check failed at the first decode step (a RuntimeError
out of generate()). Tiny config: 2+2 layers, hidden 32, two heads, ngram 2."""

import collections

import torch
import transformers

import transfuse
from tests.helpers import rel_err
from transfuse.guards import module_guard_filter


def test_prophetnet_generate_matches_eager():
    """Greedy (with its logits, prompt and decode steps) and beam search equal eager's, with padding
    in the encoder input, and every call ran compiled (the model was not handed back to eager)."""
    config = transformers.ProphetNetConfig(
        vocab_size=97, hidden_size=32, encoder_ffn_dim=48, decoder_ffn_dim=48, num_encoder_layers=2,
        num_decoder_layers=2, num_encoder_attention_heads=2, num_decoder_attention_heads=2, ngram=2,
        max_position_embeddings=32, num_buckets=8, relative_max_distance=16,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, decoder_start_token_id=0)
    torch.manual_seed(0)
    model = transformers.ProphetNetForConditionalGeneration(config).eval()
    ids = torch.randint(3, 97, (4, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # padding in the encoder input
    greedy = dict(max_new_tokens=2, do_sample=False, output_logits=True, return_dict_in_generate=True)
    beam = dict(max_new_tokens=2, do_sample=False, num_beams=2)
    # greedy on 4 rows, beam search on 2 rows x 2 beams: the decoder's frames see the same batch and
    # run greedy's traces (with their layer guards) instead of tracing every layer frame again
    with torch.no_grad():
        ref_greedy = model.generate(ids, attention_mask=mask, **greedy)
        ref_beam = model.generate(ids[:2], attention_mask=mask[:2], **beam)
        transfuse.optimize(model)
        out_greedy = model.generate(ids, attention_mask=mask, **greedy)
        out_beam = model.generate(ids[:2], attention_mask=mask[:2], **beam)
    assert torch.equal(out_greedy.sequences, ref_greedy.sequences)
    assert len(out_greedy.logits) == len(ref_greedy.logits) == 2
    for out, ref in zip(out_greedy.logits, ref_greedy.logits):
        assert rel_err(out, ref) < 1e-5
    assert torch.equal(out_beam, ref_beam)
    state = model._transfuse_state
    assert state.eager_reason is None and state.backend.records


class _ScaledLayer(torch.nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.scale = scale  # a plain Python attribute, different in each layer

    def forward(self, x):
        h = self.linear(x)
        torch._dynamo.graph_break()  # Python the trace cannot follow: this forward becomes a frame
        return h * self.scale


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_ScaledLayer(s) for s in (1.0, -2.0, 3.0))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _optimized_calls_match_eager(model: torch.nn.Module) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        ref = model(x)
        transfuse.optimize(model)
        outs = [model(x) for _ in range(2)]
    for out in outs:
        assert rel_err(out, ref) < 1e-5


def test_layers_that_differ_in_a_plain_attribute_after_a_graph_break():
    """The bug without Hugging Face: three layers whose forward breaks the graph and then reads its
    own `scale`. With the guard on `self.scale` dropped, every layer ran layer 0's trace (scale 1.0)
    and the output was silently wrong."""
    torch.manual_seed(0)
    _optimized_calls_match_eager(_Stack().eval())


class _Half(_ScaledLayer):
    pass


class _OtherHalf(_ScaledLayer):
    pass


class _TwoHalves(torch.nn.Module):
    """An encoder and a decoder of their own classes (each the only one of its class in the model)
    that inherit one forward: one frame for both after the graph break."""

    def __init__(self):
        super().__init__()
        self.first, self.second = _Half(2.0), _OtherHalf(-3.0)

    def forward(self, x):
        return self.second(self.first(x))


def test_modules_of_two_classes_sharing_an_inherited_forward():
    torch.manual_seed(0)
    _optimized_calls_match_eager(_TwoHalves().eval())


def test_module_guards_dropped_only_where_one_module_runs_the_frame():
    """The filter keeps module guards in a layer's frame (three layers may run it) and drops them in
    the model's own frame (ModuleWatch checks that state, and those checks cost every call)."""
    torch.manual_seed(0)
    model = _Stack().eval()
    keep = module_guard_filter(model)
    kept = collections.defaultdict(int)  # type of the frame's `self` -> module guards kept

    def recording(entries):
        result = keep(entries)
        roots = [e.value for e in entries if e.name == "self" and e.has_value]
        for entry, k in zip(entries, result):
            if entry.orig_guard.source.is_unspecialized_nn_module() and k:
                kept[type(roots[0]).__name__ if roots else None] += 1
        return result

    compiled = torch.compile(model.forward, backend="eager", options={"guard_filter_fn": recording})
    with torch.no_grad():
        out = compiled(torch.randn(2, 5, 8))
    assert out.shape == (2, 5, 8)
    assert kept["_Stack"] == 0
    assert kept["_ScaledLayer"] > 0
