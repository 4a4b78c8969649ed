"""Norm kernels (transfuse.kernels.norm) against the plain-PyTorch references, and the references
against the eager modules they stand for. Tiny shapes: on CPU the kernels run in Triton's
interpreter."""

import pytest
import torch
import torch.nn.functional as F

from transfuse.kernels.norm import (
    MAX_N,
    NormConfig,
    add_layer_norm_fwd,
    add_rms_norm_fwd,
    layer_norm_fwd,
    norm_config,
    rms_norm_fwd,
)
from tests.kernels.norm_cases import DTYPES, SHAPES, default_device  # noqa: F401  (default_device: autouse fixture)
from transfuse.reference.norm import add_layer_norm_ref, add_rms_norm_ref, layer_norm_ref, rms_norm_ref


# name: (weight dtype given x's dtype or None for no weight, weight_offset, cast_before_weight)
RMS_FLAVOURS = {
    "llama": (lambda dt: dt, 0.0, True),
    "gemma": (lambda dt: dt, 1.0, False),
    "torch_fp32_weight": (lambda dt: torch.float32, 0.0, False),
    "no_weight": (lambda dt: None, 0.0, True),
}


def _randn(shape, dtype):
    return torch.randn(shape, dtype=torch.float32).to(dtype)


def _assert_within_torch_error(ours, torch_same, gold, atol):
    """Our error against the fp32 reference is at most twice torch's own in the same dtype."""
    assert ours.shape == gold.shape
    err_ours = (ours.float() - gold.float()).abs().max().item()
    err_torch = (torch_same.float() - gold.float()).abs().max().item()
    assert err_ours <= 2 * err_torch + atol, f"err {err_ours:.3g} vs torch {err_torch:.3g} (+{atol})"


def _assert_close_to_same_dtype(ours, ref):
    """The same formula in the same dtype agrees to about one rounding of the output and, in half
    precision, bit for bit almost everywhere: only where torch's statistics differ from ours in
    their last fp32 bit (another summation order) can a rounding of the output flip. A missing
    intermediate rounding (Llama's h.to(x.dtype)) flips a good fraction instead."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref)  # dtype-aware defaults: a couple of ulps
    if ours.dtype != torch.float32:
        mismatched = (ours != ref).sum().item()
        assert mismatched <= max(0.01 * ours.numel(), 2), f"{mismatched} of {ours.numel()} elements differ from eager's"


def _affine(n, dtype, has_weight, has_bias):
    weight = _randn((n,), dtype) if has_weight else None
    bias = _randn((n,), dtype) if has_bias else None
    return weight, bias


def _upcast(t):
    return None if t is None else t.float()


# ---------------------------------------------------------------------------------------------
# LayerNorm


@pytest.mark.parametrize("has_weight,has_bias", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm(shape, dtype, atol, has_weight, has_bias):
    eps = 1e-3
    x = 3 * _randn(shape, dtype) + 1.5  # a mean and a scale that the normalisation must remove
    weight, bias = _affine(shape[-1], dtype, has_weight, has_bias)
    out = layer_norm_fwd(x, weight, bias, eps)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    gold = layer_norm_ref(x.float(), _upcast(weight), _upcast(bias), eps)
    _assert_within_torch_error(out, F.layer_norm(x, shape[-1:], weight, bias, eps), gold, atol)
    _assert_close_to_same_dtype(out, layer_norm_ref(x, weight, bias, eps))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layer_norm_fp32_affine_on_half_input(dtype):
    x = _randn((4, 96), dtype)
    weight, bias = _randn((96,), torch.float32), _randn((96,), torch.float32)
    out = layer_norm_fwd(x, weight, bias, 1e-5)
    assert out.dtype == dtype
    _assert_close_to_same_dtype(out, layer_norm_ref(x, weight, bias, 1e-5))


@pytest.mark.parametrize("has_affine", [False, True])
@pytest.mark.parametrize("store_sum", [False, True])
@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_layer_norm(shape, dtype, atol, store_sum, has_affine):
    eps = 1e-3
    x, residual = _randn(shape, dtype), 2 * _randn(shape, dtype)
    weight, bias = _affine(shape[-1], dtype, has_affine, has_affine)
    out, s = add_layer_norm_fwd(x, residual, weight, bias, eps, store_sum)
    if store_sum:
        # the sum is eager's, rounded to x's dtype: bit for bit
        assert s.dtype == dtype and s.is_contiguous()
        assert torch.equal(s, x + residual)
    else:
        assert s.shape == (0,) and s.dtype == dtype
    gold = layer_norm_ref(x.float() + residual.float(), _upcast(weight), _upcast(bias), eps)
    torch_same = F.layer_norm(x + residual, shape[-1:], weight, bias, eps)
    _assert_within_torch_error(out, torch_same, gold, atol)
    _assert_close_to_same_dtype(out, add_layer_norm_ref(x, residual, weight, bias, eps, store_sum)[0])


# ---------------------------------------------------------------------------------------------
# RMSNorm


def _rms_args(n, dtype, flavour):
    weight_dtype, weight_offset, cast_before_weight = RMS_FLAVOURS[flavour]
    wdt = weight_dtype(dtype)
    # Gemma stores weight - 1 (zeros at init): small values around zero
    weight = None if wdt is None else (0.1 if weight_offset else 1.0) * _randn((n,), wdt)
    return weight, weight_offset, cast_before_weight


@pytest.mark.parametrize("flavour", list(RMS_FLAVOURS))
@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(shape, dtype, atol, flavour):
    eps = 1e-3
    x = 3 * _randn(shape, dtype)
    weight, weight_offset, cast_before_weight = _rms_args(shape[-1], dtype, flavour)
    out = rms_norm_fwd(x, weight, eps, weight_offset, cast_before_weight)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    gold = rms_norm_ref(x.float(), _upcast(weight), eps, weight_offset, cast_before_weight)
    torch_same = rms_norm_ref(x, weight, eps, weight_offset, cast_before_weight)
    _assert_within_torch_error(out, torch_same, gold, atol)
    _assert_close_to_same_dtype(out, torch_same)


@pytest.mark.parametrize("cast_before_weight", [True, False])
@pytest.mark.parametrize("weight_dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_of_fp32_x_with_a_half_weight_promotes_like_eager(weight_dtype, cast_before_weight):
    """Mamba's fp32 residual stream normed with a half-precision weight: eager's `weight * h` takes
    the product in fp32 (type promotion); the kernel widens the weight exactly and gives the same."""
    eps = 1e-5
    x = 3 * _randn((5, 48), torch.float32)
    weight = _randn((48,), weight_dtype)
    out = rms_norm_fwd(x, weight, eps, 0.0, cast_before_weight)
    eager = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))  # MambaRMSNorm.forward for fp32 x
    assert out.dtype == eager.dtype == torch.float32
    torch.testing.assert_close(out, eager)


@pytest.mark.parametrize("flavour", ["llama", "gemma"])
@pytest.mark.parametrize("store_sum", [False, True])
@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm(shape, dtype, atol, store_sum, flavour):
    eps = 1e-3
    x, residual = _randn(shape, dtype), 2 * _randn(shape, dtype)
    weight, weight_offset, cast_before_weight = _rms_args(shape[-1], dtype, flavour)
    out, s = add_rms_norm_fwd(x, residual, weight, eps, weight_offset, cast_before_weight, store_sum)
    if store_sum:
        assert s.dtype == dtype and torch.equal(s, x + residual)
    else:
        assert s.shape == (0,) and s.dtype == dtype
    gold = rms_norm_ref(x.float() + residual.float(), _upcast(weight), eps, weight_offset, cast_before_weight)
    torch_same = add_rms_norm_ref(x, residual, weight, eps, weight_offset, cast_before_weight, store_sum)[0]
    _assert_within_torch_error(out, torch_same, gold, atol)
    _assert_close_to_same_dtype(out, torch_same)


# ---------------------------------------------------------------------------------------------
# Every op, one property each


def _all_ops(x, residual, weight, bias, eps):
    """name -> output of each op on these inputs (the add_ ops storing the sum)."""
    return {
        "layer_norm": layer_norm_fwd(x, weight, bias, eps),
        "add_layer_norm": torch.cat([t.flatten() for t in add_layer_norm_fwd(x, residual, weight, bias, eps, True)]),
        "rms_norm": rms_norm_fwd(x, weight, eps, 0.0, True),
        "add_rms_norm": torch.cat([t.flatten() for t in add_rms_norm_fwd(x, residual, weight, eps, 1.0, False, True)]),
    }


def test_eps_is_the_one_given():
    # rows of small variance, where eps dominates: 0.5 and 1e-5 give visibly different outputs
    x, residual = 0.1 * torch.randn(4, 48), 0.1 * torch.randn(4, 48)
    weight = torch.randn(48)
    for eps in (0.5, 1e-5):
        s = x + residual
        expected = {
            "layer_norm": layer_norm_ref(x, weight, None, eps),
            "add_layer_norm": torch.cat([layer_norm_ref(s, weight, None, eps).flatten(), s.flatten()]),
            "rms_norm": rms_norm_ref(x, weight, eps, 0.0, True),
            "add_rms_norm": torch.cat([rms_norm_ref(s, weight, eps, 1.0, False).flatten(), s.flatten()]),
        }
        for name, out in _all_ops(x, residual, weight, None, eps).items():
            torch.testing.assert_close(out, expected[name], msg=f"{name} eps={eps}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_stays_in_its_row(dtype):
    # (5, 123): all five rows share one program, so the row reductions must keep them apart
    x, residual = _randn((5, 123), dtype), _randn((5, 123), dtype)
    weight, bias = _randn((123,), dtype), _randn((123,), dtype)
    clean = _all_ops(x, residual, weight, bias, 1e-5)
    x[2, 7] = float("nan")
    dirty = _all_ops(x, residual, weight, bias, 1e-5)
    for name in clean:
        n_out = 5 * 123
        out_clean, out_dirty = clean[name][:n_out].view(5, 123), dirty[name][:n_out].view(5, 123)
        assert out_dirty[2].isnan().all(), name
        rows = [0, 1, 3, 4]
        assert torch.equal(out_dirty[rows], out_clean[rows]), name


def _layouts():
    """(name, x view, residual view) pairs with leading strides that are not contiguous."""
    n = 80
    sliced = torch.randn(3, 40, 100)[:, :37, :n]  # two leading groups: (4000, 100)
    transposed = torch.randn(37, 3, n).transpose(0, 1)  # (3, 37, n) with strides (n, 3n, 1)
    every_other_row = torch.randn(3, 74, n)[:, ::2]  # collapses to one row stride
    permuted = torch.randn(4, 3, 2, n).permute(2, 1, 0, 3)  # three groups: copied
    strided_last = torch.randn(3, 37, 2 * n)[..., ::2]  # last-dim stride 2: copied
    contiguous = torch.randn(3, 37, n)
    return [
        ("sliced", sliced, contiguous),
        ("transposed", transposed, sliced),
        ("every_other_row", every_other_row, transposed),
        ("permuted", permuted, torch.randn(2, 3, 4, n)),
        ("strided_last", strided_last, strided_last.flip(0)),
    ]


@pytest.mark.parametrize("case", range(5), ids=[c[0] for c in _layouts()])
def test_strided_inputs(case):
    _, x, residual = _layouts()[case]
    weight, bias = torch.randn(80), torch.randn(80)
    strided = _all_ops(x, residual, weight, bias, 1e-5)
    packed = _all_ops(x.contiguous(), residual.contiguous(), weight, bias, 1e-5)
    for name in strided:
        assert strided[name].is_contiguous()
        # not torch.equal: on a GPU the layout (vector width, hence summation order) follows the
        # strides' alignment, so the last fp32 bit may differ; a wrong stride is off by far more
        torch.testing.assert_close(strided[name], packed[name], msg=name)


def test_long_rows_one_per_program():
    # N = 1100 takes BLOCK_N = 2048 with one row per program: the path of real hidden sizes
    assert norm_config(3, 1100).ROWS_PER_PROGRAM == 1
    x, residual, weight, bias = torch.randn(3, 1100), torch.randn(3, 1100), torch.randn(1100), torch.randn(1100)
    out, s = add_layer_norm_fwd(x, residual, weight, bias, 1e-5, True)
    assert torch.equal(s, x + residual)
    torch.testing.assert_close(out, layer_norm_ref(x + residual, weight, bias, 1e-5))
    out = rms_norm_fwd(x, weight, 1e-6, 0.0, True)
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6, 0.0, True))


def test_explicit_config():
    x, weight = torch.randn(7, 80), torch.randn(80)
    for rows in (1, 2, 4):
        config = NormConfig(BLOCK_N=128, ROWS_PER_PROGRAM=rows, num_warps=4)
        out = rms_norm_fwd(x, weight, 1e-6, 0.0, True, config=config)
        torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6, 0.0, True))


def test_empty_rows():
    x = torch.randn(0, 4, 64, dtype=torch.float16)
    out, s = add_rms_norm_fwd(x, x, None, 1e-6, 0.0, True, True)
    assert out.shape == x.shape and s.shape == x.shape
    assert layer_norm_fwd(x, None, None, 1e-5).shape == x.shape


def test_config_follows_row_length():
    bert = norm_config(16384, 768)
    assert (bert.BLOCK_N, bert.ROWS_PER_PROGRAM, bert.num_warps) == (1024, 4, 2)  # swept on an H200
    assert norm_config(16384, 4096).num_warps == 8
    assert norm_config(16384, 8192).num_warps == 16
    assert norm_config(16384, 64).ROWS_PER_PROGRAM == 16
    assert norm_config(1, 64).ROWS_PER_PROGRAM == 1  # never more rows than there are


def test_errors():
    x = torch.randn(4, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="residual"):
        add_layer_norm_fwd(x, x.float(), None, None, 1e-5, True)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm_fwd(x, x[:2], None, 1e-5, 0.0, True, True)
    with pytest.raises(TypeError, match="weight"):  # Llama form with an fp32 weight would promote
        rms_norm_fwd(x, torch.randn(32), 1e-6, 0.0, True)
    with pytest.raises(ValueError, match="weight_offset"):
        rms_norm_fwd(x, None, 1e-6, 1.0, False)
    with pytest.raises(ValueError, match="shape"):
        layer_norm_fwd(x, torch.randn(31, dtype=torch.float16), None, 1e-5)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        layer_norm_fwd(x.double(), None, None, 1e-5)
    with pytest.raises(ValueError, match="MAX_N"):
        rms_norm_fwd(torch.empty(1, MAX_N + 1), None, 1e-6, 0.0, True)


# ---------------------------------------------------------------------------------------------
# The references are the eager code they name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_references_match_hugging_face_modules(dtype):
    pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    n, eps = 96, 1e-6
    x = 3 * _randn((4, 7, n), dtype)
    with torch.no_grad():
        llama = LlamaRMSNorm(n, eps=eps).to(dtype)
        llama.weight.copy_(torch.randn(n))
        assert torch.equal(rms_norm_ref(x, llama.weight, eps, 0.0, True), llama(x))
        t5 = T5LayerNorm(n, eps=eps).to(dtype)
        t5.weight.copy_(torch.randn(n))
        assert torch.equal(rms_norm_ref(x, t5.weight, eps, 0.0, True), t5(x))
        gemma = GemmaRMSNorm(n, eps=eps).to(dtype)
        gemma.weight.copy_(0.1 * torch.randn(n))
        assert torch.equal(rms_norm_ref(x, gemma.weight, eps, 1.0, False), gemma(x))


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_references_match_torch_functional(dtype):
    n, eps = 96, 1e-5
    x = 3 * _randn((4, 7, n), dtype) + 1
    weight, bias = _randn((n,), dtype), _randn((n,), dtype)
    # torch reduces in another order: equal up to the last bit
    torch.testing.assert_close(layer_norm_ref(x, weight, bias, eps), F.layer_norm(x, (n,), weight, bias, eps))
    weight32 = torch.randn(n)
    torch.testing.assert_close(rms_norm_ref(x, weight32, eps, 0.0, False), F.rms_norm(x, (n,), weight32, eps))
    residual = _randn((4, 7, n), dtype)
    _, s = add_layer_norm_ref(x, residual, weight, bias, eps, True)
    assert torch.equal(s, x + residual)
    assert add_rms_norm_ref(x, residual, weight, eps, 0.0, True, False)[1].shape == (0,)


def test_few_rows_spread_on_a_gpu_grouped_under_the_interpreter(monkeypatch):
    import transfuse.kernels.norm as norm_module

    monkeypatch.setattr(norm_module, "INTERPRET", False)
    assert norm_config(128, 768).ROWS_PER_PROGRAM == 1  # few rows: one program each (bert 1x128)
    assert norm_config(4096, 768).ROWS_PER_PROGRAM == 4
    monkeypatch.setattr(norm_module, "INTERPRET", True)  # a program costs milliseconds of Python there
    assert norm_config(128, 768).ROWS_PER_PROGRAM == 4
