"""The `transfuse bench` harness.

One benchmark per module beside this file, registered by name in BENCHMARKS. A benchmark module
provides:

    DESCRIPTION: str                      one line for --help
    add_arguments(parser) -> None         its own options (shared ones come from add_common_arguments)
    run(args) -> dict                     runs and returns a results dict (schema in report.py)

and this package writes the results (JSON, markdown, PNG) and prints the table. Adding a benchmark
is one module and one line here.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType
from typing import Sequence

BENCHMARKS: dict[str, str] = {
    "encoder": "transfuse.bench.encoder",  # bert-base geometry forward, 4 providers x 7 shapes
    "dynamic": "transfuse.bench.dynamic",  # a stream of random shapes, warm-up included (--dynamic)
    "train": "transfuse.bench.train",  # GPT-2 124M training iterations, nanoGPT-style and HF (--train)
    # decoder generate(): the geometry is the name (random weights), tiny for CPU smoke runs
    "llama-1.1b": "transfuse.bench.decoder",
    "llama-7b": "transfuse.bench.decoder",
    "gemma-2b": "transfuse.bench.decoder",
    "gpt2": "transfuse.bench.decoder",
    "decoder-tiny": "transfuse.bench.decoder",
    # encoder-decoder generate(): T5, Flan-T5, BART geometries (random weights), tiny for CPU smoke runs
    "t5-base": "transfuse.bench.seq2seq",
    "flan-t5-base": "transfuse.bench.seq2seq",
    "bart-base": "transfuse.bench.seq2seq",
    "seq2seq-tiny": "transfuse.bench.seq2seq",
}
DEFAULT_BENCHMARK = "encoder"
DEFAULT_OUT = os.path.join("bench", "results")


def load(name: str) -> ModuleType:
    if name not in BENCHMARKS:
        raise SystemExit(f"unknown benchmark {name!r}; known: {', '.join(sorted(BENCHMARKS))}")
    return importlib.import_module(BENCHMARKS[name])


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1x16,8x128' -> [(1, 16), (8, 128)]."""
    shapes = []
    for item in text.replace(" ", "").split(","):
        if not item:
            continue
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"bad shape {item!r}: expected BATCHxSEQ such as 8x128")
        shapes.append((int(parts[0]), int(parts[1])))
    if not shapes:
        raise argparse.ArgumentTypeError("no shapes given")
    return shapes


def parse_list(text: str) -> list[str]:
    return [item for item in text.replace(" ", "").split(",") if item]


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="directory for the JSON, markdown and PNG results")
    parser.add_argument("--no-save", action="store_true", help="print the table only; write no files")
    parser.add_argument("--no-progress", action="store_true", help="plain output, no progress bar")


def build_parser(name: str, prog: str | None = None) -> argparse.ArgumentParser:
    module = load(name)
    parser = argparse.ArgumentParser(
        prog=prog or "python -m transfuse.bench",
        description=f"{name}: {module.DESCRIPTION}",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default=DEFAULT_BENCHMARK, choices=sorted(BENCHMARKS),
                        help="which benchmark to run")
    add_common_arguments(parser)
    module.add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--dynamic" in argv:  # `transfuse bench --dynamic` is the request-stream benchmark
        argv = [a for a in argv if a != "--dynamic"] + ["--model", "dynamic"]
    if "--train" in argv:  # `transfuse bench --train` is the training benchmark
        argv = [a for a in argv if a != "--train"] + ["--model", "train"]
    # Two passes: the benchmark chosen decides which options exist.
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", default=DEFAULT_BENCHMARK)
    known, _ = pre.parse_known_args(argv)
    parser = build_parser(known.model, prog)
    args = parser.parse_args(argv)

    from transfuse.bench import report

    module = load(args.model)
    results = module.run(args)
    if hasattr(module, "write_and_print"):  # a benchmark with its own tables
        module.write_and_print(results, args)
        return 0
    if not args.no_save:
        paths = report.write_outputs(results, args.out)
        for kind, path in paths.items():
            print(f"wrote {kind}: {path}")
    print()
    print(report.caption(results))
    print()
    print(report.details_table(results))
    print()
    print(report.markdown_table(results))
    return 0
