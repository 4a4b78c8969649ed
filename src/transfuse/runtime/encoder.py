"""generate() on an encoder-decoder (T5, BART) runs the encoder through `model.get_encoder()`, not
through the model's forward that optimize() compiled: without this module the encoder ran as
Hugging Face wrote it, eagerly (t5-base, 128 tokens, batch 1: 12 of the 15 ms to the first token,
H100, bench/results/*-profile-t5-b1-session7.log).

install() compiles the encoder on its own for generate(): a small module that calls the encoder is
optimized with the model's options (so the encoder gets its own trace, passes, bucketed CUDA
graphs), and generate()'s `_prepare_encoder_decoder_kwargs_for_generation` sees that module as the
encoder while it runs. The model's own forward is untouched: a plain model(...) call still traces
the encoder inside its one graph, with no graph break. Hugging Face filters the encoder's keyword
arguments by its forward's signature; the module reports the encoder's own signature, so the same
arguments reach it. If the compiled encoder raises, that generate() and every later one run the
encoder as Hugging Face wrote it, with a warning, and the report says why.
"""

from __future__ import annotations

import logging

import torch

from transfuse.runtime.cuda_graphs import first_line

log = logging.getLogger("transfuse")
_PREPARE = "_prepare_encoder_decoder_kwargs_for_generation"


class EncoderCall(torch.nn.Module):
    """Calls `encoder`: the module optimize() compiles for generate()."""

    def __init__(self, encoder: torch.nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, *args, **kwargs):
        return self.encoder(*args, **kwargs)


def install(model: torch.nn.Module, state, options: dict) -> None:
    """Compiles the encoder of an encoder-decoder model for generate(); nothing for other models."""
    config = getattr(model, "config", None)
    if not getattr(config, "is_encoder_decoder", False) or not hasattr(model, _PREPARE):
        return
    get_encoder = getattr(model, "get_encoder", None)
    encoder = get_encoder() if get_encoder is not None else None
    if not isinstance(encoder, torch.nn.Module) or encoder is model:
        return
    from transfuse.capture import optimize

    call = optimize(EncoderCall(encoder), **options, static_cache=False)
    call.forward.__wrapped__ = encoder.forward  # Hugging Face reads the encoder's signature
    prepare = getattr(model, _PREPARE)

    def prepare_with_compiled_encoder(*args, **kwargs):
        if state.encoder_failure is not None:
            return prepare(*args, **kwargs)
        model.__dict__["get_encoder"] = lambda *a, **k: call
        traced_before = len(_records(call))
        try:
            prepared = prepare(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the encoder as written still gives the right answer
            state.encoder_failure = f"its compiled run failed: {first_line(e, limit=160)}"
            log.warning("transfuse: generate()'s encoder runs as written from now on: %s", state.encoder_failure)
        else:
            pieces = len(_records(call))
            if traced_before == 0 and pieces > 1:
                # Its first trace broke (BART's fp16 guard, `if not torch.isfinite(h).all()`, is Python
                # control flow on a GPU value): each layer's forward is then a frame of its own. That
                # ran at 48 ms to the first token (bench/results/*-bart-base-session9-warmup.md), since
                # found to be one trace shared by every layer, re-captured at each call and with the
                # layers' weights mixed (runtime/instances.py fixed it). With that fix the compiled
                # pieces were neither clearly faster nor slower than the encoder as written (bart-base,
                # H100: TTFT 7.7 / 9.2 ms at batch 1 / 8 against 12.4 / 7.4,
                # *-bart-base-session10-encoder-{asis,compile}.log), so the as-written encoder stays.
                state.encoder_failure = (f"its trace breaks into {pieces} graphs (Python control flow on a "
                                         "tensor's value), slower than running it as written")
                log.info("transfuse: generate()'s encoder runs as written from now on: %s", state.encoder_failure)
            return prepared
        finally:
            model.__dict__.pop("get_encoder", None)
        return prepare(*args, **kwargs)

    model.__dict__[_PREPARE] = prepare_with_compiled_encoder
    state.encoder_prepare = prepare_with_compiled_encoder  # what unpatch() takes off (by identity)
    state.encoder_call = call
    state.encoder_failure = None


def unpatch(model: torch.nn.Module, state) -> None:
    """Takes install()'s encoder hook off `model` if it is still there (also on a deep copy of an
    optimized model, which shares the hook's function object: capture._strip_copy)."""
    prepare = getattr(state, "encoder_prepare", None)
    if prepare is not None and model.__dict__.get(_PREPARE) is prepare:
        del model.__dict__[_PREPARE]


def uninstall(model: torch.nn.Module, state) -> None:
    """restore()'s part: unpatch(), then the compiled encoder restored and let go."""
    call = getattr(state, "encoder_call", None)
    if call is None:
        return
    from transfuse.capture import restore

    unpatch(model, state)
    restore(call)
    state.encoder_call = None


def describe(state) -> str:
    """One line for the report: the encoder's graphs, or '' when there is none."""
    call = getattr(state, "encoder_call", None)
    if call is None:
        return ""
    if state.encoder_failure is not None:
        return f"the encoder runs as Hugging Face wrote it ({state.encoder_failure})"
    records = _records(call)
    rewrites = sum(sum(r.rewrites.values()) for r in records)
    return f"the encoder runs compiled on its own: {len(records)} graph(s), {rewrites} rewrite(s)"


def _records(call) -> list:
    return [r for b in call._transfuse_state.backends for r in b.records]
