"""Precompile on the GPU (runtime/precompile.py), each process fresh with its own empty caches: the
second bucket's capture compiles every bucket's Triton kernels, a later bucket (within the dry-run
rows) compiles nothing more, outputs stay within fp16's own error, and a second process with the same
caches dry-runs nothing."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

_SCRIPT = textwrap.dedent("""
    import copy, json, os, random, sys
    from pathlib import Path
    import torch
    from transformers import BertConfig, BertModel
    import transfuse

    def kernels_compiled():
        return sum(1 for d in Path(os.environ["TRITON_CACHE_DIR"]).iterdir() if any(d.glob("*.cubin")))

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    torch.manual_seed(0)
    m32 = BertModel(BertConfig(num_hidden_layers=2)).cuda().eval()
    m16 = copy.deepcopy(m32).half()
    opt = transfuse.optimize(copy.deepcopy(m16))
    rng = random.Random(0)
    out = {"errors": []}
    for i, (batch, seq) in enumerate([(2, 9), (8, 100), (3, 20), (1, 300), (5, 250)]):
        ids = torch.randint(0, 30522, (batch, seq), device="cuda")
        mask = torch.ones_like(ids)
        mask[0, rng.randint(1, seq):] = 0
        with torch.no_grad():
            got = opt(input_ids=ids, attention_mask=mask).last_hidden_state
            ref = m32(input_ids=ids, attention_mask=mask).last_hidden_state
            half = m16(input_ids=ids, attention_mask=mask).last_hidden_state
        out["errors"].append((rel(got, ref), rel(half, ref)))
        if i == 1:
            out["after_second"] = kernels_compiled()
    runners = [r for b in opt._transfuse_state.backends for r in b.runners]
    out["after_all"] = kernels_compiled()
    # The first runner's (batch 2 and up); batch 1 is a trace of its own (torch's SDPA checks).
    out["precompiled"] = [r.precompiled for r in runners if getattr(r, "precompiled", None)]
    out["first_buckets"] = [r.precompiled_first for r in runners if getattr(r, "precompiled_first", None)]
    out["report"] = transfuse.report(opt)
    print(json.dumps(out))
""")


def _run(env) -> dict:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_precompile_then_no_compile_per_bucket(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), TRANSFUSE_CACHE_DIR=str(tmp_path / "transfuse"),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # this process's path: transfuse from src/ too
    first = _run(env)
    done, *later = first["precompiled"]
    assert not done["skipped"] and done["failed"] == 0, (first["report"], done)
    assert done["buckets"] >= 20 and done["compiles"] > 0
    if sys.platform == "linux":  # compiles in forked processes, their binaries loaded by threads here
        assert done["how"].endswith("forked processes"), done
    assert first["after_second"] >= done["compiles"] > 0
    later += first["first_buckets"][1:]  # another trace's first bucket (batch 1) may compile its own
    assert first["first_buckets"][0]["compiles"] > 0 and first["first_buckets"][0]["buckets"] == 1
    assert first["after_all"] == first["after_second"] + sum(p["compiles"] for p in later), \
        "a later bucket compiled a kernel the precompile missed"
    for ours, torch_fp16 in first["errors"]:
        assert ours <= 2 * torch_fp16 + 1e-3
    assert "precompile at the second bucket" in first["report"]

    second = _run(env)
    assert all(p["skipped"] for p in second["precompiled"]), "a second process dry-ran buckets an earlier one compiled"
    assert second["after_all"] == first["after_all"]
    for ours, torch_fp16 in second["errors"]:
        assert ours <= 2 * torch_fp16 + 1e-3
