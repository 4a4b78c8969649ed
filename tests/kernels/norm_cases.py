"""What the norm kernel, op and backward tests share: shapes, dtypes with their tolerance, and the
default device."""

import pytest
import torch

SHAPES = [(3, 37, 80), (5, 123), (1, 16)]
# dtype, atol added to twice torch's own error against fp32 (each test says what it scales with)
DTYPES = [(torch.float32, 1e-5), (torch.float16, 1e-3), (torch.bfloat16, 1e-2)]


@pytest.fixture(autouse=True)
def default_device(device):
    """Tensors made without a device go to the GPU where there is one. On the CPU the default is left
    alone: the device mode slows the interpreter's many small tensor calls."""
    if device == "cpu":
        yield
        return
    torch.set_default_device(device)
    yield
    torch.set_default_device(None)
