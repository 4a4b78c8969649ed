"""Microbenchmark of transfuse.linear (GEMM + fused epilogue) against F.linear + separate ops, eager
and torch.compile'd, on bert-base's four GEMMs and a LLaMA-style SwiGLU MLP.

    PYTHONPATH=src python3 bench/kernels/bench_gemm.py                 # the table (fp16, M 16..16384)
    PYTHONPATH=src python3 bench/kernels/bench_gemm.py --m 128,4096 --dtype bf16 --no-compile
    PYTHONPATH=src python3 bench/kernels/bench_gemm.py --all-epilogues # every activation on 768->3072
    PYTHONPATH=src python3 bench/kernels/bench_gemm.py --ptxas         # no GPU: registers/spills per config

Columns (ms, then TFLOP/s in brackets):
  triton    transfuse.kernels.gemm.linear_fwd: autotuned tiles, split-K for few rows
  auto      torch.ops.transfuse.linear: the dispatcher's measured choice (what a model runs), and
            the choice made: "triton/<split>", "torch" (addmm + epilogue ops) or "torch_lt"
            (cuBLASLt fused epilogue)
  eager     what the unfused model runs: F.linear then each epilogue op; for the LLaMA MLP,
            HF's gate_proj and up_proj linears, silu and mul
  compiled  torch.compile(eager), default mode, dynamic=True (one compile per shape, not per M);
            inductor calls cuBLAS for the GEMM and fuses the epilogue ops into one kernel
TFLOP/s = 2*M*N*K / time (N counts gate and up for SwiGLU). Timings: median of
triton.testing.do_bench, which empties L2 before every run (so weights come from HBM, as in a
model). First-run cost: autotuning compiles each candidate config (about 40 Triton compiles for
the default table) and torch.compile compiles once per shape; the table itself is quick.
"""

import argparse
import datetime
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

ACT = {
    "none": lambda h: h,
    "gelu": F.gelu,
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "relu": F.relu,
    "tanh": torch.tanh,
    "silu": F.silu,
}

# name: (K, N, activation, has_bias, has_residual)
SHAPES = {
    "bert.qkv": (768, 2304, "none", True, False),
    "bert.attn_out": (768, 768, "none", True, True),
    "bert.ffn1": (768, 3072, "gelu", True, False),
    "bert.ffn2": (3072, 768, "none", True, True),
    "llama.mlp": (2048, 5632, "silu_mul", False, False),
}
DEFAULT_M = (16, 128, 1024, 4096, 16384)


def eager_linear(x, w, b, act, r):
    h = ACT[act](F.linear(x, w, b))
    return h + r if r is not None else h


def eager_swiglu(x, w_gate, w_up, r):
    """HF LlamaMLP's up half: silu(gate_proj(x)) * up_proj(x), two separate weights."""
    h = F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)
    return h + r if r is not None else h


def _ms(fn):
    fn()  # autotune / compile / cuBLAS heuristics outside the timing
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def _label(act, has_bias, has_res):
    parts = (["bias"] if has_bias else []) + ([act] if act != "none" else []) + (["res"] if has_res else [])
    return "+".join(parts) or "plain"


def bench(ms_list, dtype, compile_baselines, all_epilogues):
    from transfuse.kernels.gemm import linear_fwd, m_bucket
    from transfuse.ops.gemm import GemmKey, gemm_choices

    rows = [(name, *spec) for name, spec in SHAPES.items()]
    if all_epilogues:
        rows = [("bert.ffn1", 768, 3072, act, True, False) for act in ACT] + [
            ("bert.ffn1", 768, 3072, "none", True, True), ("bert.ffn1", 768, 3072, "gelu", True, True)]
    table = []
    compiled_cache = {}
    for name, K, N, act, has_bias, has_res in rows:
        gated = act == "silu_mul"
        w_rows = 2 * N if gated else N
        weight = (torch.randn(w_rows, K, device="cuda") * K**-0.5).to(dtype)
        bias = torch.randn(w_rows, device="cuda").to(dtype) if has_bias else None
        w_gate, w_up = (weight[:N].contiguous(), weight[N:].contiguous()) if gated else (None, None)
        for M in ms_list:
            x = torch.randn(M, K, device="cuda").to(dtype)
            res = torch.randn(M, N, device="cuda").to(dtype) if has_res else None
            flop = 2 * M * w_rows * K
            cells = {}
            cells["triton"] = _ms(lambda: linear_fwd(x, weight, bias, act, res))
            cells["auto"] = _ms(lambda: torch.ops.transfuse.linear(x, weight, bias, act, res))
            choice = gemm_choices().get(GemmKey(m_bucket(M), N, K, str(dtype).removeprefix("torch."), act,
                                                has_bias, has_res))
            picked = "?" if choice is None else (
                f"triton/{choice.split_k}" if choice.backend == "triton" else choice.backend)
            if gated:
                eager = lambda x, r: eager_swiglu(x, w_gate, w_up, r)  # noqa: E731
            else:
                eager = lambda x, r, act=act: eager_linear(x, weight, bias, act, r)  # noqa: E731
            cells["eager"] = _ms(lambda: eager(x, res))
            if compile_baselines:
                ckey = (name, act, has_bias, has_res)
                if ckey not in compiled_cache:
                    compiled_cache[ckey] = torch.compile(eager, dynamic=True)
                compiled = compiled_cache[ckey]
                cells["compiled"] = _ms(lambda: compiled(x, res))
            fmt = {k: f"{v:7.4f} ({flop / v / 1e9:4.0f})" for k, v in cells.items()}
            best_base = min(cells["eager"], cells.get("compiled", float("inf")))
            table.append((name, str(M), _label(act, has_bias, has_res), fmt["triton"], fmt["auto"], picked,
                          fmt["eager"], fmt.get("compiled", "-"), f"{cells['eager'] / cells['auto']:.2f}x",
                          f"{best_base / cells['auto']:.2f}x"))
            print(f"  {name} M={M} {_label(act, has_bias, has_res)} done", file=sys.stderr, flush=True)
    _print(("shape", "M", "epilogue", "triton ms (TF/s)", "auto ms (TF/s)", "picked", "eager ms (TF/s)",
            "compiled ms (TF/s)", "auto vs eager", "auto vs best"), table)


def ptxas_report():
    """Compiles the kernel for sm_90a on this machine (no GPU, no launch) for every config and a
    few epilogues; prints ptxas's registers, spill bytes and the shared memory each needs.
    Written against triton 3.8's ASTSource (signature dict, constexpr dict, divisibility attrs)."""
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from transfuse.kernels import gemm as g

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    fn = g._linear_fwd_kernel
    table = []
    for dtype, act, has_bias, has_res in [("fp16", "gelu", True, True), ("fp16", "none", True, False),
                                          ("bf16", "silu_mul", False, False)]:
        probe = torch.empty(1, dtype=torch.float16 if dtype == "fp16" else torch.bfloat16)
        configs = g._all_configs()
        kept = [conf for conf in configs  # what the autotuner may try for some M
                if any(conf in g._prune_for_shape(configs, {"M_BUCKET": m, "x_ptr": probe}, ACTIVATION=act)
                       for m in (16, 64, 1024, 16384))]
        for conf in kept:
            bm, bn, bk, stages, warps = g._tile_of(conf)
            const = dict(ACTIVATION=act, HAS_BIAS=has_bias, HAS_RESIDUAL=has_res, EVEN_K=True, DOT_PRECISION="tf32",
                         SPLIT_EPILOGUE=g._split_epilogue(dict(BLOCK_M=bm, BLOCK_N=bn, ACTIVATION=act, num_warps=warps)),
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, stride_w_k=1, stride_res_n=1)
            sig = {n: "constexpr" if n in const else ("*fp32" if n == "part_ptr" else f"*{dtype}")
                   if n.endswith("_ptr") else "i32" for n in fn.arg_names}
            aligned = ("stride_x_m", "stride_w_n", "stride_res_m", "stride_out_m", "N", "K")
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                     if n.endswith("_ptr") or n in aligned}
            t0 = time.time()
            kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                                    options=dict(num_warps=warps, num_stages=stages))
            seconds = time.time() - t0
            with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                f.write(kernel.asm["ptx"])
            out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                                 capture_output=True, text=True).stderr
            os.unlink(f.name)
            regs = next((w.split()[1] for w in out.split("\n") if "Used" in w for w in [w[w.index("Used"):]]), "?")
            spill = next((w.split("bytes spill stores")[0].split(",")[-1].strip() for w in out.split("\n")
                          if "spill stores" in w), "?")
            table.append((f"{dtype} {_label(act, has_bias, has_res)}", f"{bm}x{bn}x{bk}", str(stages), str(warps),
                          regs, spill, f"{kernel.metadata.shared // 1024} KB", f"{seconds:.1f}s"))
    _print(("epilogue", "tile", "stages", "warps", "regs", "spill B", "smem", "compile"), table)


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
    parser.add_argument("--m", default=",".join(map(str, DEFAULT_M)), help="rows (batch*seq), comma-separated")
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--all-epilogues", action="store_true", help="every activation on bert's 768->3072")
    parser.add_argument("--ptxas", action="store_true", help="compile-only register/spill report (no GPU)")
    args = parser.parse_args()
    if args.ptxas:
        os.environ.pop("TRITON_INTERPRET", None)
        ptxas_report()
        return
    torch.manual_seed(0)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"{args.dtype} | {datetime.date.today()}")
    t0 = time.time()
    bench([int(m) for m in args.m.split(",")], dtype, not args.no_compile, args.all_epilogues)
    print(f"({time.time() - t0:.0f} s, compiles and autotuning included)")


if __name__ == "__main__":
    main()
