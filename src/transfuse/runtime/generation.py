"""generate() with a static KV cache by default, reused across calls.

A decode step over a dynamic cache has a new key length every token: no CUDA graph can be replayed
for it. A static cache has one shape for every step, and the steps write it in place, so the whole
step replays as one CUDA graph. When the user names no cache (`generation_config.cache_implementation`
is None and no cache is passed), optimize() makes generate() use Hugging Face's StaticCache; a
cache the user passes, a `cache_implementation` they set, use_cache=False or
`optimize(model, static_cache=False)` leaves Hugging Face's behaviour alone. Encoder-decoders (T5,
BART) get Hugging Face's EncoderDecoderCache of two static caches, the cross-attention one exactly
the encoder's length (so one cache per batch and encoder length).

Hugging Face builds a new StaticCache in every generate() call; new tensors would mean a new capture
of the decode graph per call (its addresses are baked in). `StaticCacheReuse` keeps one cache per
(batch, dtype, device), sized up to a bucket, and hands it back reset (zeroed in place) to the next
call that fits, so the decode graph captured by the first call is replayed by every later one.
"""

from __future__ import annotations

import collections
import functools
import inspect
import types

import torch

from transfuse.runtime.cuda_graphs import first_line
from transfuse.runtime.decode_loop import DecodeLoop
from transfuse.runtime.generate_masks import masks_for_generate, needs_own_masks
from transfuse.runtime.generation_check import cached_generation_check
from transfuse.runtime.generation_config_memo import GenerationConfigMemo

STATIC = "static"
# Cache lengths are rounded up to a multiple of this, so that calls asking for a few more tokens
# than the last one reuse its cache (and its graphs). Blocks past the current position are fully
# masked, which attention skips from the mask summary: the extra length costs almost nothing.
LENGTH_BUCKET = 256
_PREPARE = "_prepare_static_cache"
_EXPECTED = ["cache_implementation", "batch_size", "max_cache_len", "prefill_chunk_size", "model_kwargs"]


def supports_default_static_cache(model: torch.nn.Module) -> str | None:
    """None when optimize() may give this model a static cache by default, else why not."""
    generation = getattr(model, "generation_config", None)
    if generation is None or not hasattr(model, "generate"):
        return "not a generation model"
    if not getattr(model, "_can_compile_fullgraph", False):
        return "the model does not declare static-cache support (_can_compile_fullgraph)"
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    topk = getattr(config, "index_topk", None)
    if isinstance(topk, int):
        # DeepSeek sparse attention (DeepSeek-V3.2, GLM-MoE-DSA, HY-V4): an indexer scores every slot of
        # the cache, and Hugging Face's own static cache changes the tokens as transfuse's would.
        return (f"its sparse attention keeps the index_topk={topk} best-scored slots of the whole cache, empty ones "
                "included, so a static cache's length would change its answers")
    prepare = getattr(model, _PREPARE, None)
    if prepare is None or list(inspect.signature(prepare).parameters) != _EXPECTED:
        return f"this transformers version has no {_PREPARE}({', '.join(_EXPECTED)})"
    return None


class StaticCacheReuse:
    """Replaces the model's `_prepare_static_cache`: a fitting cache from an earlier call, reset."""

    def __init__(self, model: torch.nn.Module, max_kept: int = 4):
        self.model = model
        self.prepare = getattr(model, _PREPARE)  # Hugging Face's bound method
        self.max_kept = max_kept
        self.caches: collections.OrderedDict = collections.OrderedDict()
        self.reused = 0
        self.created = 0
        self.probed: tuple | str | None = None  # see probe()
        self.values_differ = False  # the probe saw a layer whose values are shaped unlike its keys
        self.windowed = 0  # sliding-window (or chunked) layers given the full length, in the last cache that had any
        self.own_masks = needs_own_masks(model)  # why transfuse builds generate()'s masks, or None

    def __call__(self, cache_implementation, batch_size, max_cache_len, prefill_chunk_size, model_kwargs):
        if cache_implementation != STATIC or prefill_chunk_size is not None:
            return self.prepare(cache_implementation, batch_size, max_cache_len, prefill_chunk_size, model_kwargs)
        # An encoder-decoder's cross-attention cache is exactly the encoder's length (HF sizes it so):
        # one cache per encoder length.
        encoder = model_kwargs.get("encoder_outputs") if self.model.config.is_encoder_decoder else None
        cross = encoder[0].shape[1] if encoder is not None else None
        key = (batch_size, self.model.dtype, self.model.device, cross)
        cache, length = self.caches.get(key, (None, 0))
        if cache is not None and length >= max_cache_len:
            _reset(cache)  # zeroes the tensors in place: same addresses, same graphs
            self.caches.move_to_end(key)
            self.reused += 1
            return cache
        length = -(-max_cache_len // LENGTH_BUCKET) * LENGTH_BUCKET
        # Normal tensors even under torch.inference_mode(): a later call outside it resets them in place.
        with torch.inference_mode(False):
            cache = self.prepare(cache_implementation, batch_size, length, prefill_chunk_size, model_kwargs)
            self.windowed = _full_length_windows(cache, length) or self.windowed
            # Allocated now, not inside the first forward: a prompt that meets an empty cache would be
            # a trace of its own (Dynamo guards on the layers' is_initialized).
            # (Not an encoder-decoder's: its head dim need not be hidden / heads, as T5 v1.1 shows.)
            shape = self.kv_shape() if cross is None else None
            if shape is not None and hasattr(cache, "early_initialization"):
                cache.early_initialization(batch_size=batch_size, num_heads=shape[0], head_dim=shape[1],
                                           dtype=self.model.dtype, device=self.model.device)
            elif cross is not None:
                self._initialize_like_kept(cache, batch_size)
        _keep_addresses_in_beam_search(cache)
        self.caches[key] = (cache, length)
        self.caches.move_to_end(key)
        while len(self.caches) > self.max_kept:
            self.caches.popitem(last=False)
        self.created += 1
        return cache

    def probe(self) -> str | None:
        """Runs the model as written (no transfuse) on two tokens with Hugging Face's own static cache,
        once: the heads and head dim each layer really writes (a config can say otherwise: Falcon's
        multi-query attention keeps one KV head where `_get_static_cache_init_shape` counts
        num_kv_heads), or why the model's forward refuses a static cache (Falcon with ALiBi reads the
        4-D mask a static cache brings as a 2-D one; Hugging Face's own static cache fails the same
        way). Returns that reason, or None when the static cache works."""
        if self.probed is None:
            forward = getattr(self.model.forward, "__wrapped__", self.model.forward)
            device = self.model.device
            try:
                with torch.no_grad():
                    cache = self.prepare(STATIC, 1, 8, None, {})
                    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
                    # The inputs generate() would give the first forward (a static cache turns the
                    # 2-D mask into a 4-D one of the cache's length here).
                    inputs = self.model.prepare_inputs_for_generation(
                        ids, past_key_values=cache, attention_mask=torch.ones_like(ids), use_cache=True,
                        cache_position=torch.arange(2, device=device), is_first_iteration=True)
                    forward(**inputs)
                part = getattr(cache, "self_attention_cache", cache)
                self.probed = _layer_shapes(part) or ()
                self.values_differ = _values_differ(part)
            except Exception as e:  # noqa: BLE001 - the model's own error: it keeps Hugging Face's default cache
                self.probed = f"its forward fails with a static cache ({first_line(e, limit=160)})"
        return self.probed if isinstance(self.probed, str) else None

    def kv_shape(self):
        """(heads, head dim) to allocate a decoder's new cache with: per layer as the probe saw them,
        else the config's guess; None where the probe saw values shaped unlike the keys (MiMo-V2-Flash:
        keys 192 wide, values 128), which early initialization cannot give them: the cache then
        initializes itself from the first forward's keys and values."""
        if self.probed:
            return self.probed
        if self.values_differ:
            return None
        return getattr(self.model, "_get_static_cache_init_shape", lambda: None)()

    def _initialize_like_kept(self, cache, batch_size: int) -> None:
        """An encoder-decoder's new cache allocated now, with the heads and head dims of one that an
        earlier call initialized: a prompt into a fresh (uninitialized) cache is a trace of its own,
        and a reused cache is initialized. The first cache is left to initialize itself: its layers'
        shapes are the attention's to say (T5's head dim need not be d_model / heads)."""
        parts = ("self_attention_cache", "cross_attention_cache")
        for kept, _ in reversed(self.caches.values()):
            shapes = [_layer_shapes(getattr(kept, p, None)) for p in parts]
            if all(shapes):
                break
        else:
            return
        for name, (heads, dims) in zip(parts, shapes):
            part = getattr(cache, name, None)
            if part is None or not hasattr(part, "early_initialization") or len(part.layers) != len(heads):
                return
            # The model's dtype and device now (it may have moved since the kept cache was made).
            part.early_initialization(batch_size=batch_size, num_heads=heads, head_dim=dims,
                                      dtype=self.model.dtype, device=self.model.device)

    def describe(self) -> str:
        if isinstance(self.probed, str):
            return f"Hugging Face's default cache ({self.probed})"
        sizes = ", ".join(f"batch {b} x {n} positions" + (f" (encoder {c})" if c is not None else "")
                          for (b, _, _, c), (_, n) in self.caches.items())
        windows = (f"; its {self.windowed} sliding-window layer(s) keep every position, the window is the mask's"
                   if self.windowed else "")
        masks = f"; {self.own_masks}" if self.own_masks else ""
        return (f"static KV cache by default: {self.created} created, {self.reused} reused" + (f" ({sizes})" if sizes else "")
                + windows + masks)


def _reset(cache) -> None:
    """cache.reset(). Where that is Cache's (every layer's reset) and every layer's is
    CacheLayerMixin's (zero the keys and values, zero cumulative_length), the zeroing is one foreach
    launch instead of two or three per layer: ~0.3 ms less host time per generate() of a 22-layer
    model, spent before the prefill while the GPU waits. Any other cache runs its own reset."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    layers = getattr(cache, "layers", None)
    if (type(cache).reset is not Cache.reset or not layers
            or any(type(layer).reset is not CacheLayerMixin.reset for layer in layers)):
        cache.reset()
        return
    tensors = []
    for layer in layers:
        if layer.is_initialized:
            tensors += [layer.keys, layer.values]
        if hasattr(layer, "cumulative_length"):
            if isinstance(layer.cumulative_length, int):
                layer.cumulative_length = 0
            else:
                tensors.append(layer.cumulative_length)
    if len({t.device for t in tensors}) > 1:
        cache.reset()
    elif tensors:
        torch._foreach_zero_(tensors)


def _full_length_windows(cache, length: int) -> int:
    """Gives the sliding-window (and chunked-attention) layers of a new static cache the full length,
    as the other layers have; returns how many. Hugging Face's windowed static layer counts its
    tokens in a Python int and branches on it (full or not), and Dynamo specialises on that int: every
    decode step was a trace of its own until max_traces handed the model back to eager (Mistral,
    Gemma2, Phi-3 with its 2,047-token window). A full-length layer keeps its length in a tensor. The
    window stays exact: Hugging Face's masks for those layers are built from absolute positions
    (create_sliding_window_causal_mask over the cache's length, offset 0), so the keys outside the
    window are masked, not dropped, and the attention kernel skips the fully masked blocks. Costs
    memory only where the window is shorter than the cache (the layer keeps `length` positions, as
    every full-attention layer of the model already does)."""
    from transformers.cache_utils import StaticLayer

    layers = getattr(getattr(cache, "self_attention_cache", cache), "layers", None)
    if not isinstance(layers, list):
        return 0
    replaced = 0
    for i, layer in enumerate(layers):
        if isinstance(layer, StaticLayer) and layer.is_sliding and not layer.is_initialized:
            layers[i] = StaticLayer(max_cache_len=length)
            replaced += 1
    return replaced


def _layer_shapes(part):
    """(heads per layer, head dim per layer) of a static cache whose layers are all initialized with
    keys and values of one shape, else None."""
    layers = list(getattr(part, "layers", None) or ())
    # Early initialization gives keys and values one shape: not for attention whose values differ
    # (multi-head latent attention's head dims).
    if not layers or not all(getattr(layer, "is_initialized", False) and getattr(layer, "keys", None) is not None
                             and layer.keys.dim() == 4 and getattr(layer, "values", None) is not None
                             and layer.values.shape == layer.keys.shape for layer in layers):
        return None
    return [layer.keys.shape[1] for layer in layers], [layer.keys.shape[-1] for layer in layers]


def _values_differ(part) -> bool:
    """Whether a layer of this initialized static cache holds values shaped unlike its keys."""
    return any(getattr(layer, "keys", None) is not None and getattr(layer, "values", None) is not None
               and layer.values.shape != layer.keys.shape for layer in getattr(part, "layers", None) or ())


def _reorder_in_place(layer, beam_idx: torch.Tensor) -> None:
    """Hugging Face's CacheLayerMixin.reorder_cache, writing the chosen beams' rows back into the same
    tensors: HF binds new ones every beam step, and a new address is a new CUDA-graph capture per step."""
    if layer.get_seq_length() > 0:
        index = beam_idx.to(layer.keys.device)
        layer.keys.copy_(layer.keys.index_select(0, index))
        layer.values.copy_(layer.values.index_select(0, index))


def _keep_addresses_in_beam_search(cache) -> None:
    """Beam search reorders the cache every step; for the layers whose reorder is the plain one,
    reorder in place (the caches transfuse creates keep their tensors for life)."""
    from transformers.cache_utils import CacheLayerMixin

    parts = [getattr(cache, "self_attention_cache", None), getattr(cache, "cross_attention_cache", None)]
    for part in [p for p in parts if p is not None] or [cache]:
        for layer in getattr(part, "layers", ()):
            if getattr(type(layer), "reorder_cache", None) is CacheLayerMixin.reorder_cache:
                layer.reorder_cache = types.MethodType(_reorder_in_place, layer)


def install(model: torch.nn.Module, state) -> None:
    """Makes generate() use a reused static cache unless the user chose a cache (see module doc)."""
    reason = supports_default_static_cache(model)
    if reason is not None:
        state.static_cache_reason = reason
        return
    reuse = StaticCacheReuse(model)
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        with state.lock:  # the static cache and the decode loop's buffers are the model's (runtime/call_lock.py)
            if _user_named_no_cache(model, args, kwargs) and (model.config.is_encoder_decoder or reuse.probe() is None):
                kwargs["cache_implementation"] = STATIC
            return original(*args, **kwargs)

    state.static_cache = reuse
    state.generate = generate
    setattr(model, _PREPARE, reuse)
    if reuse.own_masks is not None:  # Llama 4 on transformers 5.17 (runtime/generate_masks.py)
        model.create_masks_for_generate = masks_for_generate
    model.generate = generate
    _install_decode_loop(model, state, reuse)


def _install_decode_loop(model: torch.nn.Module, state, reuse: StaticCacheReuse) -> None:
    """generate() looks `_sample` up on the model's class, not the instance: the model gets a
    subclass of its own class (same name and module) whose `_sample` is transfuse's decode loop;
    restore() puts the original class back."""
    cls = type(model)
    hf_sample = getattr(cls, "_sample", None)
    if hf_sample is None:
        return
    on_cuda = next(model.parameters()).device.type == "cuda"
    loop = DecodeLoop(model, hf_sample, lambda: [c for c, _ in reuse.caches.values()], state,
                      use_graphs=on_cuda and state.backend.options.get("cuda_graphs", True))

    def _sample(self, *args, **kwargs):
        own = getattr(getattr(self, "_transfuse_state", None), "decode_loop", None)
        if own is None:
            return hf_sample(self, *args, **kwargs)
        return own(self, *args, **kwargs)

    members = {"_sample": _sample, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
               "_transfuse_class_of": cls}
    hf_prepare_config = getattr(cls, "_prepare_generation_config", None)
    if hf_prepare_config is not None:
        memo = state.generation_config_memo = GenerationConfigMemo(hf_prepare_config)

        def _prepare_generation_config(self, generation_config=None, **kwargs):
            # The legacy-options check without its per-call default config (runtime/generation_check.py)
            with cached_generation_check(self.config if generation_config is None else None):
                if generation_config is None and memo.applies:
                    return memo(self, kwargs)  # the merge with model.generation_config kept (generation_config_memo.py)
                return hf_prepare_config(self, generation_config, **kwargs)

        members["_prepare_generation_config"] = _prepare_generation_config
    subclass = type(cls.__name__, (cls,), members)
    model.__class__ = subclass
    state.decode_loop = loop


def _user_named_no_cache(model, args, kwargs) -> bool:
    config = kwargs.get("generation_config") or (args[1] if len(args) > 1 else None) or model.generation_config
    return (kwargs.get("past_key_values") is None and kwargs.get("cache_implementation") is None
            and getattr(config, "cache_implementation", None) is None
            and kwargs.get("use_cache", getattr(config, "use_cache", True)) is not False)


def unpatch(model: torch.nn.Module, state) -> None:
    """Takes off `model` what install() set on it, each piece only if it is still install()'s: the
    decode loop's subclass, the cache hook, generate() and the masks hook. Changes nothing else, so
    it also cleans a deep copy of an optimized model (capture._strip_copy), whose cache hook is None:
    transfuse's own objects are not copied."""
    original_class = type(model).__dict__.get("_transfuse_class_of")
    if original_class is not None:
        model.__class__ = original_class
    d = model.__dict__
    if _PREPARE in d and (d[_PREPARE] is None or d[_PREPARE] is state.static_cache):
        del d[_PREPARE]
    for name, owned in (("generate", getattr(state, "generate", None)), ("create_masks_for_generate", masks_for_generate)):
        if owned is not None and d.get(name) is owned:
            del d[name]


def uninstall(model: torch.nn.Module, state) -> None:
    """restore()'s part: unpatch(), then the reused caches and the decode loop let go."""
    reuse = state.static_cache
    if reuse is None:
        return
    unpatch(model, state)
    state.decode_loop = None
    reuse.caches.clear()
    state.static_cache = None
