"""Everything a benchmark run writes: the environment record, JSON, the markdown table, the chart,
and progress while it runs.

A results dict, as every benchmark returns it:

    {
      "benchmark": "encoder", "title": "...",
      "environment": environment(),            # GPU, versions, date: stated with every figure
      "config": {...},                         # what was run (dtype, iters, attention, ...)
      "ceilings": {"matmul_tflops": ..., "copy_gbps": ..., ...},
      "providers": ["eager", "compile", ...],  # column order
      "target": "transfuse",                   # the provider whose speedups the table shows
      "headline_baselines": ["compile-ro", "eager"],
      "rows": [{"shape": "8x128", "floor_ms": ..., "providers": {
                   "eager": {"median_ms", "p10_ms", "p90_ms", "n", "first_call_s", "rel_err",
                             "speedup": {"eager": 1.0, ...}, "error": None | "message"}, ...}}, ...]
    }
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable


# --- environment -------------------------------------------------------------------------------

def slugify(text: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug or "unknown"


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except Exception:  # noqa: BLE001  (a missing or broken optional package is just "not there")
        return None
    return getattr(mod, "__version__", None)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except Exception:  # noqa: BLE001
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "date": _dt.date.today().isoformat(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "transfuse": _version("transfuse"),
        "git_commit": _git_commit(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=torch.cuda.get_device_name(0),
            gpu_count=torch.cuda.device_count(),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            gpu_capability=f"{props.major}.{props.minor}",
            gpu_sms=props.multi_processor_count,
        )
    else:
        env.update(gpu="cpu", gpu_count=0)
    env["gpu_slug"] = slugify(env["gpu"])
    return env


def result_stem(results: dict[str, Any]) -> str:
    """<YYYY-MM-DD>-<gpu-slug>-<benchmark>: the file name, without suffix, of every output of one run."""
    env = results["environment"]
    return f"{env['date']}-{env['gpu_slug']}-{results['benchmark']}"


# --- files ---------------------------------------------------------------------------------------

def write_json(results: dict[str, Any], path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, sort_keys=False, default=str) + "\n")
    return path


def write_outputs(results: dict[str, Any], out_dir: str | os.PathLike) -> dict[str, Path]:
    """JSON, markdown and (when matplotlib imports) PNG, side by side in out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = result_stem(results)
    paths = {"json": write_json(results, out / f"{stem}.json")}
    md = out / f"{stem}.md"
    md.write_text(markdown_report(results))
    paths["md"] = md
    png = out / f"{stem}.png"
    if save_chart(results, png):
        paths["png"] = png
    return paths


def write_text_results(results: dict[str, Any], text: str, out_dir: str | os.PathLike, name: str) -> None:
    """For benchmarks with their own tables (dynamic, decoder): <date>-<gpu>-<name>.json with the
    results and .md with `text`, then the text on stdout."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{results['date']}-{slugify(results['gpu'])}-{name}"
    # with_suffix would cut a name such as "llama-1.1b" at its dot: append instead.
    write_json(results, Path(f"{stem}.json"))
    Path(f"{stem}.md").write_text(text + "\n")
    print(f"wrote {stem}.json and .md")


def save_and_print(results: dict[str, Any], text: str, args, name: str) -> None:
    """A benchmark with its own tables: its files (unless --no-save), then the tables."""
    if not args.no_save:
        write_text_results(results, text, args.out, name)
    print(text)


# --- tables --------------------------------------------------------------------------------------

def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    if ms < 1:
        return f"{ms:.3f}"
    if ms < 100:
        return f"{ms:.2f}"
    return f"{ms:.0f}"


def fmt_err(err: float | None) -> str:
    return "-" if err is None else f"{err:.1e}"


def fmt_speedup(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}x" if x >= 0.1 else f"{x:.2g}x"


def _table(header: list[str], rows: Iterable[list[str]], left: int = 1) -> str:
    """A markdown table, padded to line up in a terminal; the first `left` columns left-aligned."""
    rows = list(rows)
    widths = [max([len(header[i]), *(len(r[i]) for r in rows)]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i < left else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    sep = "|" + "|".join("-" * (w + 2) if i < left else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def _cell(entry: dict[str, Any] | None, key: str, fmt, errors: list[str], provider: str) -> str:
    """The formatted value, or error[n] pointing at a footnote (one per distinct provider and message)."""
    if entry is None:
        return "-"
    if entry.get("error"):
        note = f"{provider}: {entry['error']}"
        if note not in errors:
            errors.append(note)
        return f"error[{errors.index(note) + 1}]"
    return fmt(entry.get(key))


def markdown_table(results: dict[str, Any]) -> str:
    """Headline table: ms per provider, the target's speedups, its error, the floor."""
    providers: list[str] = results["providers"]
    target = results.get("target")
    baselines = [b for b in results.get("headline_baselines", []) if b in providers and b != target]
    errors: list[str] = []
    header = ["shape", *(f"{p} ms" for p in providers)]
    if target in providers:
        header += [f"{target} vs {b}" for b in baselines]
        header += [f"{target} rel err"]
        if "eager" in providers and target != "eager":
            header += ["eager rel err"]
    header += ["floor ms"]
    rows = []
    for row in results["rows"]:
        entries = row["providers"]
        label = row["shape"]
        cells = [label]
        cells += [_cell(entries.get(p), "median_ms", fmt_ms, errors, p) for p in providers]
        if target in providers:
            t = entries.get(target) or {}
            for b in baselines:
                cells.append("-" if t.get("error") else fmt_speedup((t.get("speedup") or {}).get(b)))
            cells.append(_cell(t, "rel_err", fmt_err, errors, target))
            if "eager" in providers and target != "eager":
                cells.append(_cell(entries.get("eager"), "rel_err", fmt_err, errors, "eager"))
        cells.append(fmt_ms(row.get("floor_ms")))
        rows.append(cells)
    text = _table(header, rows)
    if errors:
        text += "\n\n" + "\n".join(f"[{i}] {e}" for i, e in enumerate(errors, 1))
    return text


def details_table(results: dict[str, Any]) -> str:
    """Per provider: p10/median/p90, first-call seconds and relative error, one row per shape."""
    providers: list[str] = results["providers"]
    header = ["shape", "provider", "p10 ms", "median ms", "p90 ms", "first call s", "rel err"]
    rows = []
    for row in results["rows"]:
        for p in providers:
            e = row["providers"].get(p)
            if e is None:
                continue
            if e.get("error"):
                first = e.get("first_call_s")
                rows.append([row["shape"], p, "-", "error", "-", "-" if first is None else f"{first:.2f}", "-"])
                continue
            rows.append([row["shape"], p, fmt_ms(e.get("p10_ms")), fmt_ms(e.get("median_ms")), fmt_ms(e.get("p90_ms")),
                         "-" if e.get("first_call_s") is None else f"{e['first_call_s']:.2f}", fmt_err(e.get("rel_err"))])
    return _table(header, rows, left=2)


def caption(results: dict[str, Any]) -> str:
    env = results["environment"]
    cfg = results.get("config", {})
    ceil = results.get("ceilings") or {}
    parts = [
        f"{results.get('title', results['benchmark'])}",
        f"{env.get('gpu')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, triton {env.get('triton')}, "
        f"transformers {env.get('transformers')}, Python {env.get('python')}, {env.get('date')}",
    ]
    if cfg:
        parts.append(", ".join(f"{k}={v}" for k, v in cfg.items() if not isinstance(v, (list, dict))))
    if ceil:
        parts.append(f"floor = max(FLOPs / {ceil['matmul_tflops']:.0f} TFLOP/s measured matmul, "
                     f"min bytes / {ceil['copy_gbps']:.0f} GB/s measured copy)")
    return "\n".join(parts)


def markdown_report(results: dict[str, Any]) -> str:
    title = results.get("title", results["benchmark"])
    context = [f"- {line}" for line in caption(results).splitlines()[1:]]
    return "\n".join([
        f"# {title}", "", *context, "",
        "Median latency (ms) of one forward call: CUDA events, GPU idle at the start of each call.", "",
        markdown_table(results), "",
        "## Details", "",
        details_table(results), "",
    ])


# --- chart ---------------------------------------------------------------------------------------

def save_chart(results: dict[str, Any], path: str | os.PathLike) -> bool:
    """Grouped bars of median ms per shape and provider, log scale, the floor as a line. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return False
    providers: list[str] = results["providers"]
    shapes = [row["shape"] for row in results["rows"]]
    width = 0.8 / max(1, len(providers))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(shapes) + 2), 4.5))
    for i, p in enumerate(providers):
        xs, ys = [], []
        for j, row in enumerate(results["rows"]):
            e = row["providers"].get(p) or {}
            if e.get("median_ms") is not None and not e.get("error"):
                xs.append(j - 0.4 + width * (i + 0.5))
                ys.append(e["median_ms"])
        color = f"C{i % 10}"
        ax.bar(xs, ys, width=width, label=p, color=color)
        for j, row in enumerate(results["rows"]):
            if (row["providers"].get(p) or {}).get("error"):  # failed: mark the empty slot
                ax.annotate("x", (j - 0.4 + width * (i + 0.5), 0.02), xycoords=("data", "axes fraction"),
                            ha="center", color=color)
    floors = [(j, row["floor_ms"]) for j, row in enumerate(results["rows"]) if row.get("floor_ms")]
    if floors:
        ax.plot([j for j, _ in floors], [f for _, f in floors], "k_-", markersize=18, linewidth=1, label="floor")
    ax.set_yscale("log")
    ax.set_xticks(range(len(shapes)), shapes)
    ax.set_xlim(-0.5, len(shapes) - 0.5)
    ax.set_xlabel("batch x seq")
    ax.set_ylabel("median latency, ms (log)")
    env = results["environment"]
    ax.set_title(f"{results.get('title', results['benchmark'])}\n{env.get('gpu')}, torch {env.get('torch')}, "
                 f"{env.get('date')}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --- progress ------------------------------------------------------------------------------------

class Progress:
    """A progress bar over `total` steps: rich if importable, else tqdm, else one printed line per step.

        with Progress(total, "encoder") as bar:
            bar.step("eager 8x128")      # describe the step about to run
            ...
            bar.advance()
            bar.log("a message that must not garble the bar")
    """

    def __init__(self, total: int, description: str = "", enabled: bool = True):
        self.total = total
        self.description = description
        self.enabled = enabled
        self._done = 0
        self._kind = "plain"
        self._bar: Any = None
        self._task: Any = None
        if not enabled:
            self._kind = "off"
            return
        try:
            import rich.progress as rp

            self._bar = rp.Progress(
                rp.SpinnerColumn(), rp.TextColumn("{task.description}"), rp.BarColumn(),
                rp.MofNCompleteColumn(), rp.TimeElapsedColumn(), transient=False,
            )
            self._kind = "rich"
            return
        except Exception:  # noqa: BLE001
            pass
        try:
            import tqdm

            self._bar = tqdm.tqdm(total=total, desc=description, file=sys.stderr)
            self._kind = "tqdm"
        except Exception:  # noqa: BLE001
            self._kind = "plain"

    def __enter__(self) -> "Progress":
        if self._kind == "rich":
            self._bar.__enter__()
            self._task = self._bar.add_task(self.description, total=self.total)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._kind == "rich":
            self._bar.__exit__(*exc)
        elif self._kind == "tqdm":
            self._bar.close()

    def step(self, label: str) -> None:
        text = f"{self.description} {label}".strip()
        if self._kind == "rich":
            self._bar.update(self._task, description=text)
        elif self._kind == "tqdm":
            self._bar.set_description(text)
        elif self._kind == "plain":
            print(f"[{self._done + 1}/{self.total}] {text}", file=sys.stderr, flush=True)

    def advance(self, n: int = 1) -> None:
        self._done += n
        if self._kind == "rich":
            self._bar.update(self._task, advance=n)
        elif self._kind == "tqdm":
            self._bar.update(n)

    def log(self, message: str) -> None:
        if self._kind == "rich":
            self._bar.console.print(message, markup=False, highlight=False, soft_wrap=True)
        elif self._kind == "tqdm":
            self._bar.write(message, file=sys.stderr)
        elif self._kind == "plain":
            print(message, file=sys.stderr, flush=True)
