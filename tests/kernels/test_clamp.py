"""clamp_if_inf (T5's fp16 overflow guard) and clamp_if_nonfinite (BART's) equal the plain-PyTorch
guards: with and without an inf (or a NaN), NaN kept, one program and the flag + clamp pair, every
float dtype."""

import pytest
import torch

from transfuse.kernels.clamp import SINGLE_PROGRAM_ELEMENTS
from transfuse.ops.clamp import clamp_if_inf, clamp_if_nonfinite
from transfuse.reference.clamp import clamp_if_inf_ref, clamp_if_nonfinite_ref

FP16_MAX = torch.finfo(torch.float16).max


@pytest.mark.parametrize("n", [37, 5000, SINGLE_PROGRAM_ELEMENTS + 4099])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inf", [False, True])
def test_clamp_if_inf_equals_torch(n, dtype, inf, device):
    x = (torch.randn(n, device=device) * 3000).to(dtype)  # finite in fp16
    x[n // 3] = 65000.0  # above the inf-case bound (64512 in fp16): clamped only when an inf is present
    x[n // 2] = float("nan")
    if inf:
        x[n - 2] = -float("inf")  # in the last block: the flags must reach every program
    bounds = (FP16_MAX - 1000, FP16_MAX)
    out = clamp_if_inf(x, *bounds)
    ref = clamp_if_inf_ref(x, *bounds)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.equal(out.isnan(), ref.isnan())
    keep = ~ref.isnan()
    assert torch.equal(out[keep], ref[keep])
    bound = (FP16_MAX - 1000) if inf else FP16_MAX
    assert out[n // 3].item() == min(x[n // 3].item(), torch.tensor(bound).to(dtype).item())


def test_clamp_if_inf_non_contiguous_and_shape(device):
    x = torch.randn(3, 8, 5, device=device, dtype=torch.float16).transpose(0, 2) * 1000
    x[1, 2, 0] = float("inf")
    out = clamp_if_inf(x, 5.0, 7.0)
    assert out.shape == x.shape
    assert torch.equal(out, clamp_if_inf_ref(x, 5.0, 7.0))


def test_clamp_if_inf_opcheck(device):
    x = torch.randn(4, 16, device=device, dtype=torch.float16)
    torch.library.opcheck(torch.ops.transfuse.clamp_if_inf.default, (x, 1.0, 2.0))


@pytest.mark.parametrize("n", [37, SINGLE_PROGRAM_ELEMENTS + 4099])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("found", ["nothing", "inf", "nan"])
def test_clamp_if_nonfinite_equals_the_bart_guard(n, dtype, found, device):
    """BART's guard: a NaN fires it too, and with nothing found every value is kept, even one past
    the bound."""
    x = (torch.randn(n, device=device) * 3000).to(dtype)
    x[n // 3] = 65000.0
    if found == "inf":
        x[n - 2] = float("inf")
    elif found == "nan":
        x[n - 2] = float("nan")  # in the last block
    bound = FP16_MAX - 1000
    out = clamp_if_nonfinite(x, bound)
    ref = clamp_if_nonfinite_ref(x, bound)
    assert torch.equal(out.isnan(), ref.isnan())
    keep = ~ref.isnan()
    assert torch.equal(out[keep], ref[keep])
    assert (out[n // 3].item() == x[n // 3].item()) == (found == "nothing")


def test_clamp_if_nonfinite_opcheck(device):
    x = torch.randn(4, 16, device=device, dtype=torch.float16)
    x[1, 3] = float("inf")  # (opcheck compares with ==: no NaN)
    torch.library.opcheck(torch.ops.transfuse.clamp_if_nonfinite.default, (x, 2.0))
