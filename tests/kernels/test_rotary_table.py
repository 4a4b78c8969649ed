"""transfuse.kernels.rotary_table against Hugging Face's own formula (transfuse.reference.rotary_table)
on the CPU through Triton's interpreter (tiny shapes) and on the GPU (marked gpu, real sizes).

Equality is asserted to within 1 ulp of the output dtype, not bit for bit: the angles are the same
fp32 products, but under the interpreter cos/sin are numpy's and eager's are torch's own (SLEEF),
which differ in the last bit of fp32 for some angles (both within 1 ulp of the exact value). fp16 and
bf16 tables round that away almost always. A wrong product would not pass: at position ~5000 one
fp32 rounding of the angle moves cos by hundreds of fp32 ulps."""

import pytest
import torch

from transfuse.kernels.rotary_table import rotary_table_fwd
from transfuse.reference.rotary_table import rotary_table_ref

_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place of their dtype, across zero too (a float's bits, read as
    sign and magnitude, made a monotonic integer)."""
    assert a.dtype == b.dtype
    bits = torch.finfo(a.dtype).bits

    def ordered(t):
        i = t.contiguous().view(_INT[t.dtype]).to(torch.int64)
        magnitude = i & ((1 << (bits - 1)) - 1)
        return torch.where(i < 0, -magnitude, magnitude)

    return (ordered(a) - ordered(b)).abs()


def _inv_freq(half: int, base: float = 10000.0, device="cpu") -> torch.Tensor:
    """Hugging Face's default inv_freq for a head dim of 2 * half."""
    return 1.0 / (base ** (torch.arange(0, 2 * half, 2, dtype=torch.float, device=device) / (2 * half)))


def _check(inv_freq, positions, scaling, dtype, max_ulps=1):
    cos, sin = rotary_table_fwd(inv_freq, positions, scaling, dtype)
    ref_cos, ref_sin = rotary_table_ref(inv_freq, positions, scaling, dtype)
    for got, want in ((cos, ref_cos), (sin, ref_sin)):
        assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
        worst = _ulps(got, want).max().item() if got.numel() else 0
        assert worst <= max_ulps, f"{worst} ulps from Hugging Face's table"
    half = inv_freq.shape[0]
    assert torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])
    return cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("half", [8, 12, 40])  # head dims 16, 24 (a half that is not a power of two), 80
@pytest.mark.parametrize("scaling", [1.0, 1.2772588722239782])  # 1.2772...: yarn's 0.1 * ln(16) + 1
def test_rotary_table_matches_hugging_face_cpu(dtype, half, scaling):
    torch.manual_seed(half)
    positions = torch.randint(0, 5000, (2, 5))
    # In fp32 a 1-ulp difference in cos, times 1.28, may round to 2 ulps of the scaled value.
    _check(_inv_freq(half), positions, scaling, dtype, max_ulps=1 if scaling == 1.0 or dtype != torch.float32 else 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rotary_table_scales_then_rounds_once_cpu(dtype):
    """Bit for bit eager's order on the kernel's own cos/sin: times the scale cast to fp32, then one
    rounding to dtype (bf16 to nearest even, also under the interpreter)."""
    inv_freq, positions, scaling = _inv_freq(12), torch.randint(0, 5000, (2, 3)), 1.2772588722239782
    plain = rotary_table_fwd(inv_freq, positions, 1.0, torch.float32)
    scaled = rotary_table_fwd(inv_freq, positions, scaling, dtype)
    for got, base in zip(scaled, plain):
        assert torch.equal(got, (base * scaling).to(dtype))


@pytest.mark.parametrize("positions_dtype", [torch.int32, torch.float32, torch.float16])
def test_rotary_table_position_dtypes_and_strides_cpu(positions_dtype):
    """Positions in any dtype (read as HF's .float() reads them), strided (a column of a wider tensor)."""
    wide = torch.randint(0, 2000, (3, 2)).to(positions_dtype)
    positions = wide.t()  # (2, 3), strides (1, 2)
    _check(_inv_freq(12), positions, 1.0, torch.float16)


def test_rotary_table_decode_and_far_positions_cpu():
    """One position a row (a decode step), up to 131072 (long-context models), batch 1 and 2, and an
    inv_freq in bf16 (a model cast with .to(bf16) casts the buffer too) widened as HF's .float()."""
    _check(_inv_freq(4, base=500000.0), torch.tensor([[131071]]), 1.0, torch.float32)
    _check(_inv_freq(8), torch.tensor([[100_000], [77_777]]), 1.0, torch.bfloat16)
    _check(_inv_freq(8).to(torch.bfloat16), torch.tensor([[3, 4, 4999]]), 1.0, torch.float32)


def test_rotary_table_angle_is_the_fp32_product_cpu():
    """The angle is inv_freq * float(position) rounded once: at large angles a different rounding
    (a product in fp64, an FMA) moves cos by far more than an ulp."""
    inv_freq = _inv_freq(8)
    positions = torch.tensor([[4093, 4999]])
    cos, _ = rotary_table_fwd(inv_freq, positions, 1.0, torch.float32)
    fp32_angle = (positions.float()[..., None] * inv_freq).double().cos().float()
    fp64_angle = (positions.double()[..., None] * inv_freq.double()).cos().float()
    assert _ulps(cos[..., :8], fp32_angle).max() <= 1
    assert _ulps(cos[..., :8], fp64_angle).max() > 8  # the check above can tell the two apart


def test_rotary_table_empty_and_bad_input_cpu():
    cos, sin = rotary_table_fwd(_inv_freq(8), torch.zeros(2, 0, dtype=torch.long), 1.0, torch.float16)
    assert cos.shape == sin.shape == (2, 0, 16) and cos.dtype == torch.float16
    with pytest.raises(ValueError, match="1-D float inv_freq"):
        rotary_table_fwd(_inv_freq(8)[None], torch.zeros(1, 2, dtype=torch.long), 1.0, torch.float16)
    with pytest.raises(ValueError, match="positions"):
        rotary_table_fwd(_inv_freq(8), torch.zeros(3, dtype=torch.long), 1.0, torch.float16)
    with pytest.raises(ValueError, match="positions"):
        rotary_table_fwd(_inv_freq(8), torch.zeros(1, 3, dtype=torch.bool), 1.0, torch.float16)
    with pytest.raises(TypeError, match="writes"):
        rotary_table_fwd(_inv_freq(8), torch.zeros(1, 3, dtype=torch.long), 1.0, torch.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("half, base", [(64, 10000.0), (64, 500000.0), (40, 10000.0), (128, 1000000.0), (32, 10000.0)])
@pytest.mark.parametrize("batch, seq", [(1, 1), (8, 1), (3, 257), (1, 4096)])
def test_rotary_table_gpu(dtype, half, base, batch, seq, monkeypatch):
    """Real sizes, positions to 131072: within 1 ulp of eager's own table on the GPU (same fp32
    product, libdevice's cosf/sinf), and no farther from the fp64 cos/sin of that fp32 angle than
    eager is."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # Eager's K=1 bmm in true fp32 (its default): in TF32 it would round the angle's factors first.
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch.manual_seed(0)
    inv_freq = _inv_freq(half, base, device="cuda")
    positions = torch.randint(0, 131073, (batch, seq), device="cuda")
    positions[0, 0] = 131072
    scaling = 1.0 if half != 40 else 1.2772588722239782
    cos, sin = _check(inv_freq, positions, scaling, dtype)
    angle = (positions.float()[..., None] * inv_freq).double()  # the fp32 angle, exactly
    angle = torch.cat((angle, angle), dim=-1)
    eager = rotary_table_ref(inv_freq, positions, scaling, dtype)
    for ours, theirs, exact in zip((cos, sin), eager, (angle.cos() * scaling, angle.sin() * scaling)):
        err_ours = (ours.double() - exact).abs().max().item()
        err_theirs = (theirs.double() - exact).abs().max().item()
        assert err_ours <= 2 * err_theirs + 1e-7, f"transfuse {err_ours:.2e} vs eager {dtype} {err_theirs:.2e}"
