"""Tuning decisions on disk, so that a second process starts without re-measuring.

One JSON file per (GPU, torch, triton, CUDA, transfuse kernel sources): a different GPU or a changed
kernel never reads another's choices. The directory is $TRANSFUSE_CACHE_DIR, else
~/.cache/transfuse. Triton keeps its compiled binaries in its own on-disk cache ($TRITON_CACHE_DIR).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
import triton


def cache_dir() -> Path:
    return Path(os.environ.get("TRANSFUSE_CACHE_DIR") or Path.home() / ".cache" / "transfuse")


def identity(device: torch.device, sources: list, *extra: str) -> str:
    """A hash of what a cached decision depends on: the GPU, the versions, the kernel sources (and
    `extra`): another GPU or a changed kernel never reads another's entry."""
    props = torch.cuda.get_device_properties(device)
    ident = "|".join([props.name, f"{props.major}.{props.minor}", torch.__version__, triton.__version__,
                      str(torch.version.cuda), *extra] + [Path(s).read_text() for s in sources])
    return hashlib.sha256(ident.encode()).hexdigest()


def cache_file(name: str, device: torch.device, sources: list[str]) -> Path:
    return cache_dir() / f"{name}-{identity(device, sources)[:16]}.json"


def load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # absent or half-written by a killed process: measure again


def save(path: Path, data: dict) -> None:
    """Atomic replace: a reader never sees a partial file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home directory costs a re-measurement, nothing else
