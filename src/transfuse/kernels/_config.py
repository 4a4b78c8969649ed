"""What every kernel file needs to know about where it runs.

Under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) `@triton.autotune` with several
configs fails and bf16 arithmetic is wrong unless values are widened to fp32 after loading, so
kernel files ask here instead of reading the environment themselves.
"""

import contextlib
import contextvars
import functools
import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def tune_configs(configs: list[triton.Config], interpret: triton.Config) -> list[triton.Config]:
    """The configs to autotune over: all of them on a GPU, the single `interpret` one under the interpreter."""
    return [interpret] if INTERPRET else configs


# Set by runtime/precompile.py while it dry-runs a graph: Triton launches only queue their compiles.
# Launchers that keep state about what has run (loaded, tuned) must not record anything then.
COMPILE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("transfuse_compile_only", default=False)


def compiling_only() -> bool:
    return COMPILE_ONLY.get()


# The launches a dry run has queued, by the launcher's own key (first_in_dry_run); one set per dry run.
_DRY_RUN_SEEN: contextvars.ContextVar[set | None] = contextvars.ContextVar("transfuse_dry_run_seen", default=None)


@contextlib.contextmanager
def dry_run_launches():
    """Inside: first_in_dry_run remembers launches (runtime/precompile.py's compile_only opens one)."""
    token = _DRY_RUN_SEEN.set(set())
    try:
        yield
    finally:
        _DRY_RUN_SEEN.reset(token)


def first_in_dry_run(launch) -> bool:
    """Whether a launcher meets `launch` (a hashable key of everything its compiles depend on) for the
    first time in this dry run; always True outside one. A launcher whose key comes again can skip
    queueing: the same compiles are queued already."""
    seen = _DRY_RUN_SEEN.get()
    if seen is None:
        return True
    if launch in seen:
        return False
    seen.add(launch)
    return True


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@functools.lru_cache(maxsize=64)
def _sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device, off_gpu: int = 4) -> int:
    """The streaming multiprocessors of `device` (a torch.device), cached per GPU; `off_gpu` for a CPU
    device (the interpreter), where launchers only need a small number of programs."""
    if device.type != "cuda":
        return off_gpu
    if device.index is None:
        import torch

        return _sm_count(torch.cuda.current_device())
    return _sm_count(device.index)


# Under the interpreter each program is a pass of Python over its tile's ops, so kernels whose
# interpreter tiles are tiny (so that kernel tests' tiny shapes cross every edge) take larger tiles
# for a problem over this many elements (a model test's activation or gradient).
_INTERPRET_LARGE_ELEMENTS = 2048


def interpreter_large(rows: int, cols: int) -> bool:
    """Whether, under the interpreter, a (rows, cols) problem takes a kernel's larger interpreter tiles."""
    return INTERPRET and rows * cols > _INTERPRET_LARGE_ELEMENTS


# -------------------------------------------------------------------------------------------------
# Programmatic dependent launch (Hopper and later): a kernel launched with launch_pdl=True may be
# scheduled while the kernel before it in the stream is finishing, and waits for it
# (griddepcontrol.wait) before touching memory. Inside a CUDA graph of small kernels this shortens
# each kernel-to-kernel gap: 0.99 -> 0.71 us for tiny kernels, 2.31 -> 1.81 us for a 768x768 GEMV
# (H100, bench/kernels/pdl_probe.py, 2026-11-22). Every kernel launched this way calls
# wait_for_previous_kernel(PDL) before its first load or store, so it sees exactly what a plain
# launch would. Level 2 also lets the next kernel launch at once (launch_dependents), so that its
# programs take free SMs early; on Llama-1.1B decode that was slower at batch 1 (1.17 against 1.12
# ms a step) and 3% faster at batch 8, and pulling the next GEMV's weights into L2 while the one
# before ran was slower still (1.26 ms): level 1 is the default.
# TRANSFUSE_PDL=0 turns it off, =2 tries the early launch.

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: PDL stays off
    gdc_launch_dependents = gdc_wait = None

_PDL_DEVICES: dict = {}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """PDL: 0 plain launch, 1 wait for the kernel before, 2 also let the next one launch now."""
    if PDL >= 1:
        gdc_wait()
    if PDL >= 2:
        gdc_launch_dependents()


def pdl_level() -> int:
    return int(os.environ.get("TRANSFUSE_PDL", "1") or "1")


def pdl(t) -> dict:
    """The kwargs a launch on t's device adds: PDL (the constexpr that makes the kernel wait) and
    launch_pdl, on a Hopper-or-later GPU; {"PDL": 0} elsewhere (CPU, interpreter, older GPUs)."""
    level = pdl_level()
    if INTERPRET or gdc_wait is None or t.device.type != "cuda" or level == 0:
        return _NO_PDL
    index = t.device.index
    on = _PDL_DEVICES.get(index)
    if on is None:
        import torch

        on = _PDL_DEVICES[index] = torch.cuda.get_device_capability(t.device)[0] >= 9
    return _PDL[level] if on else _NO_PDL


_NO_PDL = {"PDL": 0}
_PDL = {1: {"PDL": 1, "launch_pdl": True}, 2: {"PDL": 2, "launch_pdl": True}}
