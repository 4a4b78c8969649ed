"""`transfuse demo`: one look at what transfuse does, in a minute or two.

On a CUDA GPU: bert-base geometry (random weights, fp16) run by HF eager, torch.compile and
transfuse at two shapes, side by side: latency, speedup, max abs error against eager.

Without one: a tiny BERT through Triton's interpreter on the CPU (slow, so no timings): the max
error against eager and transfuse's report of what it rewrote. TRITON_INTERPRET=1 must be in the
environment before any transfuse kernel is defined; `transfuse.cli` sees to that before importing
this module.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from typing import Any, Callable

import torch

from transfuse.bench import encoder, report, timing

CPU_TOLERANCE = 1e-3  # fp32 end to end on the interpreter: only summation order differs from eager
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,  # 768, 12, 12, 3072
            vocab_size=100)  # 30522


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from transfuse.bench import parse_shapes

    parser.add_argument("--shapes", type=parse_shapes, default="1x128,8x512", metavar="BxS,...",
                        help="(batch, seq) shapes on the GPU")
    parser.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per shape and provider")
    parser.add_argument("--cpu", action="store_true",
                        help="the CPU demo (tiny BERT, Triton interpreter) even when a GPU is present")


def _optimize(model: torch.nn.Module) -> torch.nn.Module:
    import transfuse

    optimize = getattr(transfuse, "optimize", None)
    if optimize is None:
        raise RuntimeError("transfuse.optimize() is not available in this build")
    return optimize(model)


def _report(model: torch.nn.Module) -> str:
    import transfuse

    fn = getattr(transfuse, "report", None)
    return fn(model) if fn is not None else "(transfuse.report() is not available in this build)"


def run_cpu(forced: bool = False) -> int:
    """Tiny BERT, fp32, through the interpreter: max error vs eager and the rewrite report."""
    from transformers import BertConfig

    reason = "--cpu" if forced else "no CUDA GPU"
    print(f"{reason}: running a tiny BERT through Triton's interpreter on the CPU", flush=True)
    model = encoder.make_model(BertConfig(**TINY), seed=0)
    inputs = encoder.make_inputs(2, 8, TINY["vocab_size"], pad=0.0, seed=0, device=torch.device("cpu"))
    eager = copy.deepcopy(model)  # optimize() changes `model` itself
    with torch.inference_mode():
        expected = encoder._hidden(eager(**inputs))
    t0 = time.perf_counter()
    try:
        optimized = _optimize(model)
        with torch.inference_mode():
            got = encoder._hidden(optimized(**inputs))
    except Exception as exc:  # noqa: BLE001  (a demo ends with one line, not a traceback)
        print(f"transfuse failed: {encoder._one_line(exc)}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - t0
    err = (got.float() - expected.float()).abs().max().item()
    ok = err <= CPU_TOLERANCE
    print(f"optimize + first call (capture, rewrite, interpreted kernels): {seconds:.1f} s")
    print(f"max abs error vs eager: {err:.2e} ({'ok' if ok else 'MISMATCH'}, tolerance {CPU_TOLERANCE:g})")
    print(_report(optimized))
    return 0 if ok else 1


def _compile(model: torch.nn.Module) -> Callable:
    return torch.compile(model, dynamic=False)


def run_gpu(args: argparse.Namespace, device: str = "cuda", config: Any = None) -> int:
    """bert-base geometry (or `config`) on `device`: eager, torch.compile and transfuse side by side."""
    from transformers import BertConfig

    dtype = encoder.DTYPES[args.dtype]
    device = torch.device(device)
    cuda = device.type == "cuda"
    shapes: list[tuple[int, int]] = args.shapes
    encoder._set_recompile_limit(encoder.RECOMPILE_LIMIT)
    where = torch.cuda.get_device_name(device) if cuda else str(device)
    geometry = "bert-base geometry" if config is None else "custom geometry"
    print(f"{where}: {geometry}, random weights, {args.dtype}", flush=True)
    master = encoder.make_model(config or BertConfig(), seed=0)
    inputs = {s: encoder.make_inputs(*s, master.config.vocab_size, 0.0, seed=i, device=device)
              for i, s in enumerate(shapes)}

    providers: list[tuple[str, Callable[[torch.nn.Module], Callable]]] = [
        ("HF eager", lambda m: m), ("torch.compile", _compile), ("transfuse", _optimize)]
    results: dict[str, dict[tuple[int, int], dict[str, Any]]] = {name: {} for name, _ in providers}
    eager_out: dict[tuple[int, int], torch.Tensor] = {}
    reports: dict[str, str] = {}
    with report.Progress(len(providers) * len(shapes), "demo") as bar:
        for name, prepare in providers:
            torch._dynamo.reset()
            model = copy.deepcopy(master).to(device=device, dtype=dtype)
            try:
                fn = prepare(model)
            except Exception as exc:  # noqa: BLE001  (shown in the table)
                for s in shapes:
                    results[name][s] = {"error": encoder._one_line(exc)}
                bar.advance(len(shapes))
                continue
            for s in shapes:
                bar.step(f"{name} {s[0]}x{s[1]}: compile, warm up, time")
                try:
                    with torch.inference_mode():
                        first_s, _ = timing.time_first_call(fn, inputs[s], cuda)
                        t = timing.measure(fn, [inputs[s]], warmup=5, iters=args.iters, cuda=cuda)
                        out = encoder._hidden(fn(**inputs[s])).float().clone()
                    if name == "HF eager":
                        eager_out[s] = out
                    err = (out - eager_out[s]).abs().max().item() if s in eager_out else None
                    results[name][s] = {"ms": t.median_ms, "first_s": first_s, "err": err}
                except Exception as exc:  # noqa: BLE001
                    results[name][s] = {"error": encoder._one_line(exc)}
                bar.advance()
            if name == "transfuse":
                try:
                    reports[name] = _report(model)
                except Exception as exc:  # noqa: BLE001
                    reports[name] = f"(no report: {encoder._one_line(exc)})"
            del fn, model
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    torch._dynamo.reset()

    print()
    print(demo_table(results, shapes))
    for text in reports.values():
        print()
        print(text)
    return 0


def demo_table(results: dict[str, dict[tuple[int, int], dict[str, Any]]], shapes: list[tuple[int, int]]) -> str:
    """Side by side: ms per provider, transfuse's speedups, max abs error vs eager."""
    names = list(results)
    header = ["shape", *(f"{n} ms" for n in names), "transfuse vs eager", "transfuse vs compile",
              *(f"{n} max err" for n in names if n != "HF eager")]
    errors: list[str] = []

    def ms(name: str, s: tuple[int, int]) -> float | None:
        entry = results[name].get(s, {})
        return None if entry.get("error") else entry.get("ms")

    def cell(name: str, s: tuple[int, int], key: str, fmt) -> str:
        entry = results[name].get(s, {})
        if entry.get("error"):
            note = f"{name}: {entry['error']}"
            if note not in errors:
                errors.append(note)
            return f"error[{errors.index(note) + 1}]"
        return fmt(entry.get(key))

    rows = []
    for s in shapes:
        t, e, c = ms("transfuse", s), ms("HF eager", s), ms("torch.compile", s)
        rows.append([
            f"{s[0]}x{s[1]}",
            *(cell(n, s, "ms", report.fmt_ms) for n in names),
            report.fmt_speedup(e / t if e and t else None),
            report.fmt_speedup(c / t if c and t else None),
            *(cell(n, s, "err", lambda x: "-" if x is None else f"{x:.1e}") for n in names if n != "HF eager"),
        ])
    text = report._table(header, rows)
    if errors:
        text += "\n\n" + "\n".join(f"[{i}] {e}" for i, e in enumerate(errors, 1))
    return text
