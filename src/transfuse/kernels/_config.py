"""What every kernel file needs to know about where it runs.

Under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) `@triton.autotune` with several
configs fails and bf16 arithmetic is wrong unless values are widened to fp32 after loading, so
kernel files ask here instead of reading the environment themselves.
"""

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def tune_configs(configs: list[triton.Config], interpret: triton.Config) -> list[triton.Config]:
    """The configs to autotune over: all of them on a GPU, the single `interpret` one under the interpreter."""
    return [interpret] if INTERPRET else configs


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


# -------------------------------------------------------------------------------------------------
# Programmatic dependent launch (Hopper and later): a kernel launched with launch_pdl=True may be
# scheduled while the kernel before it in the stream is still finishing, and waits for it
# (griddepcontrol.wait) before touching memory. Inside a CUDA graph of small kernels this shortens
# each kernel-to-kernel gap: 0.99 -> 0.71 us for tiny kernels, 2.31 -> 1.81 us for a 768x768 GEMV
# (H100, bench/kernels/pdl_probe.py, 2026-11-22). Every kernel launched this way calls
# wait_for_previous_kernel(PDL) first, before any load or store, so it sees exactly what a plain
# launch would: no read of its inputs and no write of its outputs can overtake the kernel before.
# TRANSFUSE_PDL=0 turns it off.

try:
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # a Triton without grid dependency control: PDL stays off
    gdc_wait = None

_PDL_DEVICES: dict = {}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    if PDL:
        gdc_wait()


def pdl(t) -> dict:
    """The kwargs a launch on t's device adds: PDL (the constexpr that makes the kernel wait) and
    launch_pdl, on a Hopper-or-later GPU; {"PDL": False} elsewhere (CPU, interpreter, older GPUs)."""
    if INTERPRET or gdc_wait is None or t.device.type != "cuda" or os.environ.get("TRANSFUSE_PDL", "1") == "0":
        return _NO_PDL
    index = t.device.index
    on = _PDL_DEVICES.get(index)
    if on is None:
        import torch

        on = _PDL_DEVICES[index] = torch.cuda.get_device_capability(t.device)[0] >= 9
    return _PDL_ON if on else _NO_PDL


_NO_PDL = {"PDL": False}
_PDL_ON = {"PDL": True, "launch_pdl": True}
