"""Which kernels one decode step of generate() launches besides the model's own, and who asks for them.

    cd /work/main && PYTHONPATH=src TRITON_INTERPRET=1 python3 bench/decode_step_census.py \
        [--family llama|gpt2|qwen2|t5|...] [--dtype float16] [--batch 4] [--sample]

On CPU the decode loop runs its step eagerly: the same Python that a GPU captures into the step's
CUDA graph, so every aten op counted here that launches a kernel is a kernel node of that graph.
torch.profiler records the step (the third, well past tracing); each op is put in the region that
issued it:

    prepare   the model's prepare_inputs_for_generation (Hugging Face)
    model     the compiled forward: the FX graph transfuse rewrote (transfuse::* ops named whole;
              what their launchers issue is under "inside transfuse ops")
    choose    the decode loop's processors, argmax or multinomial and bookkeeping
    loop      the rest of the decode loop's step

An op is counted at the lowest aten op under it that launches (zeros -> empty + fill_: one fill_),
labelled with the op the region called (`copy_ <- to`); on a GPU a few of those lower as other
kernels (`copy_ <- mul` is a mul there). Views and bare allocations launch nothing and are listed
apart; Triton launches are counted as launches, not as the interpreter's numpy traffic.
Not a test: a census for reports.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys

import torch

# Ops that launch no GPU kernel: views, metadata, allocation without a fill.
_NO_KERNEL = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "expand", "as_strided",
              "t", "transpose", "permute", "alias", "detach", "empty", "empty_strided", "new_empty",
              "new_empty_strided", "empty_like", "_reshape_alias", "reshape", "lift_fresh", "split",
              "split_with_sizes", "unbind", "chunk", "sym_size", "sym_stride", "sym_numel", "is_nonzero",
              "_local_scalar_dense", "item", "diagonal", "resize_", "narrow", "view_as", "set_"}
_NO_OP = {"to", "contiguous", "resolve_conj", "resolve_neg", "type_as"}  # without a copy under them


def _region(name, fn):
    @functools.wraps(fn)  # generate() reads prepare_inputs_for_generation's signature
    def wrapped(*a, **k):
        with torch.profiler.record_function(f"census:{name}"):
            return fn(*a, **k)
    return wrapped


def _mark_triton_launches():
    """A Triton launch is one kernel: the interpreter's tensor traffic under it is not counted.
    (The census reads the profiler's tree: under a TorchDispatchMode Dynamo would run the model
    eagerly, not the transfuse graph.)"""
    import triton.runtime.interpreter as interp

    interp.GridExecutor.__call__ = _region("triton", interp.GridExecutor.__call__)


def _launches(event) -> bool:
    """Whether an aten event or one under it launches a kernel (`to` to its own dtype does not)."""
    op = event.name[6:]
    children = [c for c in event.cpu_children if c.name.startswith("aten::")]
    if op in _NO_KERNEL or (op in _NO_OP and not children):
        return any(_launches(c) for c in children)
    return True


def _walk(event, region, counts, top=None):
    """Counts the lowest aten ops that launch (zeros -> empty + fill_: one fill), each labelled with
    the op the region called (`copy_ <- to`); transfuse ops whole; ops that launch nothing apart."""
    name = event.name
    if name.startswith("census:"):
        if name == "census:triton":
            counts[region]["(triton launch)"] += 1
            return
        region = name[7:]
    elif name.startswith("transfuse::"):
        counts[region][name] += 1
        region, top = "inside transfuse ops", None
    elif name.startswith("aten::"):
        op = name[6:]
        top = top or op
        label = op if op == top else f"{op} <- {top}"
        if not _launches(event):
            counts[region]["(no kernel) " + label] += 1
            return
        inner = [c for c in event.cpu_children if c.name.startswith("aten::") and _launches(c)]
        if not inner:
            counts[region][label] += 1
            return
        for child in inner:
            _walk(child, region, counts, top)
        return
    for child in event.cpu_children:
        _walk(child, region, counts, top)


def census_of_step(model, ids, mask, step_index: int = 3, **gen) -> dict:
    _mark_triton_launches()
    state = model._transfuse_state
    model.prepare_inputs_for_generation = _region("prepare", model.prepare_inputs_for_generation)
    state.compiled = _region("model", state.compiled)
    loop = state.decode_loop
    loop._choose = _region("choose", loop._choose)
    run_step = loop._run_step
    seen = [0]
    prof = None

    def _run_step(entry, step):
        nonlocal prof
        seen[0] += 1
        if seen[0] != step_index:
            return run_step(entry, step)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with torch.profiler.record_function("census:loop"):
                return run_step(entry, step)
    loop._run_step = _run_step
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, **gen)
    counts: dict = collections.defaultdict(collections.Counter)
    for event in prof.events():
        if event.cpu_parent is None:
            _walk(event, "loop", counts)
    return counts


def main() -> None:
    sys.path.insert(0, ".")
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="llama")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--sample", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args()
    import transfuse
    from tests.models.test_decoder_families import _build
    from tests.models.test_generate import _seq2seq

    build = _seq2seq if args.family in ("t5", "bart") else _build
    model = build(args.family).eval().to(getattr(torch, args.dtype))
    ids = torch.randint(3, 97, (args.batch, 9))
    mask = torch.ones_like(ids)
    gen = dict(max_new_tokens=6, do_sample=args.sample, eos_token_id=2, pad_token_id=0)
    transfuse.optimize(model)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, **gen)  # traces prompt and step
    counts = census_of_step(model, ids, mask, **gen)
    total = extra = 0
    for region in ("prepare", "model", "choose", "loop", "inside transfuse ops"):
        ops = counts.get(region, {})
        kernels = {k: v for k, v in ops.items() if not k.startswith(("(no kernel) ", "transfuse::", "(triton"))}
        triton_launches = ops.get("(triton launch)", 0)
        custom = {k: v for k, v in ops.items() if k.startswith("transfuse::")}
        free = {k[12:]: v for k, v in ops.items() if k.startswith("(no kernel) ")}
        n = sum(kernels.values())
        total += n
        extra += triton_launches if region != "inside transfuse ops" else 0
        launches = f", {triton_launches} Triton launch(es)" if triton_launches else ""
        print(f"{region}: {n} kernel-launching aten op(s){launches}")
        for k, v in sorted(kernels.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"    {v:3d} {k}")
        if custom:
            print("    transfuse ops: " + ", ".join(f"{k[11:]} x{v}" for k, v in sorted(custom.items())))
        if free:
            print("    no kernel: " + ", ".join(f"{k} x{v}" for k, v in sorted(free.items())))
    print(f"per step: {total} kernel-launching aten op(s) besides the transfuse ops' own launches, "
          f"and {extra} Triton launch(es) of the decode loop")


if __name__ == "__main__":
    main()
