"""Shared test helpers: optimize a module and read back what the passes did."""

from __future__ import annotations

from collections import Counter

import torch

import transfuse


def rewrite_counts(model: torch.nn.Module) -> Counter:
    """How many times each rewrite matched, over every graph of the optimized model's backend."""
    counts: Counter = Counter()
    for record in model._transfuse_state.backend.records:
        counts.update(record.rewrites)
    return counts


def graph_records(model: torch.nn.Module) -> list:
    """Every graph's record over all of the optimized model's backends (one per compile: a model
    recompiled after a change has several)."""
    return [r for b in model._transfuse_state.backends for r in b.records]


def optimize_and_run(model: torch.nn.Module, *args, **kwargs):
    """(output, rewrites Counter, rejections list) of the optimized model on these inputs."""
    transfuse.optimize(model)
    with torch.no_grad():
        out = model(*args, **kwargs)
    rejections = [rej for r in model._transfuse_state.backend.records for rej in r.rejections]
    return out, rewrite_counts(model), rejections


def eager_then_optimized(model: torch.nn.Module, *args, **kwargs):
    """(eager output, optimized output, rewrites, rejections): the model run as it is, then through
    optimize_and_run on the same inputs."""
    with torch.no_grad():
        ref = model(*args, **kwargs)
    out, rewrites, rejections = optimize_and_run(model, *args, **kwargs)
    return ref, out, rewrites, rejections


def tiny_bert_twins():
    """A tiny BERT (sdpa attention), an eager copy with the same weights, and input ids."""
    from tests.models.registry import REGISTRY

    model = REGISTRY[0].build("sdpa")
    eager = REGISTRY[0].build("sdpa")
    eager.load_state_dict(model.state_dict())
    return model, eager, torch.randint(3, 97, (2, 7))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
