"""The `transfuse` command (also `python -m transfuse`).

    transfuse bench [--model encoder] [options]   benchmark suite, results to bench/results/
    transfuse demo [--cpu] [options]              side-by-side demo (GPU), or a tiny CPU run

Without a GPU the demo must set TRITON_INTERPRET=1 before any transfuse kernel is defined (Triton
decides interpreted-or-compiled when @triton.jit runs), so kernels are imported only after that.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

# Set when this process re-executed itself to get TRITON_INTERPRET in before the kernels.
_REEXEC_MARK = "TRANSFUSE_DEMO_REEXEC"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="transfuse",
        description="transfuse: Dynamo capture, FX rewrites, Triton kernels and CUDA graphs for PyTorch transformers.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{bench,demo}")
    # `bench` hands its arguments to transfuse.bench.main, whose options depend on --model; this
    # entry exists for the listing in --help.
    sub.add_parser("bench", help="run a benchmark (transfuse bench --help for its options)", add_help=False)
    demo = sub.add_parser("demo", help="HF eager vs torch.compile vs transfuse side by side (tiny CPU run without a GPU)",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # Importing the demo module defines no kernel (it reaches transfuse's kernels only when it runs),
    # so it may come before the TRITON_INTERPRET decision.
    from transfuse.demo import add_arguments

    add_arguments(demo)
    return parser


def _kernels_already_defined() -> bool:
    """True if some transfuse kernel file was imported while TRITON_INTERPRET was off: its
    @triton.jit functions are then compiled-for-GPU objects that cannot run on CPU tensors."""
    config = sys.modules.get("transfuse.kernels._config")
    return config is not None and not getattr(config, "INTERPRET", False)


def _use_interpreter(argv: list[str]) -> None:
    """Put TRITON_INTERPRET=1 in the environment before transfuse's kernels are defined; if they
    already were (a package __init__ imported them), start this command again in a fresh process."""
    if os.environ.get("TRITON_INTERPRET") == "1" and not _kernels_already_defined():
        return
    os.environ["TRITON_INTERPRET"] = "1"
    if _kernels_already_defined():
        if os.environ.get(_REEXEC_MARK):
            raise SystemExit("transfuse kernels were defined before TRITON_INTERPRET=1 could be set; "
                             "run `TRITON_INTERPRET=1 python -m transfuse demo`")
        os.environ[_REEXEC_MARK] = "1"
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-m", "transfuse", *argv])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from transfuse import bench

        return bench.main(argv[1:], prog="transfuse bench")

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "demo":
        import torch

        cpu = args.cpu or not torch.cuda.is_available()
        if cpu:
            _use_interpreter(argv)
        from transfuse import demo

        return demo.run_cpu(forced=args.cpu) if cpu else demo.run_gpu(args)
    parser.error(f"unknown command {args.command!r}")
    return 2
