"""Bad input: one-line errors that name the fix; nothing changes the user's model."""

import os
import subprocess
import sys

import pytest
import torch

import transfuse


def test_unsupported_dtype_is_refused():
    model = torch.nn.Linear(4, 4).double().eval()
    with pytest.raises(transfuse.TransfuseError, match=r"model\.half\(\)"):
        transfuse.optimize(model)


def test_cpu_without_interpreter_is_refused():
    code = (
        "import torch, transfuse\n"
        "m = torch.nn.Linear(4, 4).eval()\n"
        "try:\n    transfuse.optimize(m)\nexcept transfuse.TransfuseError as e:\n    print('ERR', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("ERR")]
    assert line and "TRITON_INTERPRET=1" in line[0] and "model.cuda()" in line[0], out.stdout + out.stderr


def test_unhandled_ops_are_left_alone_and_reported():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.cumsum(self.fc(x), dim=-1).softmax(dim=1)

    model = Odd().eval()
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        ref = model(x)
    transfuse.optimize(model)
    with torch.no_grad():
        out = model(x)
    torch.testing.assert_close(out, ref)
    text = transfuse.report(model)
    assert "ManualAttention" in text and "LinearEpilogue" in text
