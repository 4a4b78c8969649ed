"""Registers and spills of the decode kernels, compiled for sm_90a on a machine without a GPU:
Triton builds the PTX, and the ptxas shipped with it reports what the kernel uses (`ptxas -v`). No
device time. The few-rows GEMM (kernels/gemm_few_rows.py, 3-32 rows) by default; `--gemv`, the
GEMV (kernels/gemv.py, 1-2 rows) with its launcher's config for one row of Llama-1.1B's K = 2048
(the norm prologue holds the whole row: one K step of 2048); `--decode-attention`, the decode
attention (kernels/attention_decode.py) at Llama-1.1B's geometry (head dim 64, 8 query heads a KV
head, one query row, a mask with its summary and the filled length), with `--new-kv` the fused
rotary + cache write of a decode step.

    PYTHONPATH=src python3 bench/kernel_registers.py [--gemv [--norm] | --decode-attention [--new-kv]] [--gated]
        [--warps 4] [--tile BLOCK_N,BLOCK_K,STAGES]

Run it with the Triton to ask about: the GPU image has 3.6 (PYTHONPATH=<unpacked triton 3.6 wheel>:src
works beside the development machine's 3.8). fp16, 16-row x side, unsplit, no bias or residual; the
GEMV's norm (`--norm`) is an add + RMSNorm cast before its weight (Llama's).
"""

import argparse
import inspect
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from transfuse.kernels import gemm_few_rows, gemv
from transfuse.kernels._config import next_power_of_2

# Pointer arguments that are not fp16 (every other *_ptr is)
_POINTERS = {"part_ptr": "*fp32", "ticket_ptr": "*i32", "ml_ptr": "*fp32", "summary_ptr": "*i8",
             "key_len_ptr": "*i32", "sinks_ptr": "*fp32", "start_ptr": "*i64"}
_FLOATS = ("eps", "weight_offset", "scale")


def _argument_type(name: str) -> str:
    if name.endswith("_ptr"):
        return _POINTERS.get(name, "*fp16")
    return "fp32" if name in _FLOATS else "i32"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--norm", action="store_true")
    parser.add_argument("--gated", action="store_true")
    parser.add_argument("--warps", type=int, default=None, help="default: the launcher's config")
    parser.add_argument("--tile", default=None, help="few-rows BLOCK_N,BLOCK_K,stages instead of the default config's")
    parser.add_argument("--gemv", action="store_true", help="the GEMV kernel at one row instead")
    parser.add_argument("--decode-attention", action="store_true", help="the decode attention instead")
    parser.add_argument("--new-kv", action="store_true", help="with --decode-attention: the fused cache write")
    args = parser.parse_args()
    if args.norm and not args.gemv:
        parser.error("--norm is the GEMV's prologue: add --gemv (the few-rows GEMM has had none since 6be8733)")
    if args.gemv:
        kernel, const, warps, stages, tile = _gemv(args)
    elif args.decode_attention:
        kernel, const, warps, stages, tile = _decode_attention(args)
    else:
        kernel, const, warps, stages, tile = _few_rows(args)
    params = list(inspect.signature(kernel.fn).parameters)
    signature = {p: "constexpr" if p in const else _argument_type(p) for p in params}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(params.index(k),): v for k, v in const.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        report = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(tmp, "kernel.cubin")],
                                capture_output=True, text=True, check=True)
    lines = [line.strip() for line in (report.stdout + report.stderr).splitlines() if "spill" in line or "registers" in line]
    name = "gemv" if args.gemv else f"decode_attention new_kv={args.new_kv}" if args.decode_attention else "few_rows"
    print(f"triton {triton.__version__} {name} norm={args.norm} gated={args.gated} "
          f"warps={warps} stages={stages} tile={tile}: " + "; ".join(lines))


def _decode_attention(args):
    from transfuse.kernels import attention_decode

    const = dict(HEAD_DIM=64, HEAD_DIM_V=64, BLOCK_D=64, BLOCK_DV=64, HAS_KEY_LEN=True, HAS_SINKS=False,
                 HAS_MASK=True, MASK_IS_BOOL=False, HAS_SUMMARY=True, SUMMARY_BLOCK_N=64, SUMMARY_K_POW2=4,
                 GROUP_POW2=8, MASKED_ROWS_ZERO=False, LOAD_AS_FP32=False, DOT_PRECISION=None, SPLITS=1,
                 BLOCK_M=16, BLOCK_N=64, NEW_KV=args.new_kv, ROTARY=args.new_kv,
                 NEW_ROWS=attention_decode._NEW_ROWS, PDL=0)
    return attention_decode._attention_decode_kernel, const, args.warps or 4, 3, "16x64"


def _gemv(args):
    K = 2048
    if args.norm:  # norm_gemv_step's rule, with an H100/H200's 132 SMs
        conf = gemv.default_config(1, 2560, K, 132, args.gated, norm=True)
        block_k = max(next_power_of_2(K), conf.block_k)
        vec, warps = min(conf.block_k, 8), max(conf.num_warps, min(8, block_k // (64 * 32)))
    else:
        conf = gemv.default_config(1, 2560, K, 132, args.gated)
        block_k, vec, warps = conf.block_k, min(conf.block_k, 8), conf.num_warps
    const = dict(ACTIVATION="silu_mul" if args.gated else "none", HAS_BIAS=False, HAS_RESIDUAL=False, BLOCK_M=1,
                 BLOCK_N=conf.block_n, BLOCK_K=block_k, VEC=vec, NORM=args.norm, NORM_RESIDUAL=args.norm,
                 NORM_WEIGHT=args.norm, NORM_BIAS=False, LAYER_NORM=False, CAST_BEFORE_WEIGHT=args.norm,
                 STORE_NORMED=False, BF16_RNE_BY_HAND=False, PDL=0)
    return gemv._gemv_fwd_kernel, const, args.warps or warps, 1, f"{conf.block_n}x{block_k}"


def _few_rows(args):
    conf = gemm_few_rows.default_config(args.gated)
    if args.tile:
        block_n, block_k, stages = (int(v) for v in args.tile.split(","))
        conf = conf._replace(block_n=block_n, block_k=block_k, num_stages=stages)
    const = dict(ACTIVATION="silu_mul" if args.gated else "none", HAS_BIAS=False, HAS_RESIDUAL=False, EVEN_K=True,
                 DOT_PRECISION="ieee", BLOCK_M=16, BLOCK_N=conf.block_n, BLOCK_K=conf.block_k, PDL=0)
    return (gemm_few_rows._few_rows_fwd_kernel, const, args.warps or conf.num_warps, conf.num_stages,
            f"{conf.block_n}x{conf.block_k}")


if __name__ == "__main__":
    main()
