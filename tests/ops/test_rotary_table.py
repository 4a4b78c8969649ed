"""torch.ops.transfuse.rotary_table: schema, opcheck, the fake implementation (shapes, strides, dtypes
exactly the real ones, the kernel's checks) and tracing through torch.compile."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import transfuse.ops.rotary_table  # noqa: F401  (registers the op)
from transfuse.reference.rotary_table import rotary_table_ref

ops = torch.ops.transfuse
SCHEMA = "transfuse::rotary_table(Tensor inv_freq, Tensor positions, float scaling, ScalarType dtype) -> (Tensor, Tensor)"


def _inv_freq(half: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, 2 * half, 2, dtype=torch.float) / (2 * half)))


def _cases():
    """(inv_freq, positions, scaling, dtype): integer and float positions, a strided one, half
    precision, a non-power-of-two half, a scale."""
    return [
        (_inv_freq(8), torch.randint(0, 4000, (2, 5)), 1.0, torch.float32),
        (_inv_freq(12), torch.randint(0, 4000, (1, 3)).int(), 1.2772588722239782, torch.float16),
        (_inv_freq(8).to(torch.bfloat16), torch.randint(0, 900, (3, 2)).float().t(), 1.0, torch.bfloat16),
        (_inv_freq(5), torch.randint(0, 4000, (2, 1)), 0.5, torch.float32),
    ]


def test_schema():
    assert str(ops.rotary_table.default._schema) == SCHEMA


@pytest.mark.parametrize("case", range(4))
def test_opcheck(case):
    torch.library.opcheck(ops.rotary_table.default, _cases()[case])


@pytest.mark.parametrize("case", range(4))
def test_op_matches_reference(case):
    args = _cases()[case]
    for got, want in zip(ops.rotary_table(*args), rotary_table_ref(*args), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-7 if want.dtype == torch.float32 else 1e-3)


@pytest.mark.parametrize("case", range(4))
def test_fake_matches_real(case):
    args = _cases()[case]
    real = ops.rotary_table(*args)
    with FakeTensorMode() as mode:
        fake = ops.rotary_table(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    for r, f in zip(real, fake, strict=True):
        assert (f.shape, f.stride(), f.dtype, f.device) == (r.shape, r.stride(), r.dtype, r.device)


def test_fake_rejects_what_the_kernel_rejects():
    with FakeTensorMode():
        inv_freq, positions = torch.empty(8), torch.empty(2, 3, dtype=torch.long)
        with pytest.raises(TypeError, match="writes"):
            ops.rotary_table(inv_freq, positions, 1.0, torch.float64)
        with pytest.raises(ValueError, match="positions"):
            ops.rotary_table(inv_freq, positions[0], 1.0, torch.float16)


def test_traces_through_compile():
    def tables(inv_freq, positions):
        cos, sin = ops.rotary_table(inv_freq, positions, 1.0, torch.float16)
        return cos * 2, sin + 1

    inv_freq, positions = _inv_freq(8), torch.randint(0, 100, (2, 3))
    compiled = torch.compile(tables, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(inv_freq, positions), tables(inv_freq, positions)):
        assert torch.equal(got, want)
