"""generate()'s greedy and sampling loop, each decode step replayed as one CUDA graph.

Hugging Face's `_sample` spends milliseconds of Python per token around the forward: it prepares
inputs, builds the 4-D mask, runs the logits processors, concatenates the growing `input_ids` and
waits for the GPU to decide whether to stop. On a 1B model the forward itself takes less than that,
so the GPU idles most of each step whatever the kernels do.

`DecodeLoop` runs the same algorithm on fixed buffers instead:

    tokens (B, 1)   the token fed to the next step       mask (B, L)  HF's 2-D mask, zero-padded to
    positions (B,1) its position id                                   the static cache's length L
    column (1,)     the mask column of the next token     out (B, max_new)  the tokens chosen
    unfinished (B,) rows not yet past EOS                 done (max_new,)   all rows finished, per step

One step = inputs -> forward (transfuse's compiled forward) -> logits processors -> argmax or
multinomial -> EOS bookkeeping -> buffers advanced in place. Every operand has a fixed address,
so the whole step is captured once per (batch, cache, sampling settings) and replayed for every
later token of every later call.

Inside that graph every launch costs about a microsecond whatever it does, so the step keeps to few
besides the model's: the inputs are the buffers themselves, not prepare_inputs_for_generation's
fresh clones and 4-D mask (runtime/step_inputs.py, where that is exact); greedy takes the argmax of
the logits in their own dtype (no fp32 copy) with kernels/argmax.py; and the bookkeeping (EOS,
padding of finished rows, out/done, the counters, the next mask column and position) is one kernel,
kernels/decode_step.py, which also finishes the argmax. A greedy Llama step launches two kernels of
its own besides the model's; written with torch ops it was thirty (bench/decode_step_census.py).

The host looks at the GPU only every CHECK_EVERY steps, through a non-blocking copy of "all rows
finished", and the steps run past the end (at most a few) are cut off using `done`: the returned
tokens are exactly those of Hugging Face's loop. When sampling, the device's generator is set back to
its offset after the last token kept, so the random numbers drawn are Hugging Face's too.

Encoder-decoders (T5, BART): the decoder has no 2-D mask or position ids to advance; the inputs that
hold for the whole call (encoder states, the encoder's mask) are copied into the key's own buffers at
the start of each call, so the captured step reads this call's values.

Prefill stays Hugging Face's (`_prefill`, through transfuse's bucketed graphs). The first call of a
key runs one decode step eagerly (Triton compiles, GEMM choices are measured: never inside capture),
then captures. On CPU, or without CUDA graphs, the same step runs eagerly every token.

Anything the loop does not implement runs Hugging Face's own `_sample`, and the report says why:
a cache transfuse did not create, streamers, output_scores/logits/attentions/hidden_states,
synced GPUs, assisted decoding, chunked prefill, model inputs that grow per token (token_type_ids,
inputs_embeds), stopping criteria other than max length and EOS, logits processors that read the
generated ids (repetition penalty, n-gram blocking, ...). Min-length and forced BOS/EOS processors,
which read only the length, are reimplemented on a length tensor.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math

import torch

from transfuse.kernels.argmax import argmax_partials
from transfuse.kernels.decode_step import decode_step_fwd
from transfuse.runtime.cuda_graphs import AddressCheck, first_line, part_of_callers_graph
from transfuse.runtime.static_buffers import load, static_buffer
from transfuse.runtime.step_inputs import StepInputs, fixed_inputs

log = logging.getLogger("transfuse")

CHECK_EVERY = 4  # steps between two looks at "all rows finished" (each look is non-blocking)
MAX_GRAPHS = 8

# Processors that only read the scores: captured as they are.
_SCORE_ONLY = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
               "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper")
# Processors that read only the length of the generated ids: reimplemented on a length tensor.
_MIN_LENGTH = ("MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor")
# Processors that force given tokens at one length (BART's forced EOS at the last position, mBART's
# forced BOS): reimplemented on the length tensor too.
_FORCED = ("ForcedEOSTokenLogitsProcessor", "ForcedBOSTokenLogitsProcessor")
_STOPPING = ("MaxLengthCriteria", "EosTokenCriteria")
# Model inputs that Hugging Face's loop changes per token; the loop keeps them in its buffers.
_PER_STEP = ("attention_mask", "position_ids", "past_key_values")
_REFUSED_INPUTS = ("token_type_ids", "mm_token_type_ids", "inputs_embeds")


def _describe_processor(p) -> tuple:
    """What a captured processor's behaviour depends on: its type and its plain settings."""
    items = sorted((k, v) for k, v in vars(p).items() if isinstance(v, (bool, int, float, str, type(None))))
    return (type(p).__name__, tuple(items))


class _Buffers:
    """The step's state, at fixed addresses for the graph that reads and writes it."""

    def __init__(self, batch: int, length: int, max_new: int, vocab: int, min_lengths: int, device, forced: int = 0):
        long = dict(dtype=torch.long, device=device)
        self.tokens = torch.zeros(batch, 1, **long)
        self.positions = torch.zeros(batch, 1, **long)
        self.mask = torch.zeros(batch, length, **long)
        self.column = torch.zeros(1, **long)
        self.step = torch.zeros(1, **long)     # index into out/done of the next choice
        self.cur_len = torch.zeros((), **long)  # input_ids.shape[-1] in Hugging Face's loop
        self.out = torch.zeros(batch, max_new, **long)
        self.done = torch.zeros(max_new, dtype=torch.bool, device=device)
        self.all_done = torch.zeros((), dtype=torch.bool, device=device)
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.pad = torch.zeros((), **long)
        # Per min-length processor: its threshold on cur_len and the vocabulary entries it blocks.
        self.min_len = torch.zeros(max(1, min_lengths), **long)
        self.min_len_blocked = torch.zeros(max(1, min_lengths), vocab, dtype=torch.bool, device=device)
        # Per forcing processor: the cur_len at which it applies and the scores it forces there (0 for
        # the tokens it allows, -inf elsewhere: made once per call, not every step).
        self.forced_len = torch.zeros(max(1, forced), **long)
        self.forced_scores = torch.zeros(max(1, forced), vocab, dtype=torch.float32, device=device)


class _Entry:
    def __init__(self, buffers: _Buffers, eos: torch.Tensor | None):
        self.buffers = buffers
        self.eos = eos
        self.graph = None
        self.backend = None  # the backend whose kernels and merged weights the graph replays
        self.params: AddressCheck | None = None
        self.no_graph_reason: str | None = None
        self.constant: dict = {}  # the model inputs that hold for the whole call, at fixed addresses
        self.step_inputs: StepInputs | None = None  # set by the key's first step (runtime/step_inputs.py)
        self.token_sets = None  # the token ids _reset last wrote into the min-length and forced-token buffers


class DecodeLoop:
    """Replaces Hugging Face's `_sample` for one model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, hf_sample, owned_caches, state, use_graphs: bool):
        self.model = model
        self.hf_sample = hf_sample  # the class's unbound _sample
        self.owned_caches = owned_caches  # callable: the caches transfuse created (their tensors never move)
        self.state = state  # transfuse's _State: its current backend owns the kernels' merged weights
        self.use_graphs = use_graphs
        self.entries: collections.OrderedDict = collections.OrderedDict()
        self.calls = 0
        self.steps_replayed = 0
        self.steps_eager = 0
        self.steps_discarded = 0
        self.captures = 0
        self.left_to_hf: collections.Counter = collections.Counter()

    # ---------------------------------------------------------------------------------------------
    # Whether this call is one the loop reproduces exactly

    def unsupported(self, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer,
                    model_kwargs) -> str | None:
        config = generation_config
        if synced_gpus:
            return "synced_gpus"
        if streamer is not None:
            return "a streamer (every token must reach the host as it comes)"
        for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
            if getattr(config, name, False) and config.return_dict_in_generate:
                return f"{name}=True"
        if getattr(config, "is_assistant", False):
            return "assisted generation"
        if getattr(config, "prefill_chunk_size", None) is not None:
            return "prefill_chunk_size"
        if self.model.training:
            return "the model is in training mode"
        if self.state.eager_reason is not None:
            return "the model runs as it was (see 'left to eager')"
        cache = model_kwargs.get("past_key_values")
        if cache is None or not any(cache is c for c in self.owned_caches()):
            return "a KV cache transfuse did not create (its tensors may move between calls)"
        for key in _REFUSED_INPUTS:
            if model_kwargs.get(key) is not None:
                return f"{key} (an input that changes every token)"
        if self.model.config.is_encoder_decoder:
            for key in ("decoder_attention_mask", "decoder_position_ids", "decoder_inputs_embeds"):
                if model_kwargs.get(key) is not None:
                    return f"{key} (an input that changes every token)"
        else:
            if model_kwargs.get("attention_mask") is None or model_kwargs["attention_mask"].dim() != 2:
                return "no 2-D attention mask"
            if model_kwargs.get("position_ids") is not None and model_kwargs["position_ids"].dim() != 2:
                return "position ids that are not 2-D"
        for p in logits_processor:
            if type(p).__name__ not in _SCORE_ONLY + _MIN_LENGTH + _FORCED:
                return f"logits processor {type(p).__name__}"
        for c in stopping_criteria:
            if type(c).__name__ not in _STOPPING:
                return f"stopping criterion {type(c).__name__}"
        return None

    # ---------------------------------------------------------------------------------------------

    def __call__(self, model, input_ids, logits_processor, stopping_criteria, generation_config,
                 synced_gpus=False, streamer=None, **model_kwargs):
        _check_positions(model.config, input_ids.shape[-1], stopping_criteria.max_length)
        reason = self.unsupported(logits_processor, stopping_criteria, generation_config, synced_gpus, streamer,
                                  model_kwargs)
        if reason is not None:
            self.left_to_hf[reason] += 1
            return self.hf_sample(model, input_ids, logits_processor, stopping_criteria, generation_config,
                                  synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
        self.calls += 1
        return self._generate(input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)

    def _generate(self, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs):
        from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

        model = self.model
        seq2seq = bool(model.config.is_encoder_decoder)
        batch, prompt_len = input_ids.shape
        max_new = stopping_criteria.max_length - prompt_len
        cache = model_kwargs["past_key_values"]
        eos_ids = sorted({int(i) for c in stopping_criteria for i in _ids(getattr(c, "eos_token_id", None))})
        do_sample = bool(generation_config.do_sample)
        exact_stop = bool(generation_config.return_dict_in_generate)  # the cache is returned: no extra steps

        # Read before the prefill: processors keep their token ids in device tensors, and reading
        # those after it would wait for it.
        token_ids = _processor_token_ids(logits_processor)
        outputs = model._prefill(input_ids, generation_config, model_kwargs)
        model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder=seq2seq)
        # A copy: the prefill's outputs may hold every position's logits. (In their own dtype: _choose
        # widens them to fp32 where Hugging Face's processors or softmax need it.)
        logits = outputs.logits[:, -1].to(copy=True, device=input_ids.device)
        del outputs

        # The 2-D mask is indexed by absolute position: as long as the cache where the cache holds
        # every position generated (BLOOM's preparation pads the mask to exactly the cache's length,
        # so it may not be longer), else (a sliding-window cache, shorter than the sequence) as long
        # as every position generated, rounded up.
        # (An encoder-decoder's decoder has no 2-D mask: its "attention_mask" is the encoder's, constant.)
        if seq2seq:
            length = 1
        else:
            length = cache.get_max_length()
            if length < stopping_criteria.max_length:
                length = _round_up(stopping_criteria.max_length)
        per_step = ("past_key_values",) if seq2seq else _PER_STEP
        constant = {k: v for k, v in model_kwargs.items() if k not in per_step}
        key = (batch, id(cache), length, _round_up(max_new), do_sample, tuple(eos_ids),
               tuple(_describe_processor(p) for p in logits_processor), _signature(constant))
        entry = self.entries.get(key)
        if entry is None:
            mins = sum(type(p).__name__ in _MIN_LENGTH for p in logits_processor)
            forced = sum(type(p).__name__ in _FORCED for p in logits_processor)
            with torch.inference_mode(False):  # written in place by later calls, inside inference mode or not
                buffers = _Buffers(batch, length, _round_up(max_new), logits.shape[-1], mins, input_ids.device, forced)
                eos = torch.tensor(eos_ids, dtype=torch.long, device=input_ids.device) if eos_ids else None
                entry = _Entry(buffers, eos)
                entry.constant = _static_copy(constant)  # per-call tensors (encoder states) at fixed addresses
            self.entries[key] = entry
            while len(self.entries) > MAX_GRAPHS:
                self.entries.popitem(last=False)
        self.entries.move_to_end(key)
        if entry.graph is not None and (entry.backend is not self.state.backend
                                        or not entry.params.same(self._params())):
            entry.graph = None  # parameters moved or the model changed (a new backend): capture again
        b = entry.buffers
        _copy_into(entry.constant, constant)
        constant = entry.constant
        self._reset(b, entry, model_kwargs, logits_processor, generation_config, prompt_len, seq2seq, token_ids)
        if entry.step_inputs is not None and not seq2seq:
            entry.step_inputs.reset(b.mask)

        def choose(logits, advance=None):
            self._choose(logits, b, entry.eos, logits_processor, do_sample, advance)

        per_token = {} if seq2seq else dict(attention_mask=b.mask, position_ids=b.positions)

        def step():
            fixed = entry.step_inputs
            if fixed is None or fixed.inputs is None:
                inputs = model.prepare_inputs_for_generation(
                    b.tokens, next_sequence_length=1, past_key_values=cache, **per_token, **constant)
                if fixed is None:  # the key's first step (eager): may the later ones skip the preparation?
                    passed = [cache, *per_token.values(), *constant.values()]
                    fixed = entry.step_inputs = fixed_inputs(model, inputs, b.tokens, passed,
                                                             None if seq2seq else b.mask)
                    # The same tensors as every later step from this first one on: Hugging Face's
                    # are made inside the caller's inference mode, the loop's outside it, and Dynamo
                    # guards on that difference (one more trace of the same step).
                    inputs = fixed.inputs if fixed.inputs is not None else inputs
            else:
                inputs = fixed.inputs
            out = model(**inputs, return_dict=True)
            # The next token's mask column: in the 4-D mask the step feeds, else in the 2-D one.
            choose(out.logits[:, -1], None if seq2seq else fixed.mask if fixed.mask is not None else b.mask)

        choose(logits)  # the prefill's token
        chosen = 1
        # Sampling draws from the device's generator every step, the steps run past the end too:
        # its offset after each token (a host value, no sync) lets the loop hand back the state
        # Hugging Face's loop leaves, so the caller's next random numbers are the same.
        rng = _device_generator(input_ids.device) if do_sample else None
        offsets = [rng.get_offset()] if rng is not None else None
        # The loop looks at "all rows finished" only from the first length at which an EOS can be chosen.
        no_stop_before = _first_stop_length(eos_ids, logits_processor, token_ids[0])
        pending = collections.deque()
        stopped = False
        with getattr(model, "_optimize_model_for_decode", contextlib.nullcontext)():
            while chosen < max_new and not stopped:
                self._run_step(entry, step)
                chosen += 1
                if offsets is not None:
                    offsets.append(rng.get_offset())
                if entry.eos is None:
                    continue
                if prompt_len + chosen - 1 < no_stop_before:
                    continue  # no row can have chosen EOS yet: nothing to look at
                if exact_stop or input_ids.device.type != "cuda":
                    stopped = bool(b.all_done)  # a sync per step, as Hugging Face's loop does
                elif chosen % CHECK_EVERY == 0:
                    pending.append(_Flag(b.all_done))
                    while pending and pending[0].ready():
                        stopped = stopped or pending.popleft().value()
        # The steps taken after every row finished chose only padding: drop them, as HF never ran them.
        done = b.done[:chosen].nonzero()
        used = int(done[0, 0]) + 1 if len(done) else chosen
        self.steps_discarded += chosen - used
        if offsets is not None and used < chosen:
            rng.set_offset(offsets[used - 1])
        sequences = torch.cat([input_ids, b.out[:, :used]], dim=-1)
        if generation_config.return_dict_in_generate:
            output = GenerateEncoderDecoderOutput if seq2seq else GenerateDecoderOnlyOutput
            return output(sequences=sequences, past_key_values=model_kwargs["past_key_values"])
        return sequences

    # ---------------------------------------------------------------------------------------------

    def _reset(self, b: _Buffers, entry: _Entry, model_kwargs, logits_processor, generation_config, prompt_len,
               seq2seq: bool, token_ids):
        if not seq2seq:
            mask = model_kwargs["attention_mask"]  # prompt + the prefill's token
            n = mask.shape[1]
            b.mask.zero_()
            b.mask[:, :n].copy_(mask)
            b.column.fill_(n)
            positions = model_kwargs.get("position_ids")
            if positions is not None:
                b.positions.copy_(positions[:, -1:])
            else:  # the model derives positions from the cache; they are not read
                b.positions.fill_(n - 1)
        # out, done and all_done need no reset: every entry read back is written by this call's steps.
        b.step.zero_()
        b.cur_len.fill_(prompt_len)
        b.unfinished.fill_(True)
        pad = generation_config._pad_token_tensor
        if isinstance(pad, torch.Tensor):  # a device copy: int(pad) would wait for the prefill
            b.pad.copy_(pad.reshape(-1)[0])
        else:
            b.pad.fill_(int(pad) if pad is not None else 0)
        # Which token ids each min-length / forced-token processor blocks or forces: fixed for an
        # entry's processors in practice, and written through Python-list indices (a host-to-device
        # copy that waits for the prefill), so written again only when they change.
        min_len = [p for p in logits_processor if type(p).__name__ in _MIN_LENGTH]
        forced = [p for p in logits_processor if type(p).__name__ in _FORCED]
        blocked_ids, forced_ids = token_ids
        blocked = [[j for j in ids if 0 <= j < b.min_len_blocked.shape[1]] for ids in blocked_ids]
        forced_ids = [[j for j in ids if 0 <= j < b.forced_scores.shape[1]] for ids in forced_ids]
        # fill_ with a Python number is a kernel argument; `b.min_len[i] = n` would copy a CPU scalar,
        # and that copy waits for the prefill (1.2 ms of host time per generate(), H200).
        for i, p in enumerate(forced):
            b.forced_len[i].fill_(p.max_length - 1 if type(p).__name__ == "ForcedEOSTokenLogitsProcessor" else 1)
        for i, p in enumerate(min_len):
            b.min_len[i].fill_(_min_length_threshold(p))
        written = (blocked, forced_ids)
        if entry.token_sets != written:
            if min_len:
                b.min_len_blocked.zero_()
            for i, ids in enumerate(blocked):
                b.min_len_blocked[i, ids] = True
            if forced:
                b.forced_scores.fill_(-math.inf)
            for i, ids in enumerate(forced_ids):
                b.forced_scores[i, ids] = 0.0
            entry.token_sets = written

    def _choose(self, logits, b: _Buffers, eos, logits_processor, do_sample: bool, advance=None) -> None:
        """Hugging Face's token choice on the step's logits (B, vocab), written into the buffers; with
        `advance` (the mask the step fed), also the next token's mask column and position."""
        names = [type(p).__name__ for p in logits_processor]
        if not do_sample and names and all(n in _MIN_LENGTH for n in names):
            # Greedy with min-length processors only (what min_new_tokens adds): the argmax kernel blocks
            # the ids itself, in one launch instead of a cast and a few masking kernels per processor.
            n = len(names)
            source = dict(partials=argmax_partials(logits, b.min_len_blocked[:n], b.min_len[:n], b.cur_len))
            self._finish_choice(b, eos, source, advance)
            return
        scores = logits
        if do_sample or len(logits_processor):
            scores = logits.to(dtype=torch.float32)  # Hugging Face's processors and softmax see fp32 scores
        i = f = 0
        for p in logits_processor:
            if type(p).__name__ in _MIN_LENGTH:
                block = b.min_len_blocked[i] & (b.cur_len < b.min_len[i])
                scores = scores.masked_fill(block, -math.inf)
                i += 1
            elif type(p).__name__ in _FORCED:
                # HF: at that length every score is -inf but the forced tokens', which are 0.
                scores = torch.where(b.cur_len == b.forced_len[f], b.forced_scores[f], scores)
                f += 1
            else:
                scores = p(None, scores)
        if do_sample:
            source = dict(chosen=torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1))
        else:
            # Greedy: the argmax of the logits in their own dtype is the fp32 scores' (fp32 holds fp16
            # and bf16 exactly), so no cast; its last step runs in the bookkeeping kernel.
            source = dict(partials=argmax_partials(scores))
        self._finish_choice(b, eos, source, advance)

    @staticmethod
    def _finish_choice(b: _Buffers, eos, source: dict, advance) -> None:
        """The bookkeeping kernel: EOS, padding, out/done, counters, next mask column and position."""
        if eos is not None:
            source.update(pad=b.pad, eos=eos)
        if advance is not None:
            source.update(mask=advance.view(advance.shape[0], -1), column=b.column, positions=b.positions)
        decode_step_fwd(tokens=b.tokens, step=b.step, cur_len=b.cur_len, out=b.out, done=b.done,
                        all_done=b.all_done, unfinished=b.unfinished, **source)

    def _run_step(self, entry: _Entry, step) -> None:
        if entry.graph is not None:  # still valid: checked at the start of the call
            entry.graph.replay()
            self.steps_replayed += 1
            return
        own_graph = self.use_graphs and entry.no_graph_reason is None
        # A step about to be captured whole: the forward's runner captures nothing of its own. (A step
        # that cannot be captured lets the runner replay the forward's graph, the next best thing.)
        with part_of_callers_graph() if own_graph else contextlib.nullcontext():
            step()
        self.steps_eager += 1
        if own_graph:
            self._capture(entry, step)

    def _capture(self, entry: _Entry, step) -> None:
        """Captures one step after its first eager run (kernels compiled, GEMM choices measured)."""
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize()
            pool = self.state.backend.pool
            with torch.cuda.graph(graph, pool=pool.get(), stream=pool.stream()), part_of_callers_graph():
                step()
        except Exception as e:  # noqa: BLE001 - a step that cannot be captured still runs, eagerly
            entry.no_graph_reason = first_line(e, limit=160)
            log.warning("transfuse: the decode step runs without a CUDA graph: %s", entry.no_graph_reason)
            return
        self.captures += 1
        self.state.backend.pool.graphs_captured += 1
        entry.graph = graph
        entry.backend = self.state.backend
        params = self._params()
        entry.params = AddressCheck(params, range(len(params)))

    def _params(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), *self.model.buffers()]

    def describe(self) -> str:
        if not self.calls and not self.left_to_hf:
            return ""
        text = (f"decode loop: {self.calls} call(s), {self.steps_replayed} step(s) replayed from "
                f"{self.captures} graph(s), {self.steps_eager} eager, {self.steps_discarded} run past the end "
                f"and dropped")
        reasons = [e.no_graph_reason for e in self.entries.values() if e.no_graph_reason]
        if reasons:
            text += f"; without a graph: {reasons[-1]}"
        prepared = [e.step_inputs.reason for e in self.entries.values() if e.step_inputs and e.step_inputs.reason]
        if prepared:
            text += f"\n    inputs prepared by Hugging Face every step: {prepared[-1]}"
        for reason, n in self.left_to_hf.most_common():
            text += f"\n    left to Hugging Face's loop x{n}: {reason}"
        return text


def _signature(value):
    """What a captured step depends on in a constant model input: shapes and dtypes of tensors, the
    values of everything else (a new value, a new graph)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device)
    if isinstance(value, dict):  # also Hugging Face's ModelOutput (encoder_outputs)
        return (type(value).__name__, tuple((k, _signature(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_signature(v) for v in value))
    return repr(value)


def _static_copy(value):
    """The same structure with every tensor replaced by a new one of its shape and strides."""
    if isinstance(value, torch.Tensor):
        return static_buffer(value)
    if isinstance(value, dict):
        return type(value)(**{k: _static_copy(v) for k, v in value.items()}) if type(value) is not dict \
            else {k: _static_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_static_copy(v) for v in value)
    return value


def _copy_into(static, value) -> None:
    """This call's tensors into the entry's (same structure: equal _signature)."""
    if isinstance(value, torch.Tensor):
        load(static, value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _copy_into(static[k], v)
    elif isinstance(value, (list, tuple)):
        for s_, v in zip(static, value):
            _copy_into(s_, v)


def _check_positions(config, prompt_len: int, max_length: int | None) -> None:
    """Positions past the model's are an index error (learned positions: GPT-2, on a GPU a
    device-side assert that ends the process) or rotary angles the model never saw: refused."""
    if hasattr(config, "relative_attention_num_buckets"):
        return  # relative positions (T5): no table to run past
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(limit, int) and max_length is not None and max_length > limit:
        raise ValueError(
            f"transfuse: the prompt ({prompt_len} tokens) plus the tokens to generate make {max_length} positions, "
            f"more than the model's {limit} (config.max_position_embeddings); shorten the prompt or lower "
            f"max_new_tokens to at most {max(0, limit - prompt_len)}")


class _Flag:
    """A non-blocking look at a device boolean: copied to pinned memory, read once the copy is done."""

    def __init__(self, flag: torch.Tensor):
        self.host = torch.empty((), dtype=torch.bool, pin_memory=True)
        self.host.copy_(flag, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def ready(self) -> bool:
        return self.event.query()

    def value(self) -> bool:
        return bool(self.host)


def _processor_token_ids(logits_processor) -> tuple[list[list[int]], list[list[int]]]:
    """The token ids each min-length processor blocks and each forced-token processor forces, in
    the order _reset writes them."""
    blocked = [_ids(p.eos_token_id) for p in logits_processor if type(p).__name__ in _MIN_LENGTH]
    forced = [_ids(p.eos_token_id) if type(p).__name__ == "ForcedEOSTokenLogitsProcessor" else [int(p.bos_token_id)]
              for p in logits_processor if type(p).__name__ in _FORCED]
    return blocked, forced


def _min_length_threshold(p) -> int:
    """The input length (cur_len) below which a min-length processor blocks its ids."""
    if type(p).__name__ == "MinLengthLogitsProcessor":
        return int(p.min_length)
    return int(p.prompt_length_to_skip + p.min_new_tokens)


def _first_stop_length(eos_ids: list[int], logits_processor, blocked_ids: list[list[int]]) -> int:
    """The input length below which no row can choose an EOS token: every EOS id is blocked by
    min-length processors until then (what min_new_tokens does). 0 (no such length) when an EOS id is
    never blocked or a processor forces tokens (a forced EOS overrides the blocking)."""
    if not eos_ids or any(type(p).__name__ in _FORCED for p in logits_processor):
        return 0
    min_len = [p for p in logits_processor if type(p).__name__ in _MIN_LENGTH]
    # each EOS id is blocked until the latest threshold among the processors that block it
    return min(max((_min_length_threshold(p) for p, ids in zip(min_len, blocked_ids) if e in ids), default=0)
               for e in eos_ids)


def _device_generator(device: torch.device):
    """The generator torch.multinomial draws from on a CUDA device; None elsewhere (the loop runs
    no step past the end there)."""
    if device.type != "cuda":
        return None
    return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(i) for i in value.flatten().tolist()]
    if isinstance(value, int):
        return [value]
    return [int(i) for i in value]


def _round_up(n: int) -> int:
    """Buffer lengths for the tokens chosen: a few sizes, so calls of similar length share a graph."""
    return max(64, 1 << max(0, n - 1).bit_length())
