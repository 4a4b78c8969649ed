"""Training: `transfuse bench --train` (also `--model train`). GPT-2 124M as people train it:

    nanogpt  bench/nanogpt.py, a nanoGPT-style model: hand-written attention, vocab 50257, tied lm_head,
             forward(idx, targets) -> (logits, loss)
    hf       transformers' GPT2LMHeadModel(GPT2Config()), loss from model(input_ids, labels=input_ids)

Providers in one process, each on its own copy of the same initial weights (fixed seed), fed the
same batches (random tokens from a fixed generator):

    eager             the model as written: hand-written attention (HF attn_implementation="eager"), vocab 50257
    sdpa              attention through F.scaled_dot_product_attention (HF "sdpa")
    compile-sdpa      torch.compile(model) (default mode) of the sdpa model
    compile-sdpa-pad  the same with the vocabulary padded to 50304, the usual hand tuning: the reference
    transfuse         transfuse.optimize(model) on the unmodified eager model: on a GPU, forward and
                      backward as AOTAutograd graphs replayed as CUDA graphs (runtime/training_graphs.py)
    transfuse-autograd  transfuse.optimize(model, training_graphs=False): the same kernels under eager
                      autograd

One iteration: zero_grad(set_to_none=True), forward under torch.autocast (bf16 by default),
loss.backward(), AdamW step (fused=True where this torch has it for the device, else foreach; the row
records which). Per provider: the median ms per iteration after warm-up (each iteration synchronized
on both sides), tokens/s = batch * seq / time, TFLOP/s of the model's useful FLOPs (vocab 50257 for
every provider, so the column compares like with like), the peak memory allocated over the timed
iterations (after warm-up: compilation's transient buffers are not what a training run holds), the
peak memory reserved from the first iteration on (a CUDA graph's memory pool is reserved at capture
and replays allocate nothing, so allocated-during-replay would undercount the graph providers: the
memory target is judged on reserved, the same measure for every provider), the
loss of the last step (same data, weights and seed: without dropout, nanoGPT's default, providers
agree to about the bf16 rounding; GPT2Config's 0.1 draws different masks per attention path), and
with --max-batch the largest batch that trains without running out of memory (doubling, then
bisection; two iterations per trial on the provider's model, so torch.compile recompiles once with
a dynamic batch rather than once per size).

The HF model is used as GPT2LMHeadModel(GPT2Config()) gives it, config.use_cache=True included (the
forward then concatenates each layer's K and V into a DynamicCache, as a user's training loop does
unless they turn it off); only its loss_type is named, see make_master.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from typing import Any, Callable, NamedTuple

import torch

from transfuse.bench.decoder import _sync, _timed, fresh_copy, run_metadata

DESCRIPTION = "GPT-2 124M training (nanoGPT-style, HF): eager, SDPA, torch.compile, transfuse; ms/iter, tokens/s, memory"
ARCHS = ("nanogpt", "hf")
REFERENCE = "compile-sdpa-pad"  # the comparison point: what a tuned torch user runs today
PAD_MULTIPLE = 64  # 50257 -> 50304: GEMM tiles divide the vocabulary evenly
AMP_DTYPES = {"bf16": torch.bfloat16, "fp32": None}  # fp16 would need a GradScaler, which no reference run uses
# AdamW as nanoGPT's GPT-2 recipe sets it; the values change no timing, they keep the loss sane.
LR, BETAS, WEIGHT_DECAY = 6e-4, (0.9, 0.95), 0.1


class Provider(NamedTuple):
    sdpa: bool  # attention through F.scaled_dot_product_attention
    pad: bool  # vocabulary padded to a multiple of PAD_MULTIPLE
    wrap: str | None  # None, "compile", "transfuse" or "transfuse-autograd"


PROVIDERS: dict[str, Provider] = {
    "eager": Provider(sdpa=False, pad=False, wrap=None),
    "sdpa": Provider(sdpa=True, pad=False, wrap=None),
    "compile-sdpa": Provider(sdpa=True, pad=False, wrap="compile"),
    "compile-sdpa-pad": Provider(sdpa=True, pad=True, wrap="compile"),
    "transfuse": Provider(sdpa=False, pad=False, wrap="transfuse"),
    "transfuse-autograd": Provider(sdpa=False, pad=False, wrap="transfuse-autograd"),
}
DEFAULT_PROVIDERS = ",".join(PROVIDERS)

# name -> (layers, heads, width, vocabulary, positions, default batch, default seq)
GEOMETRIES: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "gpt2-124m": (12, 12, 768, 50257, 1024, 8, 1024),
    "tiny": (2, 4, 64, 97, 128, 2, 32),  # CPU smoke runs
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", default=",".join(ARCHS), help="comma-separated subset of nanogpt, hf")
    parser.add_argument("--providers", default=DEFAULT_PROVIDERS, help=f"comma-separated subset of {DEFAULT_PROVIDERS}")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="gpt2-124m",
                        help="model size (tiny for CPU smoke runs)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per iteration (None: 8; 2 for tiny)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (None: 1024; 32 for tiny)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations (median)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations first (compilation happens here)")
    parser.add_argument("--dtype", choices=sorted(AMP_DTYPES), default="bf16",
                        help="torch.autocast dtype (weights and optimizer state stay fp32); fp32 = no autocast")
    parser.add_argument("--dropout", type=float, default=None,
                        help="dropout of both archs (None: each its own, nanoGPT 0.0, GPT2Config 0.1)")
    parser.add_argument("--max-batch", action="store_true",
                        help="also search the largest batch that trains without running out of memory (slow)")
    parser.add_argument("--max-batch-limit", type=int, default=1024,
                        help="stop the --max-batch search here (CPU memory never runs out first)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


# --- models --------------------------------------------------------------------------------------

def make_master(arch: str, geometry: str, dropout: float | None = None, seed: int = 0) -> torch.nn.Module:
    """The unmodified model on CPU in fp32: hand-written (eager) attention, the geometry's vocabulary."""
    layers, heads, width, vocab, positions, _, _ = GEOMETRIES[geometry]
    torch.manual_seed(seed)
    if arch == "nanogpt":
        from transfuse.bench import nanogpt

        config = nanogpt.GPTConfig(block_size=positions, vocab_size=vocab, n_layer=layers, n_head=heads,
                                   n_embd=width, **({} if dropout is None else {"dropout": dropout}))
        return nanogpt.GPT(config)
    if arch == "hf":
        import transformers

        kwargs: dict[str, Any] = {}
        if geometry != "gpt2-124m":  # GPT2Config() is the 124M model; smaller ones need their own shape
            kwargs = dict(n_layer=layers, n_head=heads, n_embd=width, vocab_size=vocab, n_positions=positions,
                          bos_token_id=vocab - 1, eos_token_id=vocab - 1)  # GPT-2's 50256 is outside a tiny vocab
        if dropout is not None:
            kwargs.update(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
        config = transformers.GPT2Config(attn_implementation="eager", **kwargs)
        model = transformers.GPT2LMHeadModel(config)
        # transformers 5.17 infers no loss_type from the name GPT2LMHeadModel, so every forward with
        # labels calls logger.warning_once and then uses ForCausalLM anyway; Dynamo cannot trace the
        # logger and breaks the graph there on every call (torch.compile and transfuse alike). Naming
        # the loss HF falls back to changes no number. Remove when GPT2LMHeadModel.loss_type is set.
        if getattr(model, "loss_type", "ForCausalLM") is None:
            model.loss_type = "ForCausalLM"
        return model
    raise ValueError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}")


def prepare(arch: str, master: torch.nn.Module, provider: str, device: torch.device,
            seed: int = 0) -> tuple[torch.nn.Module, Callable]:
    """The provider's own fp32 copy of `master` in training mode, and what the training loop calls."""
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}; known: {', '.join(PROVIDERS)}")
    spec = PROVIDERS[provider]
    model = fresh_copy(master, device, torch.float32)  # drops the previous provider's compiled code first
    if arch == "nanogpt":
        from transfuse.bench import nanogpt

        nanogpt.set_attention(model, sdpa=spec.sdpa)
        if spec.pad:
            nanogpt.pad_vocab(model, PAD_MULTIPLE, seed=seed)
    else:
        model.set_attn_implementation("sdpa" if spec.sdpa else "eager")
        if spec.pad:
            torch.manual_seed(seed)  # the new rows' init draws from the global generator
            model.resize_token_embeddings(pad_to_multiple_of=PAD_MULTIPLE, mean_resizing=False)
    model.train()
    if spec.wrap == "compile":
        return model, torch.compile(model)
    if spec.wrap == "transfuse":
        import transfuse

        return model, transfuse.optimize(model)
    if spec.wrap == "transfuse-autograd":
        import transfuse

        return model, transfuse.optimize(model, training_graphs=False)
    if spec.wrap is not None:
        raise ValueError(f"provider {provider!r}: unknown wrapper {spec.wrap!r}")
    return model, model


def loss_of(arch: str, model: Callable, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss as each arch's users compute it: nanoGPT takes shifted targets; HF shifts labels itself."""
    if arch == "nanogpt":
        logits, loss = model(x, y)
        return loss
    return model(x, labels=x).loss


def fused_adamw_available(device: torch.device) -> bool:
    """Whether AdamW(fused=True) steps on `device` with this torch (CPU gained it in 2.4). Tried on a
    one-element parameter because torch checks at construction in some versions, at step in others."""
    param = torch.nn.Parameter(torch.zeros(1, device=device))
    param.grad = torch.zeros_like(param)
    try:
        torch.optim.AdamW([param], fused=True).step()
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def make_optimizer(model: torch.nn.Module, fused: bool) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (biases and norm scales are left alone, as GPT-2
    recipes do). model.parameters() lists the tied embedding / lm_head matrix once."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, **kind)


def make_batches(count: int, batch: int, seq: int, vocab: int, device: torch.device,
                 seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` (inputs, next-token targets) pairs of random tokens, contiguous (targets.view(-1) needs it)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        out.append((tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)))
    return out


def train_flops(geometry: str, batch: int, seq: int) -> float:
    """Matmul FLOPs of one training iteration (forward + backward = 3x forward), useful work only:

        dense      12 * L * H^2 + H * V   weights each token multiplies: QKV, output, MLP up and down; the head
        attention  L * seq * H            Q@K^T and P@V, 2 * 2 * seq * H per layer forward, halved by causality

    per token, times 2 (multiply-add) times 3, at the unpadded vocabulary. Norms, GELU, softmax and
    the optimizer are O(tokens * H) or O(params) and run on no tensor core."""
    layers, _, width, vocab, _, _, _ = GEOMETRIES[geometry]
    dense = 12 * layers * width * width + width * vocab
    attention = layers * seq * width
    return 6.0 * batch * seq * (dense + attention)


# --- the largest batch ---------------------------------------------------------------------------

def is_oom(error: BaseException) -> bool:
    """An out-of-memory error, also when torch.compile or autograd wrapped it in another exception."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower():
            return True
        error = error.__cause__ or error.__context__
    return False


def largest_batch(fits: Callable[[int], bool], start: int, limit: int) -> tuple[int, bool]:
    """The largest batch b <= limit with fits(b), assuming fits is monotone: double from `start`
    until a batch fails, then bisect between the last that fit and the first that failed. Returns
    (batch, capped), capped when `limit` itself fit (the real largest may be higher); batch 0 when
    not even 1 fits."""
    lo, hi = 0, None
    b = max(1, min(start, limit))
    while True:
        if fits(b):
            lo = b
            if b >= limit:
                return lo, True
            b = min(2 * b, limit)
        else:
            hi = b
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, False


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- the run -------------------------------------------------------------------------------------

def measure(arch: str, provider: str, master: torch.nn.Module, args: argparse.Namespace, data: list,
            row: dict, fused: bool) -> None:
    """Fill `row` for one arch and provider; raises if the provider cannot train (the caller records it)."""
    device = torch.device(args.device)
    amp = AMP_DTYPES[args.dtype]
    model, run_model = prepare(arch, master, provider, device)
    opt = make_optimizer(model, fused)
    row["optimizer"] = "fused" if fused else "foreach"
    last: dict[str, torch.Tensor] = {}

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            loss = loss_of(arch, run_model, x, y)
        loss.backward()
        opt.step()
        last["loss"] = loss.detach()

    batches = iter(data)

    def next_step() -> None:
        step(*next(batches))

    torch.manual_seed(0)  # dropout masks start from the same generator state for every provider
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
    if args.warmup:
        _sync(device)
        start = time.perf_counter()
        next_step()  # the first iteration: compilation, allocator growth, optimizer state
        _sync(device)
        row["first_iter_s"] = time.perf_counter() - start
    for _ in range(args.warmup - 1):
        next_step()
    if device.type == "cuda":
        _sync(device)
        reserved = torch.cuda.max_memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
    seconds = _timed(next_step, device, args.iters)
    row["ms_per_iter"] = seconds * 1e3
    row["tokens_per_s"] = row["batch"] * row["seq"] / seconds
    row["tflops"] = train_flops(args.geometry, row["batch"], row["seq"]) / seconds / 1e12
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["reserved_gib"] = max(reserved, torch.cuda.max_memory_reserved(device)) / 2**30
    row["final_loss"] = last["loss"].item()

    if args.max_batch:
        vocab = GEOMETRIES[args.geometry][3]

        def fits(b: int) -> bool:
            (x, y), = make_batches(1, b, row["seq"], vocab, device, seed=b)
            ok = True
            try:
                for _ in range(2):  # the second iteration also holds the optimizer state the first creates
                    step(x, y)
                _sync(device)
            except Exception as e:  # noqa: BLE001 - anything but running out of memory is a real failure
                if not is_oom(e):
                    raise
                ok = False
            # Out here, not in a finally: the exception and the activations its traceback holds are
            # gone, so the next, smaller batch finds the memory free (and the allocator's cache empty).
            del x, y
            opt.zero_grad(set_to_none=True)
            last.clear()
            _free(device)
            print(f"  largest batch search: {row['arch']} {row['provider']} batch {b}: "
                  f"{'fits' if ok else 'out of memory'}", file=sys.stderr, flush=True)
            return ok

        try:
            row["max_batch"], row["max_batch_capped"] = largest_batch(fits, row["batch"], args.max_batch_limit)
        except Exception as e:  # noqa: BLE001 - the timing above still stands
            row["max_batch_error"] = _one_line(e)
            traceback.print_exc()  # the one line goes into the table; the whole story to stderr


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    archs = [a for a in args.arch.replace(" ", "").split(",") if a]
    providers = [p for p in args.providers.replace(" ", "").split(",") if p]
    for a in archs:
        if a not in ARCHS:
            raise SystemExit(f"unknown arch {a!r}; known: {', '.join(ARCHS)}")
    _, _, _, vocab, positions, default_batch, default_seq = GEOMETRIES[args.geometry]
    batch = args.batch or default_batch
    seq = args.seq or default_seq
    if seq > positions:
        raise SystemExit(f"--seq {seq} is longer than the {args.geometry} model's {positions} positions")
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit("--iters must be at least 1 and --warmup at least 0")
    fused = fused_adamw_available(device)
    flops = train_flops(args.geometry, batch, seq)
    matmul_tflops = None
    if device.type == "cuda":
        from transfuse.bench.floor import measure_matmul_tflops

        matmul_tflops = measure_matmul_tflops(AMP_DTYPES[args.dtype] or torch.float32, device=device)
        torch.cuda.empty_cache()
    data = make_batches(args.warmup + args.iters, batch, seq, vocab, device)  # a new batch every iteration

    rows = []
    for arch in archs:
        master = make_master(arch, args.geometry, args.dropout)
        for provider in providers:
            row: dict[str, Any] = {"arch": arch, "provider": provider, "batch": batch, "seq": seq}
            try:
                measure(arch, provider, master, args, data, row, fused)
            except Exception as e:  # noqa: BLE001 - one provider failing must not end the run
                row["error"] = _one_line(e)
            # The model and optimizer die with measure()'s frame; the next fresh_copy collects any cycle
            # and empties the CUDA cache before the next provider allocates (gc.collect is not cheap).
            print(json.dumps(row), flush=True)
            rows.append(row)
        del master
    for row in rows:  # speed against the reference of the same arch: its ms over this row's
        ref = next((r for r in rows if r["arch"] == row["arch"] and r["provider"] == REFERENCE
                    and "ms_per_iter" in r), None)
        if ref and "ms_per_iter" in row:
            row["speed_vs_reference"] = ref["ms_per_iter"] / row["ms_per_iter"]
    return {
        "benchmark": "train", "geometry": args.geometry, "dtype": args.dtype, **run_metadata(device),
        "batch": batch, "seq": seq, "iters": args.iters, "warmup": args.warmup, "reference": REFERENCE,
        "optimizer": "AdamW fused" if fused else "AdamW foreach (fused unavailable here)",
        "flops_per_iter": flops, "matmul_tflops": matmul_tflops,
        "floor_ms": flops / (matmul_tflops * 1e12) * 1e3 if matmul_tflops else None, "rows": rows,
    }


# --- tables --------------------------------------------------------------------------------------

def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _rate(value: float) -> str:
    """One decimal for GPU-sized rates, three significant digits for the tiny CPU model's."""
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def _largest(row: dict) -> str:
    if "max_batch_error" in row:
        return "error"
    if "max_batch" not in row:
        return "-"
    return f">={row['max_batch']}" if row.get("max_batch_capped") else str(row["max_batch"])


def _find(results: dict, arch: str, provider: str) -> dict | None:
    return next((r for r in results["rows"] if r["arch"] == arch and r["provider"] == provider
                 and "error" not in r), None)


def _targets(results: dict, arch: str) -> list[str]:
    """The issue's targets for each transfuse provider, as far as this run measured them."""
    ref, sdpa = _find(results, arch, REFERENCE), _find(results, arch, "sdpa")
    notes = []
    for provider in ("transfuse", "transfuse-autograd"):
        t = _find(results, arch, provider)
        if t is None or ref is None:
            continue
        parts = [f"speed {t['speed_vs_reference']:.2f}x {REFERENCE} (target >= 1.25x)"]
        if t.get("reserved_gib") and ref.get("reserved_gib"):
            parts.append(f"peak memory reserved {t['reserved_gib'] / ref['reserved_gib']:.2f}x (target <= 0.75x)")
        if sdpa and t.get("max_batch") and sdpa.get("max_batch"):
            parts.append(f"largest batch {t['max_batch'] / sdpa['max_batch']:.2f}x sdpa's (target >= 1.6x)")
        notes.append(f"{arch} {provider}: " + ", ".join(parts))
    return notes


def summarize(results: dict[str, Any]) -> str:
    lines = [f"train {results['geometry']}, batch {results['batch']} x seq {results['seq']}, {results['dtype']} autocast, "
             f"{results['optimizer']}; {results['gpu']}, torch {results['torch']}, transformers "
             f"{results['transformers']}, triton {results['triton']}, {results['date']}; median of "
             f"{results['iters']} iterations after {results['warmup']} warm-up"]
    flops = f"{_rate(results['flops_per_iter'] / 1e12)} TFLOP per iteration"
    if results.get("floor_ms"):
        flops += (f"; floor {results['floor_ms']:.1f} ms at {results['matmul_tflops']:.0f} TFLOP/s "
                  f"(matmul measured in this run)")
    lines += [flops, "",
              f"| arch | provider | ms/iter | tokens/s | TFLOP/s | peak GiB | reserved GiB | largest batch | "
              f"final loss | vs {REFERENCE} | first iter s |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in results["rows"]:
        if "error" in row:
            lines.append(f"| {row['arch']} | {row['provider']} | {row['error']} | | | | | | | | |")
            continue
        speed = row.get("speed_vs_reference")
        lines.append(
            f"| {row['arch']} | {row['provider']} | {row['ms_per_iter']:.2f} | {row['tokens_per_s']:.0f} | "
            f"{_rate(row['tflops'])} | {_num(row.get('peak_gib'), '.2f')} | "
            f"{_num(row.get('reserved_gib'), '.2f')} | {_largest(row)} | "
            f"{row['final_loss']:.4f} | {'-' if speed is None else f'{speed:.2f}x'} | "
            f"{_num(row.get('first_iter_s'), '.1f')} |")
    lines += [""] + [n for arch in dict.fromkeys(r["arch"] for r in results["rows"]) for n in _targets(results, arch)]
    errors = [f"{r['arch']} {r['provider']} largest batch: {r['max_batch_error']}"
              for r in results["rows"] if "max_batch_error" in r]
    lines += errors
    lines += ["eager = hand-written attention, vocab unpadded (the model as written); sdpa = scaled_dot_product_attention; "
              f"compile = torch.compile, default mode; pad = vocab padded to a multiple of {PAD_MULTIPLE} (its loss "
              "is higher by up to ln(padded / vocab): more classes share the softmax); transfuse = "
              "transfuse.optimize(model) on the eager model; TFLOP/s counts useful matmul FLOPs (vocab unpadded)"]
    return "\n".join(lines)


def write_and_print(results: dict[str, Any], args: argparse.Namespace) -> None:
    from transfuse.bench.report import save_and_print

    save_and_print(results, summarize(results), args, f"train-{results['geometry']}")
