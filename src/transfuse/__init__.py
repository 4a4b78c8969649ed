"""transfuse: one line makes PyTorch transformer models run at the speed of the GPU.

    model = transfuse.optimize(model)      # or torch.compile(model, backend="transfuse")

capture (TorchDynamo) -> passes (FX rewrites) -> ops (torch.library) -> kernels (Triton) -> runtime
(CUDA graphs).
"""

from transfuse.backend import TransfuseError, transfuse_backend
from transfuse.capture import optimize, report, restore

__all__ = ["optimize", "restore", "report", "transfuse_backend", "TransfuseError"]
__version__ = "0.1.0"
