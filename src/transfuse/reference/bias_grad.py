"""Plain-PyTorch bias gradient of a linear: the oracle for transfuse.kernels.bias_grad.

    bias_grad_ref(dy, out_dtype) = dy summed over every dim but the last, (N,), in out_dtype

dy: (..., N). With upcast=True the sum is taken in fp64 (the tests' gold); otherwise the eager way,
torch's own reduction (fp32 accumulation for 16-bit inputs) rounded to out_dtype.
"""

from __future__ import annotations

import torch


def bias_grad_ref(dy: torch.Tensor, out_dtype: torch.dtype | None = None, upcast: bool = False) -> torch.Tensor:
    """sum of dy over its leading dims; fp64 with upcast=True (returns fp64)."""
    rows = dy.reshape(-1, dy.shape[-1])
    if upcast:
        return rows.double().sum(0)
    return rows.sum(0, dtype=torch.float32).to(dy.dtype if out_dtype is None else out_dtype)
