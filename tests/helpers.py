"""Shared test helpers: optimize a module and read back what the passes did."""

from __future__ import annotations

from collections import Counter

import torch

import transfuse


def optimize_and_run(model: torch.nn.Module, *args, **kwargs):
    """(output, rewrites Counter, rejections list) of the optimized model on these inputs."""
    transfuse.optimize(model)
    with torch.no_grad():
        out = model(*args, **kwargs)
    records = model._transfuse_state.backend.records
    rewrites: Counter = Counter()
    for r in records:
        rewrites.update(r.rewrites)
    rejections = [rej for r in records for rej in r.rejections]
    return out, rewrites, rejections


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
