"""Microbenchmark of the norm kernels against eager PyTorch and torch.compile.

    PYTHONPATH=src python3 bench/kernels/bench_norm.py            # the table (~1 min, compiles included)
    PYTHONPATH=src python3 bench/kernels/bench_norm.py --no-compile
    PYTHONPATH=src python3 bench/kernels/bench_norm.py --sweep    # launch configs vs the heuristic (minutes)

The kernels are memory-bound, so the figure that matters is bandwidth. GB/s counts the bytes the
fused op must move at least (x and residual read once, the output and the sum written once, the
affine parameters read once) for every implementation alike: it is the effective bandwidth of each,
and eager's extra round trips through memory show up as a lower figure. The copy row is the
ceiling: x read and written once by torch's copy kernel. Timings: median of
triton.testing.do_bench, which empties L2 before every run, so no input rotation is needed.
"""

import argparse
import datetime
import itertools

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from transfuse.kernels.norm import (
    NormConfig,
    add_layer_norm_fwd,
    add_rms_norm_fwd,
    layer_norm_fwd,
    norm_config,
    rms_norm_fwd,
)

# (rows, hidden, dtype): BERT-base/large at 128 sequences of 128 tokens; Llama-class prefill of 16k
# tokens, a 5120-wide model (non power of two), and one decode step of 16 sequences.
LAYER_NORM_CASES = [(16384, 768, torch.float16), (16384, 1024, torch.bfloat16)]
RMS_NORM_CASES = [(16384, 4096, torch.bfloat16), (8192, 5120, torch.bfloat16), (16, 4096, torch.bfloat16)]
SWEEP_CASES = [
    ("add_layer_norm", 16384, 768, torch.float16),
    ("add_layer_norm", 2048, 768, torch.float16),
    ("add_layer_norm", 16384, 1024, torch.bfloat16),
    ("add_rms_norm", 16384, 2048, torch.bfloat16),
    ("add_rms_norm", 16384, 4096, torch.bfloat16),
    ("add_rms_norm", 8192, 5120, torch.bfloat16),
    ("add_rms_norm", 4096, 8192, torch.bfloat16),
    ("add_rms_norm", 16, 4096, torch.bfloat16),
    ("add_rms_norm", 16384, 256, torch.float16),
]


def hf_llama_rms_norm(x, weight, eps):
    """LlamaRMSNorm.forward, as eager runs it."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(input_dtype)


def hf_llama_add_rms_norm(x, residual, weight, eps):
    s = x + residual
    return hf_llama_rms_norm(s, weight, eps), s


def eager_add_layer_norm(x, residual, weight, bias, eps):
    return F.layer_norm(x + residual, x.shape[-1:], weight, bias, eps)


def _ms(fn, *args, **kwargs):
    """Median milliseconds of fn(*args, **kwargs)."""
    return do_bench(lambda: fn(*args, **kwargs), warmup=10, rep=50, return_mode="median")


def _row(table, case, impl, ms, nbytes, copy_gbs):
    gbs = nbytes / ms / 1e6
    table.append((case, impl, f"{ms * 1e3:9.1f}", f"{gbs:7.0f}", f"{100 * gbs / copy_gbs:5.0f}%"))


def _copy_gbs(rows, n, dtype):
    x = torch.randn(rows, n, device="cuda").to(dtype)
    y = torch.empty_like(x)
    return 2 * x.numel() * x.element_size() / _ms(y.copy_, x) / 1e6


def bench(compile_baselines: bool):
    table = []
    comp = (lambda f: torch.compile(f, dynamic=False)) if compile_baselines else None

    for rows, n, dtype in LAYER_NORM_CASES:
        x = torch.randn(rows, n, device="cuda").to(dtype)
        residual = torch.randn_like(x)
        weight, bias = torch.randn(n, device="cuda").to(dtype), torch.randn(n, device="cuda").to(dtype)
        elem = x.element_size()
        copy_gbs = _copy_gbs(rows, n, dtype)
        case = f"LN {rows}x{n} {str(dtype)[6:]}"
        table.append((case, "copy x -> y (ceiling)", "", f"{copy_gbs:7.0f}", " 100%"))

        nbytes = 2 * x.numel() * elem + 2 * n * elem
        _row(table, case, "transfuse layer_norm", _ms(layer_norm_fwd, x, weight, bias, 1e-12), nbytes, copy_gbs)
        _row(table, case, "F.layer_norm", _ms(F.layer_norm, x, (n,), weight, bias, 1e-12), nbytes, copy_gbs)
        if comp:
            f = comp(F.layer_norm)
            _row(table, case, "compiled F.layer_norm", _ms(f, x, (n,), weight, bias, 1e-12), nbytes, copy_gbs)

        nbytes = 3 * x.numel() * elem + 2 * n * elem  # post-norm: the sum is not written
        _row(table, case, "transfuse add_layer_norm (no sum)",
             _ms(add_layer_norm_fwd, x, residual, weight, bias, 1e-12, False), nbytes, copy_gbs)
        _row(table, case, "x + r; F.layer_norm",
             _ms(eager_add_layer_norm, x, residual, weight, bias, 1e-12), nbytes, copy_gbs)
        if comp:
            f = comp(eager_add_layer_norm)
            _row(table, case, "compiled x + r; F.layer_norm",
                 _ms(f, x, residual, weight, bias, 1e-12), nbytes, copy_gbs)

    for rows, n, dtype in RMS_NORM_CASES:
        x = torch.randn(rows, n, device="cuda").to(dtype)
        residual = torch.randn_like(x)
        weight = torch.randn(n, device="cuda").to(dtype)
        elem = x.element_size()
        copy_gbs = _copy_gbs(rows, n, dtype)
        case = f"RMS {rows}x{n} {str(dtype)[6:]}"
        table.append((case, "copy x -> y (ceiling)", "", f"{copy_gbs:7.0f}", " 100%"))

        nbytes = 2 * x.numel() * elem + n * elem
        _row(table, case, "transfuse rms_norm (Llama)",
             _ms(rms_norm_fwd, x, weight, 1e-6, 0.0, True), nbytes, copy_gbs)
        _row(table, case, "HF LlamaRMSNorm eager", _ms(hf_llama_rms_norm, x, weight, 1e-6), nbytes, copy_gbs)
        if comp:
            f = comp(hf_llama_rms_norm)
            _row(table, case, "HF LlamaRMSNorm compiled", _ms(f, x, weight, 1e-6), nbytes, copy_gbs)

        nbytes = 4 * x.numel() * elem + n * elem  # pre-norm: the sum feeds the next block
        _row(table, case, "transfuse add_rms_norm (sum)",
             _ms(add_rms_norm_fwd, x, residual, weight, 1e-6, 0.0, True, True), nbytes, copy_gbs)
        _row(table, case, "x + r; HF RMSNorm eager",
             _ms(hf_llama_add_rms_norm, x, residual, weight, 1e-6), nbytes, copy_gbs)
        if comp:
            f = comp(hf_llama_add_rms_norm)
            _row(table, case, "x + r; HF RMSNorm compiled",
                 _ms(f, x, residual, weight, 1e-6), nbytes, copy_gbs)

    _print(("case", "implementation", "us", "GB/s", "% copy"), table)


def sweep():
    """Time every sensible launch config of the fused ops and show where the heuristic stands."""
    table = []
    for op, rows, n, dtype in SWEEP_CASES:
        x = torch.randn(rows, n, device="cuda").to(dtype)
        residual = torch.randn_like(x)
        weight = torch.randn(n, device="cuda").to(dtype)
        chosen = norm_config(rows, n)
        block_n = chosen.BLOCK_N
        timings = {}
        for rows_per_program, num_warps in itertools.product((1, 2, 4, 8), (2, 4, 8, 16, 32)):
            tile = rows_per_program * block_n
            if (rows_per_program > 1 and tile > 16384) or tile < 32 * num_warps:
                continue  # spills, or idle threads
            config = NormConfig(block_n, rows_per_program, num_warps)
            if op == "add_layer_norm":
                args = (add_layer_norm_fwd, x, residual, weight, None, 1e-12, False)
            else:
                args = (add_rms_norm_fwd, x, residual, weight, 1e-6, 0.0, True, True)
            try:
                timings[(rows_per_program, num_warps)] = _ms(*args, config=config)
            except Exception as e:  # noqa: BLE001  (out of registers or shared memory: not a candidate)
                print(f"skip {op} {rows}x{n} {config}: {type(e).__name__}")
        best = min(timings, key=timings.get)
        heur = (chosen.ROWS_PER_PROGRAM, chosen.num_warps)
        table.append((f"{op} {rows}x{n} {str(dtype)[6:]}", f"rows={best[0]} warps={best[1]}",
                      f"{timings[best] * 1e3:.1f}", f"rows={heur[0]} warps={heur[1]}",
                      f"{timings.get(heur, float('nan')) * 1e3:.1f}",
                      f"{timings.get(heur, float('nan')) / timings[best]:.2f}x"))
    _print(("case", "best config", "us", "heuristic", "us", "heur/best"), table)


def _print(header, rows):
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format(*header))
    print("  ".join("-" * w for w in widths))
    previous = None
    for r in rows:
        print(line.format(*(("" if r[0] == previous and i == 0 else c) for i, c in enumerate(r))))
        previous = r[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baselines")
    parser.add_argument("--sweep", action="store_true", help="time every launch config instead")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"{datetime.date.today()}")
    if args.sweep:
        sweep()
    else:
        bench(not args.no_compile)


if __name__ == "__main__":
    main()
