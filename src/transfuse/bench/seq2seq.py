"""Encoder-decoder generation: `transfuse bench --model t5-base` (also bart-base; seq2seq-tiny for CPU
smoke runs). Providers in one process, each on its own copy of the model (random weights, fixed seed):

    eager      HF generate() with its dynamic cache
    static     HF generate(cache_implementation="static"), which compiles the decoder forward itself
    transfuse  transfuse.optimize(model), then generate() as the user writes it

Per provider, batch and search (greedy, beam 4): tokens/s over `--new-tokens` tokens after an
`--input`-token encoder input (min_new_tokens forces the full length), time to first token (the
encoder and one decoder step: generate() of one token), the first call's seconds, and the share of
output tokens equal to the first provider's on the same inputs (fp16 greedy on random weights can
fork on near-ties; a low share on a real checkpoint is a bug). The error, for greedy: the provider's
model run once over its own greedy output (teacher forcing, every decoder position) against the
same weights in fp32 on the same inputs: the logits' relative error (norm of the difference over
the norm of fp32's) and the share of positions whose argmax is fp32's. Where fp16 forks on
near-ties, that share is below 100% for Hugging Face's fp16 too.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from transfuse.bench.decoder import DTYPES, _sync, _timed, each_provider, run_metadata

DESCRIPTION = "encoder-decoder generate() (T5, BART): HF eager vs HF static cache vs transfuse, tokens/s, TTFT"
DEFAULT_PROVIDERS = "eager,static,transfuse"

GEOMETRIES: dict[str, tuple[str, dict]] = {
    "t5-base": ("T5Config", dict(d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_decoder_layers=12,
                                 num_heads=12, vocab_size=32128)),
    # Flan-T5-base / T5 v1.1: a gated-GELU FFN (GeGLU, 2048 wide), untied LM head
    "flan-t5-base": ("T5Config", dict(d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_decoder_layers=12,
                                      num_heads=12, vocab_size=32128, feed_forward_proj="gated-gelu",
                                      tie_word_embeddings=False)),
    "bart-base": ("BartConfig", dict(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                                     decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072,
                                     vocab_size=50265, max_position_embeddings=1024)),
    "tiny": ("T5Config", dict(d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=2, num_heads=4,
                              vocab_size=97)),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default=None,
                        help="model geometry (default: the --model name; tiny for CPU smoke runs)")
    parser.add_argument("--providers", default=DEFAULT_PROVIDERS, help="comma-separated subset of eager, static, transfuse")
    parser.add_argument("--batches", default="1,8", help="batch sizes")
    parser.add_argument("--searches", default="greedy,beam4", help="greedy and/or beamN")
    parser.add_argument("--input", type=int, default=128, help="encoder input tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per call")
    parser.add_argument("--iters", type=int, default=3, help="timed generate() calls per point (median)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed calls of each length after the first call (a shape's graphs are captured "
                             "when it comes again; Hugging Face's static cache compiles in its first calls)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def make_model(geometry: str, seed: int = 0) -> torch.nn.Module:
    import transformers

    config_cls, kwargs = GEOMETRIES[geometry]
    config = getattr(transformers, config_cls)(pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **kwargs)
    torch.manual_seed(seed)
    model_cls = transformers.T5ForConditionalGeneration if config_cls == "T5Config" else \
        transformers.BartForConditionalGeneration
    return model_cls(config).eval()


def _search_kwargs(search: str) -> dict:
    if search == "greedy":
        return dict(do_sample=False)
    if search.startswith("beam") and search[4:].isdigit():
        return dict(do_sample=False, num_beams=int(search[4:]), early_stopping=False, length_penalty=1.0)
    raise SystemExit(f"unknown search {search!r}: greedy or beamN")


def run(args: argparse.Namespace) -> dict[str, Any]:
    geometry = args.geometry or args.model.removeprefix("seq2seq-")
    if geometry not in GEOMETRIES:
        raise SystemExit(f"unknown geometry {geometry!r}; known: {', '.join(sorted(GEOMETRIES))}")
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    master = make_model(geometry)
    vocab = master.config.vocab_size
    batches = [int(b) for b in args.batches.split(",") if b]
    searches = [s for s in args.searches.split(",") if s]
    gen = torch.Generator().manual_seed(0)
    inputs = {b: torch.randint(3, vocab, (b, args.input), generator=gen).to(device) for b in batches}
    reference: dict[tuple, torch.Tensor] = {}
    fp32 = make_model(geometry).to(device)  # the same weights (same seed), for the error columns

    def measure(provider: str, model: torch.nn.Module, row: dict) -> None:
        extra = dict(cache_implementation="static") if provider == "static" else {}
        with torch.inference_mode():
            for search in searches:
                for batch in batches:
                    ids = inputs[batch]

                    def call(n, ids=ids, search=search):
                        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                              min_new_tokens=n, **_search_kwargs(search), **extra)

                    _sync(device)
                    start = time.perf_counter()
                    out = call(args.new_tokens)
                    _sync(device)
                    first = time.perf_counter() - start
                    for _ in range(args.warmup):
                        call(args.new_tokens)
                        call(1)
                    total = _timed(lambda: call(args.new_tokens), device, args.iters)
                    ttft = _timed(lambda: call(1), device, args.iters)
                    same = reference.setdefault((search, batch), out)
                    width = min(same.shape[1], out.shape[1])
                    point = {"search": search, "batch": batch, "first_call_s": first, "total_s": total,
                             "tokens_per_s": batch * args.new_tokens / total, "ttft_ms": ttft * 1e3,
                             "tokens_equal": (same[:, :width] == out[:, :width]).float().mean().item()}
                    if search == "greedy":  # after the timing: this forward is a shape of its own
                        point.update(_logits_error(model, fp32, ids, out))
                    row["points"].append(point)
                    print(json.dumps({"provider": provider, **point}), flush=True)

    rows = each_provider(args.providers, master, device, dtype, measure)
    return {
        "benchmark": "seq2seq", "geometry": geometry, "dtype": args.dtype, **run_metadata(device),
        "input": args.input, "new_tokens": args.new_tokens, "rows": rows,
    }


def _logits_error(model: torch.nn.Module, fp32: torch.nn.Module, ids: torch.Tensor, out: torch.Tensor) -> dict:
    """The model's logits over its own generated sequence `out` (teacher forcing) against fp32's."""
    mask, decoder_ids = torch.ones_like(ids), out[:, :-1]
    got = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits.float()
    ref = fp32(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits.float()
    return {"logits_rel_err": ((got - ref).norm() / ref.norm()).item(),
            "argmax_equal_fp32": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}


def summarize(results: dict[str, Any]) -> str:
    lines = [f"{results['geometry']} {results['dtype']}, {results['gpu']}, torch {results['torch']}, "
             f"transformers {results['transformers']}, triton {results['triton']}, {results['date']}; "
             f"input {results['input']} tokens, {results['new_tokens']} new tokens",
             "", "| provider | search | batch | tokens/s | TTFT ms | tokens equal to the first provider's | "
             "logits rel err vs fp32 | argmax = fp32's | first call s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in results["rows"]:
        if "error" in row and not row["points"]:
            lines.append(f"| {row['provider']} | - | - | {row['error']} | | | | | |")
        for p in row["points"]:
            err = f"{p['logits_rel_err']:.1e} | {100 * p['argmax_equal_fp32']:.1f}%" if "logits_rel_err" in p else "- | -"
            lines.append(f"| {row['provider']} | {p['search']} | {p['batch']} | {p['tokens_per_s']:.0f} | "
                         f"{p['ttft_ms']:.1f} | {100 * p['tokens_equal']:.0f}% | {err} | {p['first_call_s']:.1f} |")
    return "\n".join(lines)


def write_and_print(results: dict[str, Any], args: argparse.Namespace) -> None:
    from transfuse.bench.report import save_and_print

    save_and_print(results, summarize(results), args, results["geometry"])
