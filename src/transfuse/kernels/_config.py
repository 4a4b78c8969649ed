"""What every kernel file needs to know about where it runs.

Under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) `@triton.autotune` with several
configs fails and bf16 arithmetic is wrong unless values are widened to fp32 after loading, so
kernel files ask here instead of reading the environment themselves.
"""

import os

import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def tune_configs(configs: list[triton.Config], interpret: triton.Config) -> list[triton.Config]:
    """The configs to autotune over: all of them on a GPU, the single `interpret` one under the interpreter."""
    return [interpret] if INTERPRET else configs


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
