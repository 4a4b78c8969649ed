"""`optimize(model, warmup=[...])`: trace and capture the listed shapes now, with a progress bar, so
that the first real request does not pay for them."""

from __future__ import annotations

import inspect

import torch

from transfuse.backend import TransfuseError


def run_warmup(model: torch.nn.Module, shapes: list) -> None:
    # Largest (batch, seq) first: Dynamo traces sizes above 1 symbolically, so a batch of 1 warmed
    # up after a larger one reuses that trace instead of fixing the batch at 1 in a trace of its own.
    pairs = sorted((s for s in shapes if _is_pair(s)), reverse=True)
    others = [s for s in shapes if not _is_pair(s)]
    examples = [_example(model, s) for s in pairs + others]  # all validated before any work
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm comes with transformers; without it, no bar
        def tqdm(items, **_):
            return items
    with torch.no_grad():
        for args, kwargs in tqdm(examples, desc="transfuse warm-up", unit="shape"):
            model(*args, **kwargs)
    if any(p.is_cuda for p in model.parameters()):
        torch.cuda.synchronize()


def _is_pair(shape) -> bool:
    return isinstance(shape, (tuple, list)) and len(shape) == 2 and all(isinstance(x, int) for x in shape)


def _example(model: torch.nn.Module, shape) -> tuple[tuple, dict]:
    """(args, kwargs) for one warm-up call: a (batch, seq) pair becomes Hugging Face style
    `input_ids` (+ `attention_mask` when the forward takes one); a dict is keyword arguments and a
    tuple of tensors positional ones, used as given."""
    if isinstance(shape, dict):
        return (), shape
    if isinstance(shape, (tuple, list)) and len(shape) == 2 and all(isinstance(x, int) for x in shape):
        batch, seq = shape
        if batch < 1 or seq < 1:
            raise TransfuseError(f"transfuse warm-up: (batch, seq) must be positive, got {shape}")
        name = getattr(model, "main_input_name", None)
        if name != "input_ids" or getattr(getattr(model, "config", None), "vocab_size", None) is None:
            raise TransfuseError(
                "transfuse warm-up: (batch, seq) pairs need a Hugging Face model that takes input_ids; "
                "for other models pass example inputs, e.g. warmup=[{'x': torch.randn(...)}]"
            )
        device = next(model.parameters()).device
        kwargs = {"input_ids": torch.zeros(batch, seq, dtype=torch.long, device=device)}
        forward = getattr(model.forward, "__wrapped__", model.forward)
        if "attention_mask" in inspect.signature(forward).parameters:
            kwargs["attention_mask"] = torch.ones(batch, seq, dtype=torch.long, device=device)
        return (), kwargs
    if isinstance(shape, tuple) and all(isinstance(x, torch.Tensor) for x in shape):
        return shape, {}
    raise TransfuseError(
        f"transfuse warm-up: cannot build inputs from {shape!r}; give (batch, seq) pairs, dicts of "
        "keyword arguments or tuples of tensors"
    )
