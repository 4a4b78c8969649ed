"""Decoder generation: `transfuse bench --model llama-1.1b` (also gpt2, llama-7b; tiny for CPU smoke
runs). Providers in one process, each on its own copy of the model (random weights, fixed seed):

    eager            HF generate() with its dynamic KV cache
    static           HF generate(cache_implementation="static"), which compiles the forward itself
    transfuse        transfuse.optimize(model), then generate() as the user writes it
    transfuse-static transfuse.optimize(model), then generate(cache_implementation="static")

Per provider and batch: decode tokens/s over `--new-tokens` greedy tokens after a `--prompt`-token
prompt (min_new_tokens forces the full length: random weights emit EOS anywhere), the first call's
seconds, and the achieved bandwidth, (weight bytes + KV-cache bytes read per step) / time per step,
next to the device-to-device copy bandwidth measured in the same run. Time to first token: one
generate() of a single token after `--ttft-prompts`-token prompts at batch 1.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import time
from typing import Any, Callable

import torch

DESCRIPTION = "decoder generate(): HF eager vs HF static cache vs transfuse, tokens/s, time to first token, GB/s"
DEFAULT_PROVIDERS = "eager,static,transfuse"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

# Geometries of the issue (random weights): name -> (config class, keyword arguments).
GEOMETRIES: dict[str, tuple[str, dict]] = {
    "llama-1.1b": ("LlamaConfig", dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32,
                                       num_key_value_heads=4, intermediate_size=5632, vocab_size=32000,
                                       max_position_embeddings=4096)),
    "llama-7b": ("LlamaConfig", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                     num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                                     max_position_embeddings=4096)),
    # Gemma-2B's shape: multi-query attention with 256-wide heads, a GeGLU MLP 8x wide, 256k vocabulary
    "gemma-2b": ("GemmaConfig", dict(hidden_size=2048, num_hidden_layers=18, num_attention_heads=8,
                                     num_key_value_heads=1, head_dim=256, intermediate_size=16384,
                                     vocab_size=256000, max_position_embeddings=8192)),
    "gpt2": ("GPT2Config", dict()),  # 124M, 1024 positions
    "tiny": ("LlamaConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=96, vocab_size=97, max_position_embeddings=128)),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default=None,
                        help="model geometry (default: the --model name; tiny for CPU smoke runs)")
    parser.add_argument("--providers", default=DEFAULT_PROVIDERS,
                        help="comma-separated subset of eager, static, transfuse, transfuse-static")
    parser.add_argument("--batches", default="1,8,32", help="batch sizes for tokens/s")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens for tokens/s")
    parser.add_argument("--new-tokens", type=int, default=128, help="greedy tokens generated per call")
    parser.add_argument("--ttft-prompts", default="512,2048", help="prompt lengths for time to first token")
    parser.add_argument("--iters", type=int, default=3, help="timed generate() calls per point (median)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed calls of each length after the first call (a shape's graphs are captured "
                             "when it comes again; Hugging Face's static cache compiles in its first calls)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def make_model(geometry: str, seed: int = 0) -> torch.nn.Module:
    import transformers

    config_cls, kwargs = GEOMETRIES[geometry]
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model_cls = {"GPT2Config": transformers.GPT2LMHeadModel, "GemmaConfig": transformers.GemmaForCausalLM}.get(
        config_cls, transformers.LlamaForCausalLM)
    return model_cls(config).eval()


def max_positions(config) -> int:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions")


def step_bytes(model: torch.nn.Module, batch: int, context: float) -> float:
    """Bytes one decode step must read: every weight but the input embedding table (only `batch`
    rows of it), and the KV cache of `context` positions."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    if embed is not model.get_output_embeddings().weight:  # untied: the table is not read whole
        weights -= embed.numel() * embed.element_size()
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = 2 * layers * kv_heads * head_dim * context * batch * embed.element_size()
    return weights + kv


def _generate(model, provider: str) -> Callable:
    static = provider.endswith("static")

    def call(ids, new_tokens):
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                      do_sample=False, pad_token_id=0)
        if static:
            kwargs["cache_implementation"] = "static"
        return model.generate(ids, **kwargs)

    return call


def fresh_copy(master: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A provider's own copy of the model, after the previous provider's compiled code and memory are gone."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return copy.deepcopy(master).to(device=device, dtype=dtype)


def each_provider(providers: str, master: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                  measure: Callable[[str, torch.nn.Module, dict], None]) -> list[dict]:
    """One row per provider ("eager", "static" or "transfuse*", comma-separated): measure(provider,
    model, row) on the provider's own copy (optimized for transfuse*); an error ends that row only."""
    rows = []
    for provider in [p for p in providers.split(",") if p]:
        model = fresh_copy(master, device, dtype)
        row: dict[str, Any] = {"provider": provider, "points": []}
        try:
            if provider.startswith("transfuse"):
                import transfuse

                transfuse.optimize(model)
            elif provider not in ("eager", "static"):
                raise ValueError(f"unknown provider {provider!r}")
            measure(provider, model, row)
        except Exception as e:  # noqa: BLE001 - one provider failing must not end the run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(json.dumps(row), flush=True)
        rows.append(row)
        del model
    return rows


def run_metadata(device: torch.device) -> dict[str, Any]:
    return {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "triton": __import__("triton").__version__, "date": time.strftime("%Y-%m-%d")}


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, iters: int) -> float:
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def run(args: argparse.Namespace) -> dict[str, Any]:
    geometry = args.geometry or args.model.removeprefix("decoder-")
    if geometry not in GEOMETRIES:
        raise SystemExit(f"unknown geometry {geometry!r}; known: {', '.join(sorted(GEOMETRIES))}")
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    master = make_model(geometry)
    limit = max_positions(master.config)
    batches = [int(b) for b in args.batches.split(",") if b]
    ttft_prompts = [int(p) for p in args.ttft_prompts.split(",") if p]
    copy_gbps = None
    if device.type == "cuda":
        from transfuse.bench.floor import measure_copy_gbps

        copy_gbps = measure_copy_gbps(device=device)
    gen = torch.Generator().manual_seed(0)
    vocab = master.config.vocab_size
    def measure(provider: str, model: torch.nn.Module, row: dict) -> None:
        call = _generate(model, provider)
        row["ttft"] = []
        with torch.inference_mode():
            for batch in batches:
                ids = torch.randint(3, vocab, (batch, args.prompt), generator=gen).to(device)
                _sync(device)
                start = time.perf_counter()
                call(ids, args.new_tokens)
                _sync(device)
                first = time.perf_counter() - start
                for _ in range(args.warmup):
                    call(ids, args.new_tokens)
                    call(ids, 1)
                total = _timed(lambda: call(ids, args.new_tokens), device, args.iters)
                prefill = _timed(lambda: call(ids, 1), device, args.iters)
                per_step = max(total - prefill, 1e-9) / max(args.new_tokens - 1, 1)
                point = {"batch": batch, "first_call_s": first, "total_s": total,
                         "tokens_per_s": batch * args.new_tokens / total,
                         "decode_tokens_per_s": batch / per_step, "ms_per_step": per_step * 1e3}
                point["achieved_gbps"] = step_bytes(model, batch, args.prompt + args.new_tokens / 2) / per_step / 1e9
                row["points"].append(point)
                print(json.dumps({"provider": provider, **point}), flush=True)
            for prompt in ttft_prompts:
                if prompt + 1 > limit:
                    row["ttft"].append({"prompt": prompt, "skipped": f"beyond the model's {limit} positions"})
                    continue
                ids = torch.randint(3, vocab, (1, prompt), generator=gen).to(device)
                call(ids, 1)  # a new prompt length may compile: not part of the time to first token
                row["ttft"].append({"prompt": prompt, "ms": _timed(lambda: call(ids, 1), device, args.iters) * 1e3})

    rows = each_provider(args.providers, master, device, dtype, measure)
    return {
        "benchmark": "decoder", "geometry": geometry, "dtype": args.dtype, **run_metadata(device),
        "prompt": args.prompt, "new_tokens": args.new_tokens, "copy_gbps": copy_gbps,
        "weight_bytes": step_bytes(master.to(dtype), 1, 0), "rows": rows,
    }


def summarize(results: dict[str, Any]) -> str:
    lines = [f"{results['geometry']} {results['dtype']}, {results['gpu']}, torch {results['torch']}, "
             f"transformers {results['transformers']}, triton {results['triton']}, {results['date']}; "
             f"prompt {results['prompt']}, {results['new_tokens']} new tokens, greedy"]
    if results["copy_gbps"]:
        lines.append(f"copy bandwidth measured in this run: {results['copy_gbps']:.0f} GB/s; weights "
                     f"{results['weight_bytes'] / 1e9:.2f} GB (bandwidth limit at batch 1: "
                     f"{results['copy_gbps'] * 1e9 / results['weight_bytes']:.0f} tok/s)")
    lines += ["", "| provider | batch | tokens/s | decode tokens/s | ms/step | GB/s | first call s |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for row in results["rows"]:
        if "error" in row and not row["points"]:
            lines.append(f"| {row['provider']} | - | {row['error']} | | | | |")
        for p in row["points"]:
            lines.append(f"| {row['provider']} | {p['batch']} | {p['tokens_per_s']:.0f} | {p['decode_tokens_per_s']:.0f} | "
                         f"{p['ms_per_step']:.2f} | {p['achieved_gbps']:.0f} | {p['first_call_s']:.1f} |")
    lines += ["", "| provider | " + " | ".join(f"TTFT {t['prompt']} ms" for t in results["rows"][0]["ttft"]) + " |"]
    lines.append("|---|" + "---:|" * len(results["rows"][0]["ttft"]))
    for row in results["rows"]:
        cells = [f"{t['ms']:.1f}" if "ms" in t else t.get("skipped", "-") for t in row["ttft"]]
        lines.append(f"| {row['provider']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_and_print(results: dict[str, Any], args: argparse.Namespace) -> None:
    from transfuse.bench.report import save_and_print

    save_and_print(results, summarize(results), args, results["geometry"])
