"""torch.ops.transfuse norm ops: schema, opcheck, fake implementations (shapes, strides, dtypes
exactly the real ones) and tracing through torch.compile."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import transfuse.ops.norm  # noqa: F401  (registers the ops)
from tests.kernels.norm_cases import default_device  # noqa: F401  (default_device: autouse fixture)
from transfuse.reference.norm import add_layer_norm_ref, add_rms_norm_ref, layer_norm_ref, rms_norm_ref

ops = torch.ops.transfuse


SCHEMAS = {
    "layer_norm": "transfuse::layer_norm(Tensor x, Tensor? weight, Tensor? bias, float eps, "
    "ScalarType? out_dtype=None) -> Tensor",
    "add_layer_norm": "transfuse::add_layer_norm(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, "
    "float eps, bool store_sum, ScalarType? out_dtype=None) -> (Tensor, Tensor)",
    "rms_norm": "transfuse::rms_norm(Tensor x, Tensor? weight, float eps, float weight_offset, "
    "bool cast_before_weight, ScalarType? out_dtype=None) -> Tensor",
    "add_rms_norm": "transfuse::add_rms_norm(Tensor x, Tensor residual, Tensor? weight, float eps, "
    "float weight_offset, bool cast_before_weight, bool store_sum, ScalarType? out_dtype=None) -> (Tensor, Tensor)",
}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema(name):
    assert str(getattr(ops, name).default._schema) == SCHEMAS[name]


def _cases():
    """(op name, args) covering optional weights, store_sum, half precision and a strided x."""
    x = torch.randn(3, 5, 48)
    residual = torch.randn(3, 5, 48)
    w, b = torch.randn(48), torch.randn(48)
    xh, rh, wh = x.half(), residual.half(), w.half()
    strided = torch.randn(5, 3, 48).transpose(0, 1)
    return [
        ("layer_norm", (x, w, b, 1e-5)),
        ("layer_norm", (xh, None, None, 1e-3)),
        ("layer_norm", (strided, w, None, 1e-5)),
        ("add_layer_norm", (x, residual, w, b, 1e-5, True)),
        ("add_layer_norm", (xh, rh, wh, None, 1e-5, False)),
        # autocast's pre-norm block: fp32 residual stream + bf16 branch, output for a bf16 GEMM
        ("layer_norm", (x, w, b, 1e-5, torch.bfloat16)),
        ("add_layer_norm", (x, residual.bfloat16(), w, b, 1e-5, True, torch.bfloat16)),
        ("rms_norm", (x, w, 1e-6, 0.0, True)),
        ("rms_norm", (xh, w, 1e-6, 1.0, False)),
        ("rms_norm", (strided, None, 1e-6, 0.0, True)),
        ("add_rms_norm", (xh, rh, wh, 1e-6, 0.0, True, True)),
        ("add_rms_norm", (x, strided, w, 1e-6, 1.0, False, False)),
        ("rms_norm", (x, w, 1e-6, 0.0, True, torch.bfloat16)),
        ("add_rms_norm", (x, residual.bfloat16(), w, 1e-6, 0.0, True, True, torch.bfloat16)),
    ]


CASE_IDS = [f"{name}-{i}" for i, (name, _) in enumerate(_cases())]  # at collection: names only


@pytest.mark.parametrize("case", range(len(CASE_IDS)), ids=CASE_IDS)
def test_opcheck(case):
    name, args = _cases()[case]
    torch.library.opcheck(getattr(ops, name).default, args)


REFS = {
    "layer_norm": layer_norm_ref,
    "add_layer_norm": add_layer_norm_ref,
    "rms_norm": rms_norm_ref,
    "add_rms_norm": add_rms_norm_ref,
}


@pytest.mark.parametrize("case", range(len(CASE_IDS)), ids=CASE_IDS)
def test_op_matches_reference(case):
    name, args = _cases()[case]
    out = getattr(ops, name)(*args)
    expected = REFS[name](*args)
    for got, want in zip(out, expected) if isinstance(out, tuple) else [(out, expected)]:
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("case", range(len(CASE_IDS)), ids=CASE_IDS)
def test_fake_matches_real(case):
    name, args = _cases()[case]
    real = getattr(ops, name)(*args)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = getattr(ops, name)(*fake_args)
    real = real if isinstance(real, tuple) else (real,)
    fake = fake if isinstance(fake, tuple) else (fake,)
    for r, f in zip(real, fake, strict=True):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)


def test_fake_without_sum_is_empty():
    with FakeTensorMode():
        x = torch.empty(2, 7, 64, dtype=torch.bfloat16)
        _, s = ops.add_rms_norm(x, x, None, 1e-6, 0.0, True, False)
        assert s.shape == (0,) and s.dtype == torch.bfloat16
        _, s = ops.add_layer_norm(x, x, None, None, 1e-5, True)
        assert s.shape == x.shape and s.is_contiguous()


def test_fake_rejects_what_the_kernel_rejects():
    with FakeTensorMode():
        x = torch.empty(2, 64, dtype=torch.float16)
        with pytest.raises(ValueError, match="residual"):
            ops.add_layer_norm(x, x.float(), None, None, 1e-5, True)
        with pytest.raises(TypeError, match="weight"):
            ops.rms_norm(x, torch.empty(64), 1e-6, 0.0, True)


def test_traces_through_compile():
    def block(x, residual, w, b):
        out, s = ops.add_layer_norm(x, residual, w, b, 1e-5, True)
        h = ops.rms_norm(out, w, 1e-6, 0.0, True)
        return ops.layer_norm(h + s, w, None, 1e-5)

    x, residual, w, b = torch.randn(2, 5, 32), torch.randn(2, 5, 32), torch.randn(32), torch.randn(32)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, residual, w, b), block(x, residual, w, b))
