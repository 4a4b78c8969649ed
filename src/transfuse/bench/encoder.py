"""BERT encoder forward: HF eager vs torch.compile vs torch.compile(reduce-overhead) vs transfuse.

bert-base geometry (BertConfig defaults: hidden 768, 12 layers, 12 heads, ffn 3072, vocab 30522),
random weights from a fixed seed, on one GPU, eval mode, under torch.inference_mode, fp16 by default.
Per (batch, seq) shape and provider it records:

- median, p10 and p90 latency of the whole model call (timing.py: warm-up, then many calls with the
  GPU idle at the start of each, inputs rotating through several random sets);
- speedup against every other provider (ratio of medians);
- the relative error ||out - ref|| / ||ref|| of last_hidden_state against an fp32 eager copy of the
  same weights on the same inputs (padding positions excluded), and the max abs error;
- the first call's wall seconds on that shape (compilation, autotuning, capture included);
- the physical floor for the shape (floor.py), from ceilings measured at the start of the run.

Every provider gets its own deep copy of the fp32 master model, so no provider's rewrite can reach
another's weights or modules. Dynamo's caches are reset between providers: they are keyed on
BertModel.forward's code object, which all copies share. A provider that fails on a shape is
recorded with its message and the run goes on.
"""

from __future__ import annotations

import argparse
import copy
import gc
import time
import traceback
from typing import Any, Callable

import torch
import torch._dynamo

from transfuse.bench import floor, parse_list, parse_shapes, report, timing

DESCRIPTION = "BERT encoder forward (bert-base geometry, random weights): HF eager vs torch.compile vs transfuse"
DEFAULT_SHAPES = "1x16,1x128,1x512,8x128,8x512,32x128,32x512"
DEFAULT_PROVIDERS = "eager,compile,compile-ro,transfuse"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Dynamo keeps one cache entry per (code object, guards); all four providers x 7 shapes land on
# BertModel.forward, far past the default limit of 8, after which Dynamo silently runs eager.
RECOMPILE_LIMIT = 64


# --- providers -----------------------------------------------------------------------------------
# Each takes the provider's own copy of the model (on device, in dtype, eval) and returns the callable
# that the benchmark calls with keyword inputs.

def _eager(model: torch.nn.Module, args: argparse.Namespace) -> Callable:
    return model


def _compile_dynamic(args: argparse.Namespace) -> bool | None:
    # "false": one specialised graph per shape, the strongest static-shape baseline and the same
    # per-shape specialisation CUDA graphs get; "auto": torch's default (dynamic after a recompile).
    return False if args.compile_dynamic == "false" else None


def _compile(model: torch.nn.Module, args: argparse.Namespace) -> Callable:
    return torch.compile(model, dynamic=_compile_dynamic(args))


def _compile_reduce_overhead(model: torch.nn.Module, args: argparse.Namespace) -> Callable:
    compiled = torch.compile(model, mode="reduce-overhead", dynamic=_compile_dynamic(args))

    def call(**inputs: Any) -> Any:
        # Tells CUDA-graph trees that the previous call's outputs are dead, so a replay may reuse
        # their memory; without it an inference loop can fall back to re-recording.
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(**inputs)

    return call


def _transfuse(model: torch.nn.Module, args: argparse.Namespace) -> Callable:
    import transfuse

    optimize = getattr(transfuse, "optimize", None)
    if optimize is None:
        raise RuntimeError("transfuse.optimize() is not available in this build")
    return optimize(model)


def _transfuse_backend(model: torch.nn.Module, args: argparse.Namespace) -> Callable:
    import transfuse  # noqa: F401  (registers the "transfuse" Dynamo backend)

    return torch.compile(model, backend="transfuse", dynamic=_compile_dynamic(args))


PROVIDERS: dict[str, Callable[[torch.nn.Module, argparse.Namespace], Callable]] = {
    "eager": _eager,
    "compile": _compile,
    "compile-ro": _compile_reduce_overhead,
    "transfuse": _transfuse,
    "transfuse-backend": _transfuse_backend,
}
PROVIDER_LABELS = {
    "eager": "HF eager",
    "compile": "torch.compile (default mode)",
    "compile-ro": 'torch.compile(mode="reduce-overhead")',
    "transfuse": "transfuse.optimize(model)",
    "transfuse-backend": 'torch.compile(backend="transfuse")',
}


# --- model and inputs ----------------------------------------------------------------------------

def make_config(args: argparse.Namespace):
    from transformers import BertConfig

    if args.config == "bert-base":
        return BertConfig(attn_implementation=args.attn)
    if args.config == "tiny":  # for smoke tests on CPU
        return BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                          vocab_size=100, attn_implementation=args.attn)
    raise ValueError(f"unknown config {args.config!r}")


def make_model(config, seed: int) -> torch.nn.Module:
    from transformers import BertModel

    torch.manual_seed(seed)
    return BertModel(config).eval()


def make_inputs(batch: int, seq: int, vocab: int, pad: float, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Random token ids and an int64 attention mask. With pad > 0, row lengths fall linearly from seq
    (row 0) to about (1 - pad) * seq (last row); the rest of each row is padding."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=gen, dtype=torch.long)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if pad > 0:
        for row in range(batch):
            frac = row / max(1, batch - 1)
            length = max(1, round(seq * (1 - pad * frac)))
            mask[row, length:] = 0
    return {"input_ids": input_ids.to(device), "attention_mask": mask.to(device)}


def _hidden(output: Any) -> torch.Tensor:
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


def errors_vs(out: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(||out - ref|| / ||ref||, max |out - ref|) over the unpadded positions, in fp32."""
    keep = mask.to(torch.bool).unsqueeze(-1)
    diff = (out.float() - ref.float()).masked_fill(~keep, 0)
    ref_kept = ref.float().masked_fill(~keep, 0)
    return (diff.norm() / ref_kept.norm()).item(), diff.abs().max().item()


# --- run -----------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    # String defaults go through `type` too, and read better in --help than the parsed lists.
    parser.add_argument("--shapes", type=parse_shapes, default=DEFAULT_SHAPES, metavar="BxS,...",
                        help="(batch, seq) shapes, e.g. 1x16,8x128")
    parser.add_argument("--providers", type=parse_list, default=DEFAULT_PROVIDERS, metavar="P,...",
                        help=f"comma-separated subset of: {', '.join(PROVIDERS)}")
    parser.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    parser.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa", help="HF attn_implementation")
    parser.add_argument("--iters", type=int, default=100, help="timed calls per shape and provider (>= 50 advised)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls after the first one")
    parser.add_argument("--rotate", type=int, default=4, help="sets of random inputs cycled through while timing")
    parser.add_argument("--pad", type=float, default=0.0,
                        help="padding: the last row keeps (1 - PAD) of its tokens, row 0 all (0 = mask of ones)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs")
    parser.add_argument("--compile-dynamic", choices=["false", "auto"], default="false",
                        help="torch.compile(dynamic=False) per shape, or torch's automatic dynamic shapes")
    parser.add_argument("--config", choices=["bert-base", "tiny"], default="bert-base",
                        help="model geometry (tiny: hidden 64, 2 layers, for smoke tests)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu only for smoke tests: no ceilings, no floor")


def _set_recompile_limit(limit: int) -> None:
    import torch._dynamo

    # recompile_limit is the newer name of cache_size_limit; torch 2.11-2.13 keep both, one as an
    # alias, and a later release may drop either.
    for name in ("recompile_limit", "cache_size_limit"):
        try:
            current = getattr(torch._dynamo.config, name)
        except AttributeError:
            continue
        setattr(torch._dynamo.config, name, max(int(current), limit))


def _one_line(exc: BaseException, depth: int = 0) -> str:
    """'Type: first line of the message', followed by the exception it wraps (Dynamo's
    BackendCompilerFailed says only which backend raised; the cause is what matters)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}"
    inner = getattr(exc, "inner_exception", None) or exc.__cause__
    if inner is not None and inner is not exc and depth < 3:
        text += f" <- {_one_line(inner, depth + 1)}"
    return text[:400]


def _speedups(row: dict[str, Any]) -> None:
    medians = {p: e["median_ms"] for p, e in row["providers"].items() if e.get("median_ms") and not e.get("error")}
    for p, e in row["providers"].items():
        if p in medians:
            e["speedup"] = {b: medians[b] / medians[p] for b in medians}


def run(args: argparse.Namespace) -> dict[str, Any]:
    unknown = [p for p in args.providers if p not in PROVIDERS]
    if unknown:
        raise SystemExit(f"unknown providers {unknown}; known: {', '.join(PROVIDERS)}")
    if args.iters < 1 or args.rotate < 1 or not 0 <= args.pad < 1:
        raise SystemExit("--iters and --rotate must be >= 1 and --pad in [0, 1)")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: the encoder benchmark measures GPUs (use --device cpu --config tiny to smoke-test)")
    dtype = DTYPES[args.dtype]
    dtype_bytes = torch.finfo(dtype).bits // 8
    shapes: list[tuple[int, int]] = args.shapes
    providers: list[str] = args.providers
    _set_recompile_limit(RECOMPILE_LIMIT)

    config = make_config(args)
    results: dict[str, Any] = {
        "benchmark": "encoder",
        "title": f"BERT encoder forward, {args.config} geometry, {args.dtype}, attn={args.attn}",
        "environment": report.environment(),
        "config": {
            "model": f"transformers BertModel, {args.config} geometry, random weights (seed {args.seed})",
            "hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads, "intermediate_size": config.intermediate_size,
            "vocab_size": config.vocab_size, "dtype": args.dtype, "attn_implementation": args.attn,
            "pad": args.pad, "iters": args.iters, "warmup": args.warmup, "rotate": args.rotate,
            "compile_dynamic": args.compile_dynamic, "grad_mode": "inference_mode",
            "reference": "fp32 eager copy of the same weights",
            "shapes": [f"{b}x{s}" for b, s in shapes], "device": str(device),
        },
        "providers": providers,
        "provider_labels": {p: PROVIDER_LABELS.get(p, p) for p in providers},
        "target": "transfuse" if "transfuse" in providers else providers[-1],
        "headline_baselines": ["compile-ro", "eager"],
        "ceilings": None,
        "prepare_s": {},
        "rows": [],
    }

    total = len(providers) * len(shapes) + 2
    with report.Progress(total, "encoder", enabled=not args.no_progress) as bar:
        bar.step("measuring matmul peak and copy bandwidth")
        if cuda:
            ceilings = floor.measure_ceilings(dtype, device)
            results["ceilings"] = ceilings.as_dict()
            bar.log(f"ceilings: matmul {ceilings.matmul_tflops:.0f} TFLOP/s ({args.dtype}, {ceilings.matmul_size}^3), "
                    f"copy {ceilings.copy_gbps:.0f} GB/s (read + write)")
        bar.advance()

        for b, s in shapes:
            flops = floor.encoder_flops(config, b, s)
            nbytes = floor.encoder_min_bytes(config, b, s, dtype_bytes)
            ceil = results["ceilings"]
            results["rows"].append({
                "shape": f"{b}x{s}", "batch": b, "seq": s, "flops": flops, "min_bytes": nbytes,
                "floor_ms": floor.floor_ms(flops, nbytes, ceil["matmul_tflops"], ceil["copy_gbps"]) if ceil else None,
                "providers": {},
            })

        bar.step("fp32 eager reference")
        master = make_model(config, args.seed)
        inputs = {
            (b, s): [make_inputs(b, s, config.vocab_size, args.pad, args.seed * 1000 + k, device)
                     for k in range(args.rotate)]
            for b, s in shapes
        }
        reference = copy.deepcopy(master).to(device)
        refs = {}
        with torch.inference_mode():
            for shape in shapes:
                refs[shape] = _hidden(reference(**inputs[shape][0])).float()
        del reference
        bar.advance()

        for name in providers:
            torch._dynamo.reset()
            model = copy.deepcopy(master).to(device=device, dtype=dtype).eval()
            fn: Callable | None = None
            prepare_error = None
            try:
                t0 = time.perf_counter()
                fn = PROVIDERS[name](model, args)
                results["prepare_s"][name] = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001  (recorded, not dropped)
                prepare_error = exc
                bar.log(f"{name}: setup failed: {_one_line(exc)}")
            for row, shape in zip(results["rows"], shapes):
                bar.step(f"{name} {row['shape']}")
                entry: dict[str, Any] = {"error": None}
                row["providers"][name] = entry
                if prepare_error is not None:
                    entry["error"] = f"setup: {_one_line(prepare_error)}"
                    bar.advance()
                    continue
                try:
                    with torch.inference_mode():
                        first_s, out = timing.time_first_call(fn, inputs[shape][0], cuda)
                        entry["first_call_s"] = first_s
                        del out
                        t = timing.measure(fn, inputs[shape], warmup=args.warmup, iters=args.iters, cuda=cuda)
                        entry.update(t.as_dict())
                        # Error of the steady-state path (after warm-up: replays, not recordings).
                        out = _hidden(fn(**inputs[shape][0]))
                        entry["rel_err"], entry["max_abs_err"] = errors_vs(out, refs[shape],
                                                                           inputs[shape][0]["attention_mask"])
                        del out
                    bar.log(f"{name:>17} {row['shape']:>7}: {t.median_ms:9.3f} ms  (p10 {t.p10_ms:.3f}, "
                            f"p90 {t.p90_ms:.3f}; first call {first_s:6.2f} s; rel err {entry['rel_err']:.1e})")
                except Exception as exc:  # noqa: BLE001  (recorded, not dropped)
                    entry["error"] = _one_line(exc)
                    entry["traceback"] = traceback.format_exc()[-3000:]
                    bar.log(f"{name:>17} {row['shape']:>7}: ERROR {entry['error']}")
                    if cuda:
                        torch.cuda.empty_cache()
                bar.advance()
            if name.startswith("transfuse") and fn is not None:
                try:
                    import transfuse

                    results.setdefault("transfuse_report", {})[name] = transfuse.report(model)
                except Exception as exc:  # noqa: BLE001
                    results.setdefault("transfuse_report", {})[name] = f"(no report: {_one_line(exc)})"
            del fn, model
            gc.collect()
            torch._dynamo.reset()
            if cuda:
                torch.cuda.empty_cache()
            for row in results["rows"]:
                _speedups(row)
            if not args.no_save:  # a run cut short still leaves what it measured
                report.write_json(results, f"{args.out}/{report.result_stem(results)}.json")

    return results
