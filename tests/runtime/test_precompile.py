"""Precompile at a runner's second bucket (runtime/precompile.py): which buckets a runner dry-runs, and
that dry runs leave every later call exact. The compiles themselves need a GPU (Triton's interpreter
compiles nothing): tests/runtime/test_precompile_gpu.py."""

import contextlib
import dataclasses
import random

import torch

import transfuse
from tests.helpers import rel_err
from tests.models.registry import REGISTRY
from transfuse.runtime import precompile
from transfuse.runtime.buckets import BucketPolicy

BERT = dataclasses.replace(REGISTRY[0], config=dict(REGISTRY[0].config, hidden_size=32, num_attention_heads=2,
                                                    intermediate_size=48))


def test_bucket_sizes_follow_the_policy_and_the_bound():
    powers = BucketPolicy()
    assert precompile.bucket_sizes(powers, upper=64, cap=16) == [1, 2, 4, 8, 16, 32, 64]
    assert precompile.bucket_sizes(powers, upper=None, cap=16) == [1, 2, 4, 8, 16]
    assert precompile.bucket_sizes(powers, upper=40, cap=16) == [1, 2, 4, 8, 16, 32, 40]  # clamped like calls
    assert precompile.bucket_sizes(powers, upper=64, cap=16, lower=2) == [2, 4, 8, 16, 32, 64]
    listed = BucketPolicy([8, 32, 128])
    assert precompile.bucket_sizes(listed, upper=64, cap=16) == [8, 32, 64]
    assert precompile.bucket_sizes(listed, upper=None, cap=200) == [8, 32, 128]
    assert precompile.grid([[1, 2], [8, 16]], lambda c: c[0] * c[1], 16) == [(1, 8), (1, 16), (2, 8)]


def _record_dry_runs(monkeypatch, runner, run=True):
    """The shape of the first dynamic input (input_ids) at every dry run, with compile_only a plain
    block (nothing compiles on the CPU); `run`: whether the dry runs run the graph."""
    shapes = []
    fn = runner.fn

    def dry(*args):
        shapes.append(tuple(args[runner._first_input].shape))
        return fn(*args) if run else None

    @contextlib.contextmanager
    def compile_only(workers=None, processes=True):
        runner.fn = dry
        try:
            yield {"compiles": 0, "failed": 0, "seconds": 0.0}
        finally:
            runner.fn = fn

    monkeypatch.setattr(precompile, "compile_only", compile_only)
    return shapes


def test_dry_runs_cover_every_bucket_and_leave_calls_exact(monkeypatch):
    model = BERT.build("sdpa")
    transfuse.optimize(model, buckets=[4, 16])
    vocab = model.config.vocab_size
    with torch.no_grad():
        ids = torch.randint(3, vocab, (2, 9))
        model(input_ids=ids, attention_mask=torch.ones_like(ids))  # traces; no capture on the CPU: no precompile
    (runner,) = [r for b in model._transfuse_state.backends for r in b.runners]
    assert runner.precompiled is None
    calls = []
    fn = runner.fn
    runner.fn = lambda *a: (calls.append(a), fn(*a))[1]
    ids = torch.randint(3, vocab, (3, 10))
    with torch.no_grad():
        ref = model.forward.__wrapped__(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    runner.fn = fn
    args = calls[-1]
    real = runner._real_sizes(args)
    target = runner._targets(real)
    shapes = _record_dry_runs(monkeypatch, runner, run=False)  # the interpreter would run them: minutes
    runner._precompile(args, runner._padded_args(args, real, target), target, every_bucket=True)
    assert runner.precompiled["buckets"] == len(shapes) and not runner.precompiled["skipped"]
    assert sorted(shapes) == [(b, s) for b in (4, 16) for s in (4, 16)]
    rng = random.Random(0)
    for batch, seq in [(3, 10), (1, 2)]:
        ids = torch.randint(3, vocab, (batch, seq))
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[0, rng.randint(1, seq):] = 0
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
            ref = model.forward.__wrapped__(input_ids=ids, attention_mask=mask).last_hidden_state
        assert rel_err(out, ref) < 1e-5


def _runner_and_call(shape: tuple[int, int]):
    """A tiny BERT optimized and called twice at `shape` (no mask): its runner, and the graph
    arguments, real sizes and bucket sizes of the second call."""
    model = BERT.build("sdpa")
    transfuse.optimize(model)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 50, shape))
    (runner,) = [r for b in model._transfuse_state.backends for r in b.runners]
    calls = []
    fn = runner.fn
    runner.fn = lambda *a: (calls.append(a), fn(*a))[1]
    with torch.no_grad():
        model(input_ids=torch.randint(3, 50, shape))
    runner.fn = fn
    real = runner._real_sizes(calls[-1])
    return runner, calls[-1], real, runner._targets(real)


def test_large_buckets_are_not_dry_run(monkeypatch):
    runner, args, real, target = _runner_and_call((2, 9))
    monkeypatch.setattr(precompile, "MAX_ROWS", 64)
    shapes = _record_dry_runs(monkeypatch, runner, run=False)
    runner._precompile(args, runner._padded_args(args, real, target), target, every_bucket=True)
    # Powers of two from each size's lower bound (a size Dynamo traces apart, e.g. 1, is not this
    # graph's), batch up to the cap of 64 and sequence up to the 64 positions, 64 rows at most.
    lower = {runner.plan.names[s]: runner.plan.lower[s] for s in runner.symbols}
    assert lower["input_ids.size(1)"] == 2
    powers = (1, 2, 4, 8, 16, 32, 64)
    assert sorted(shapes) == sorted((b, s) for b in powers for s in powers
                                    if b * s <= 64 and b >= lower["input_ids.size(0)"] and s >= 2)


def test_first_bucket_dry_runs_itself_only(monkeypatch):
    runner, args, real, target = _runner_and_call((3, 9))
    shapes = _record_dry_runs(monkeypatch, runner, run=False)
    runner._precompile(args, runner._padded_args(args, real, target), target, every_bucket=False)
    assert shapes == [(4, 16)]  # the call's own bucket
    assert runner.precompiled is None and runner.precompiled_first["buckets"] == 1


def test_off_by_environment(monkeypatch):
    monkeypatch.setenv(precompile.ENV, "0")
    assert not precompile.enabled()
