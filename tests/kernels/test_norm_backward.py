"""Backward of the norm ops (transfuse.kernels.norm_backward, through the autograd formulas of
torch.ops.transfuse.{layer_norm, add_layer_norm, rms_norm, add_rms_norm}): gradients against the
fp32 reference's autograd, with a tolerance relative to PyTorch's own error in the same dtype.
Tiny shapes on CPU (Triton's interpreter); the `gpu` tests at the end take real sizes."""

import pytest
import torch
import torch.nn.functional as F

import transfuse.ops.norm  # noqa: F401  (registers the ops)
from transfuse.kernels.norm_backward import NormBwdConfig, layer_norm_bwd, norm_bwd_config, rms_norm_bwd
from tests.kernels.norm_cases import DTYPES, SHAPES, default_device  # noqa: F401  (default_device: autouse fixture)
from transfuse.reference.norm import add_layer_norm_ref, add_rms_norm_ref, layer_norm_ref, rms_norm_ref

ops = torch.ops.transfuse


# name: (weight dtype given x's dtype or None for no weight, weight_offset, cast_before_weight)
RMS_FLAVOURS = {
    "llama": (lambda dt: dt, 0.0, True),
    "gemma": (lambda dt: dt, 1.0, False),
    "torch_fp32_weight": (lambda dt: torch.float32, 0.0, False),
    "offset_cast_before_weight": (lambda dt: dt, 1.0, True),
    "no_weight_cast": (lambda dt: None, 0.0, True),
    "no_weight": (lambda dt: None, 0.0, False),
}
# name: (store_sum, whether the sum output gets a gradient downstream)
SUM_CASES = {"no_sum": (False, False), "sum_unused": (True, False), "sum_used": (True, True)}


def _randn(shape, dtype, scale=1.0, shift=0.0):
    return (scale * torch.randn(shape, dtype=torch.float32) + shift).to(dtype)


def _grads(fn, tensors, out_grads):
    """Gradients of fn(*tensors) w.r.t. every tensor that is not None, given the gradient of each
    output (None: that output is not used downstream)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    used = [(o, g) for o, g in zip(out, out_grads, strict=True) if g is not None]
    torch.autograd.backward([o for o, _ in used], [g for _, g in used])
    return [leaf.grad for leaf in leaves if leaf is not None]


def _upcast(tensors):
    return [None if t is None else t.float() for t in tensors]


def _assert_grads_within_torch_error(ours, torch_same, gold, atol):
    """Each gradient's error against the fp32 reference is at most twice torch's own in the same
    dtype, plus atol of the gradient's magnitude (torch in fp32 computes the reference's formula
    exactly, so its error there is 0 and only the summation order separates us)."""
    assert len(ours) == len(torch_same) == len(gold)
    for i, (o, t, g) in enumerate(zip(ours, torch_same, gold, strict=True)):
        assert o.shape == g.shape and o.dtype == t.dtype, f"grad {i}: {o.shape} {o.dtype} vs {g.shape} {t.dtype}"
        err_ours = (o.float() - g).abs().max().item()
        err_torch = (t.float() - g).abs().max().item()
        scale = g.abs().max().item()
        assert err_ours <= 2 * err_torch + atol * scale, (
            f"grad {i}: err {err_ours:.3g} vs torch {err_torch:.3g} (+{atol} * {scale:.3g})")


def _assert_mostly_equal(ours, eager):
    """Half-precision gradients rounded where eager autograd rounds them are eager's bit for bit
    except where the fp32 sums, taken in another order, sit on a rounding boundary. A rounding
    point missed or added (the sum x + residual, Llama's h.to(x.dtype)) flips a good fraction."""
    for i, (o, e) in enumerate(zip(ours, eager, strict=True)):
        if o.dtype == torch.float32:  # an fp32 weight's gradient: equal up to the summation order
            torch.testing.assert_close(o, e, msg=f"grad {i}")
            continue
        mismatched = (o != e).sum().item()
        assert mismatched <= max(0.01 * o.numel(), 2), f"grad {i}: {mismatched} of {o.numel()} differ from eager's"


def _check(op, ref, tensors, scalars, out_grads, atol, torch_same_fn=None, rounded_as_eager=True):
    """Our op's gradients against ref's in fp32 (gold) and in the inputs' dtype (torch's error:
    torch_same_fn's, or ref's run in that dtype, which is eager autograd of the model's code). With
    rounded_as_eager, half-precision gradients must also be mostly equal to ref's in that dtype."""
    ours = _grads(lambda *t: op(*t, *scalars), tensors, out_grads)
    gold = _grads(lambda *t: ref(*t, *scalars), _upcast(tensors), _upcast(out_grads))
    eager = _grads(lambda *t: ref(*t, *scalars), tensors, out_grads)
    torch_same = eager if torch_same_fn is None else _grads(lambda *t: torch_same_fn(*t, *scalars), tensors,
                                                             out_grads)
    _assert_grads_within_torch_error(ours, torch_same, gold, atol)
    if rounded_as_eager and tensors[0].dtype != torch.float32:
        _assert_mostly_equal(ours, eager)
    return ours


# ---------------------------------------------------------------------------------------------
# LayerNorm


def _f_layer_norm(x, weight, bias, eps):
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)


@pytest.mark.parametrize("has_weight,has_bias", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_backward(shape, dtype, atol, has_weight, has_bias):
    n = shape[-1]
    x = _randn(shape, dtype, scale=3.0, shift=1.5)  # a mean and a scale the gradient must see through
    weight = _randn((n,), dtype) if has_weight else None
    bias = _randn((n,), dtype) if has_bias else None
    dy = _randn(shape, dtype)
    _check(ops.layer_norm, layer_norm_ref, [x, weight, bias], [1e-3], [dy], atol, _f_layer_norm)


@pytest.mark.parametrize("dtype,atol", DTYPES[1:])
def test_layer_norm_backward_fp32_affine_on_half_input(dtype, atol):
    x, dy = _randn((4, 7, 96), dtype, shift=0.5), _randn((4, 7, 96), dtype)
    weight, bias = _randn((96,), torch.float32), _randn((96,), torch.float32)
    dx, dweight, dbias = _check(ops.layer_norm, layer_norm_ref, [x, weight, bias], [1e-5], [dy], atol)
    assert (dx.dtype, dweight.dtype, dbias.dtype) == (dtype, torch.float32, torch.float32)


@pytest.mark.parametrize("has_affine", [False, True])
@pytest.mark.parametrize("sum_case", list(SUM_CASES))
@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_add_layer_norm_backward(shape, dtype, atol, sum_case, has_affine):
    n = shape[-1]
    store_sum, sum_used = SUM_CASES[sum_case]
    x, residual = _randn(shape, dtype), _randn(shape, dtype, scale=2.0)
    weight = _randn((n,), dtype) if has_affine else None
    bias = _randn((n,), dtype) if has_affine else None
    out_grads = [_randn(shape, dtype), _randn(shape, dtype) if sum_used else None]
    # With the sum used, eager rounds the norm's gradient to x's dtype before adding the sum's,
    # where we add in fp32 and round once: closer to the reference, not equal to eager.
    dx, dresidual, *_ = _check(ops.add_layer_norm, add_layer_norm_ref, [x, residual, weight, bias],
                               [1e-3, store_sum], out_grads, atol, rounded_as_eager=not sum_used)
    assert torch.equal(dx, dresidual)  # d(x + residual) reaches both alike


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("store_sum", [False, True])
def test_autocast_block_backward_equals_eager(half, store_sum):
    """autocast's pre-norm block, `F.layer_norm(x + branch).to(half)` with x fp32 and the branch in
    half precision, as add_layer_norm(x, branch, ..., out_dtype=half) computes it in one kernel: the
    output, the sum and every gradient equal eager's (fp32 arithmetic both ways; the gradient of the
    half branch is rounded to its dtype, as eager's add rounds it)."""
    shape, n = (3, 5, 40), 40
    x, branch = _randn(shape, torch.float32, shift=0.5), _randn(shape, half, scale=2.0)
    weight, bias = _randn((n,), torch.float32), _randn((n,), torch.float32)
    dout, dsum = _randn(shape, half), _randn(shape, torch.float32)

    def eager(x, branch, weight, bias):
        s = x + branch
        return F.layer_norm(s, (n,), weight, bias, 1e-5).to(half), s

    def ours(x, branch, weight, bias):
        return ops.add_layer_norm(x, branch, weight, bias, 1e-5, store_sum, half)

    grads_in = [dout, dsum if store_sum else None]
    out, s = ours(x, branch, weight, bias)
    want_out, want_s = eager(x, branch, weight, bias)
    assert out.dtype == half and (s.dtype == torch.float32 if store_sum else s.numel() == 0)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0.02)  # at most one half-precision ulp apart
    if store_sum:
        assert torch.equal(s, want_s)
    got = _grads(ours, [x, branch, weight, bias], grads_in)
    want = _grads(eager, [x, branch, weight, bias], grads_in)
    for name, g, w in zip(("x", "branch", "weight", "bias"), got, want, strict=True):
        assert g.dtype == w.dtype, name
        torch.testing.assert_close(g.float(), w.float(), rtol=1e-2 if g.dtype == half else 1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("store_sum", [False, True])
def test_autocast_rms_block_backward_equals_eager(store_sum):
    """Llama's block under autocast: `rms_norm(x + branch)` on the fp32 stream, its output cast to bf16
    for the projections; add_rms_norm(..., out_dtype=bf16) gives eager's output, sum and gradients."""
    shape, n = (3, 5, 40), 40
    x, branch = _randn(shape, torch.float32, shift=0.5), _randn(shape, torch.bfloat16, scale=2.0)
    weight = _randn((n,), torch.float32)
    dout, dsum = _randn(shape, torch.bfloat16), _randn(shape, torch.float32)

    def eager(x, branch, weight):
        s = x + branch
        return rms_norm_ref(s, weight, 1e-6, 0.0, True).to(torch.bfloat16), s

    def ours(x, branch, weight):
        return ops.add_rms_norm(x, branch, weight, 1e-6, 0.0, True, store_sum, torch.bfloat16)

    grads_in = [dout, dsum if store_sum else None]
    out, s = ours(x, branch, weight)
    want_out, want_s = eager(x, branch, weight)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want_out, rtol=0, atol=0.02)
    if store_sum:
        assert torch.equal(s, want_s)
    got = _grads(ours, [x, branch, weight], grads_in)
    want = _grads(eager, [x, branch, weight], grads_in)
    for name, g, w in zip(("x", "branch", "weight"), got, want, strict=True):
        assert g.dtype == w.dtype, name
        torch.testing.assert_close(g.float(), w.float(), rtol=1e-2 if g.dtype == torch.bfloat16 else 1e-4,
                                   atol=1e-4, msg=name)


def test_out_dtype_must_not_widen():
    with pytest.raises(TypeError, match="out_dtype"):
        ops.layer_norm(torch.randn(2, 8, dtype=torch.bfloat16), None, None, 1e-5, torch.float32)


def test_layer_norm_backward_takes_a_half_gradient_of_an_fp32_input():
    """A norm that wrote bf16 (out_dtype) gets its gradient in bf16: the kernel widens it as it loads."""
    x, dy = _randn((4, 40), torch.float32), _randn((4, 40), torch.bfloat16)
    weight, bias = _randn((40,), torch.float32), _randn((40,), torch.float32)
    got = layer_norm_bwd(dy, x, weight, bias, 1e-5)
    want = layer_norm_bwd(dy.float(), x, weight, bias, 1e-5)
    for g, w in zip(got[:3], want[:3], strict=True):
        assert torch.equal(g, w)


# ---------------------------------------------------------------------------------------------
# RMSNorm


def _f_rms_norm(x, weight, eps, weight_offset, cast_before_weight):
    return F.rms_norm(x, x.shape[-1:], weight, eps)  # the flavour without offset, multiplied in fp32


def _rms_weight(n, dtype, flavour):
    weight_dtype, weight_offset, cast_before_weight = RMS_FLAVOURS[flavour]
    wdt = weight_dtype(dtype)
    # Gemma stores weight - 1: small values around zero
    weight = None if wdt is None else _randn((n,), wdt, scale=0.1 if weight_offset else 1.0)
    return weight, weight_offset, cast_before_weight


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("flavour", list(RMS_FLAVOURS))
@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_backward(shape, dtype, atol, flavour):
    x, dy = _randn(shape, dtype, scale=3.0), _randn(shape, dtype)
    weight, weight_offset, cast_before_weight = _rms_weight(shape[-1], dtype, flavour)
    torch_same = _f_rms_norm if flavour == "torch_fp32_weight" else None
    _check(ops.rms_norm, rms_norm_ref, [x, weight], [1e-3, weight_offset, cast_before_weight], [dy], atol,
           torch_same)


@pytest.mark.parametrize("flavour", ["llama", "gemma", "no_weight"])
@pytest.mark.parametrize("sum_case", list(SUM_CASES))
@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:2])
def test_add_rms_norm_backward(shape, dtype, atol, sum_case, flavour):
    store_sum, sum_used = SUM_CASES[sum_case]
    x, residual = _randn(shape, dtype), _randn(shape, dtype, scale=2.0)
    weight, weight_offset, cast_before_weight = _rms_weight(shape[-1], dtype, flavour)
    out_grads = [_randn(shape, dtype), _randn(shape, dtype) if sum_used else None]
    dx, dresidual, *_ = _check(ops.add_rms_norm, add_rms_norm_ref, [x, residual, weight],
                               [1e-3, weight_offset, cast_before_weight, store_sum], out_grads, atol,
                               rounded_as_eager=not sum_used)
    assert torch.equal(dx, dresidual)


# ---------------------------------------------------------------------------------------------
# Which gradients are computed, layouts, launch shapes


def test_only_the_gradients_asked_for():
    x, residual, dy = torch.randn(6, 40), torch.randn(6, 40), torch.randn(6, 40)
    weight, bias = torch.randn(40), torch.randn(40)
    full = _grads(lambda x, r, w, b: ops.add_layer_norm(x, r, w, b, 1e-5, False), [x, residual, weight, bias],
                  [dy, None])
    # weight alone: a frozen input under a trained norm
    w = weight.clone().requires_grad_(True)
    ops.add_layer_norm(x, residual, w, bias, 1e-5, False)[0].backward(dy)
    torch.testing.assert_close(w.grad, full[2])
    # residual alone
    r = residual.clone().requires_grad_(True)
    ops.add_layer_norm(x, r, weight, bias, 1e-5, False)[0].backward(dy)
    torch.testing.assert_close(r.grad, full[1])
    # the launcher skips what it is not asked for
    dx, dweight, dbias, *_ = layer_norm_bwd(dy, x, weight, bias, 1e-5, residual=residual, compute_dx=False,
                                        compute_dbias=False)
    assert dx is None and dbias is None
    torch.testing.assert_close(dweight, full[2])
    assert layer_norm_bwd(dy, x, None, None, 1e-5)[1:] == (None, None, None, None)
    dx, dweight, _ = rms_norm_bwd(dy, x, None, 1e-6, 0.0, True, compute_dweight=True)
    assert dweight is None and dx.shape == x.shape


def test_strided_inputs_and_gradients():
    # x seen through a transpose, the residual through a slice; the gradients arrive strided too
    x = torch.randn(37, 3, 80).transpose(0, 1)
    residual = torch.randn(3, 40, 100)[:, :37, :80]
    weight = torch.randn(80)
    c = torch.randn(37, 3, 80)

    def loss(add_rms_norm, layer_norm, x, residual, weight):
        out, s = add_rms_norm(x, residual, weight, 1e-6, 0.0, True, True)
        # out's gradient is c seen through the transpose, s's is 2s plus layer_norm's, whose own
        # gradient is `sum`'s, expanded: stride 0 everywhere
        return ((out.transpose(0, 1) * c).sum() + (s * s).sum() + layer_norm(s, weight, None, 1e-5).sum(),)

    ours = _grads(lambda *t: loss(ops.add_rms_norm, ops.layer_norm, *t), [x, residual, weight], [torch.tensor(1.0)])
    packed = _grads(lambda *t: loss(ops.add_rms_norm, ops.layer_norm, *t),
                    [x.contiguous(), residual.contiguous(), weight], [torch.tensor(1.0)])
    gold = _grads(lambda *t: loss(add_rms_norm_ref, layer_norm_ref, *t), [x, residual, weight], [torch.tensor(1.0)])
    for got, want, ref in zip(ours, packed, gold, strict=True):
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("n_programs,block_m", [(1, 1), (3, 2), (7, 4), (40, 1)])
def test_partial_sums_over_programs(n_programs, block_m):
    # 37 rows: groups of unequal length, a partial last tile, more programs than tiles
    x, residual, dy, dsum = (torch.randn(37, 80) for _ in range(4))
    weight, bias = torch.randn(80), torch.randn(80)
    config = NormBwdConfig(BLOCK_N=128, BLOCK_M=block_m, num_warps=4, n_programs=n_programs)
    dx, dweight, dbias, *_ = layer_norm_bwd(dy, x, weight, bias, 1e-5, residual=residual, dsum=dsum, config=config)
    gold = _grads(lambda x, r, w, b: add_layer_norm_ref(x, r, w, b, 1e-5, True), [x, residual, weight, bias],
                  [dy, dsum])
    for got, want in zip((dx, dweight, dbias), (gold[0], gold[2], gold[3]), strict=True):
        torch.testing.assert_close(got, want)
    dx, dweight, dbias, dx_sum, _ = layer_norm_bwd(dy, x, weight, bias, 1e-5, residual=residual, dsum=dsum,
                                                compute_dbias=False, compute_dx_sum=True, config=config)
    assert dbias is None
    torch.testing.assert_close(dx_sum, gold[0].sum(0))
    torch.testing.assert_close(dweight, gold[2])
    dx, dweight, _ = rms_norm_bwd(dy, x, weight, 1e-6, 1.0, False, config=config)
    gold = _grads(lambda x, w: rms_norm_ref(x, w, 1e-6, 1.0, False), [x, weight], [dy])
    torch.testing.assert_close(dx, gold[0])
    torch.testing.assert_close(dweight, gold[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dx_sum_is_the_sum_of_the_stored_dx(dtype):
    """compute_dx_sum: the column sums of dx as written in its dtype (fp32 accumulation, rounded once),
    what torch's sum over the rows of the dx tensor gives; weight and bias sums in their fp32."""
    x, dy = _randn((3, 13, 48), dtype), _randn((3, 13, 48), dtype)
    weight, bias = _randn((48,), torch.float32), _randn((48,), torch.float32)
    config = NormBwdConfig(BLOCK_N=64, BLOCK_M=2, num_warps=4, n_programs=5)
    dx, dweight, dbias, dx_sum, _ = layer_norm_bwd(dy, x, weight, bias, 1e-5, compute_dx_sum=True, config=config)
    assert dx_sum.dtype == dtype and dweight.dtype == bias.dtype == torch.float32
    assert torch.equal(dx_sum, dx.float().sum((0, 1)).to(dtype))
    plain = layer_norm_bwd(dy, x, weight, bias, 1e-5, config=config)
    for got, want in zip((dx, dweight, dbias), plain[:3], strict=True):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="needs compute_dx"):
        layer_norm_bwd(dy, x, weight, bias, 1e-5, compute_dx=False, compute_dx_sum=True)


@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float16])
def test_dx_cast_is_dx_rounded_and_what_dx_sum_sums(cast):
    """dx_cast: an fp32 residual stream with a bf16 projection added (autocast) gets dx.to(bf16) for
    the projection from the same pass, bit for bit; compute_dx_sum then sums that tensor."""
    x, residual, dy = _randn((2, 11, 40), torch.float32), _randn((2, 11, 40), torch.float32), _randn((2, 11, 40), cast)
    weight, bias = _randn((40,), torch.float32), _randn((40,), torch.float32)
    config = NormBwdConfig(BLOCK_N=64, BLOCK_M=2, num_warps=4, n_programs=3)
    dx, dweight, dbias, dx_sum, dx2 = layer_norm_bwd(dy, x, weight, bias, 1e-5, residual=residual,
                                                     compute_dx_sum=True, dx_cast=cast, config=config)
    assert dx.dtype == torch.float32 and torch.equal(dx2, dx.to(cast))
    assert dx_sum.dtype == cast and torch.equal(dx_sum, dx2.float().sum((0, 1)).to(cast))
    # CUDA autocast's graph sums the bf16 gradient straight into the fp32 bias: dtype=float32
    dx_sum32 = layer_norm_bwd(dy, x, weight, bias, 1e-5, residual=residual, compute_dx_sum=True, dx_cast=cast,
                              dx_sum_dtype=torch.float32, config=config)[3]
    torch.testing.assert_close(dx_sum32, dx2.float().sum((0, 1)), rtol=1e-6, atol=1e-6)
    rdx, rdweight, rdx2 = rms_norm_bwd(dy, x, weight, 1e-6, 0.0, True, residual=residual, dx_cast=cast, config=config)
    assert torch.equal(rdx2, rdx.to(cast))
    assert rms_norm_bwd(dy, x, weight, 1e-6, 0.0, True)[2] is None


def test_long_rows_one_per_tile():
    # N = 1100: BLOCK_N = 2048, one row per tile, the path of real hidden sizes
    assert norm_bwd_config(3, 1100, 4).BLOCK_M == 1
    x, dy, weight = torch.randn(3, 1100), torch.randn(3, 1100), torch.randn(1100)
    dx, dweight, _ = rms_norm_bwd(dy, x, weight, 1e-6, 0.0, True)
    gold = _grads(lambda x, w: rms_norm_ref(x, w, 1e-6, 0.0, True), [x, weight], [dy])
    torch.testing.assert_close(dx, gold[0])
    torch.testing.assert_close(dweight, gold[1])


def test_config():
    bert = norm_bwd_config(4096, 768, 264)
    assert (bert.BLOCK_N, bert.BLOCK_M, bert.num_warps, bert.n_programs) == (1024, 2, 4, 264)
    assert norm_bwd_config(4096, 4096, 264).num_warps == 8
    assert norm_bwd_config(1, 64, 264).n_programs == 1  # never more programs than rows
    assert norm_bwd_config(1, 64, 264).BLOCK_M == 1


def test_empty_rows():
    x = torch.randn(0, 4, 64, dtype=torch.float16)
    weight = torch.randn(64, dtype=torch.float16)
    dx, dweight, dbias, *_ = layer_norm_bwd(x, x, weight, weight, 1e-5)
    assert dx.shape == x.shape and torch.equal(dweight, torch.zeros_like(weight)) and dbias.dtype == weight.dtype


def test_errors():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="dy"):
        layer_norm_bwd(x[:2], x, None, None, 1e-5)
    with pytest.raises(ValueError, match="dsum"):
        rms_norm_bwd(x, x, None, 1e-6, 0.0, True, dsum=x.half())
    with pytest.raises(TypeError, match="weight"):
        rms_norm_bwd(x.half(), x.half(), torch.randn(32), 1e-6, 0.0, True)


# ---------------------------------------------------------------------------------------------
# The ops: opcheck with gradients (autograd registration, fake tensors, AOT dispatch) and training
# through torch.compile


def _opcheck_cases():
    x, residual = torch.randn(3, 5, 48), torch.randn(3, 5, 48)
    w, b = torch.randn(48), torch.randn(48)
    xh, rh, wh = x.half(), residual.half(), w.half()
    strided = torch.randn(5, 3, 48).transpose(0, 1)
    return [
        ("layer_norm", (x, w, b, 1e-5), (0, 1, 2)),
        ("layer_norm", (xh, None, None, 1e-3), (0,)),
        ("layer_norm", (strided, w, None, 1e-5), (1,)),
        ("add_layer_norm", (x, residual, w, b, 1e-5, True), (0, 1, 2, 3)),
        ("add_layer_norm", (xh, rh, wh, None, 1e-5, False), (0, 1, 2)),
        ("rms_norm", (x, w, 1e-6, 0.0, True), (0, 1)),
        ("rms_norm", (xh, w, 1e-6, 1.0, False), (0, 1)),
        ("add_rms_norm", (xh, rh, wh, 1e-6, 0.0, True, True), (0, 1, 2)),
        ("add_rms_norm", (x, strided, w, 1e-6, 1.0, False, False), (1, 2)),
    ]


OPCHECK_IDS = [f"{name}-{i}" for i, (name, _, _) in enumerate(_opcheck_cases())]


@pytest.mark.parametrize("case", range(len(OPCHECK_IDS)), ids=OPCHECK_IDS)
def test_opcheck_with_grad(case):
    name, args, trained = _opcheck_cases()[case]
    args = [a.detach().clone().requires_grad_(True) if i in trained else a for i, a in enumerate(args)]
    torch.library.opcheck(getattr(ops, name).default, args)


def test_opcheck_backward_ops():
    x, residual, dy = torch.randn(3, 5, 48), torch.randn(3, 5, 48), torch.randn(3, 5, 48)
    w, b = torch.randn(48), torch.randn(48).half()
    xh = x.half()
    torch.library.opcheck(ops.layer_norm_backward.default, (dy, x, residual, dy, w, b.float(), 1e-5, True, True, True))
    torch.library.opcheck(ops.layer_norm_backward.default, (dy.half(), xh, None, None, w, b, 1e-5, False, True, True))
    torch.library.opcheck(ops.layer_norm_backward.default, (dy, x, residual, dy, w, b.float(), 1e-5, True, False, True, True))
    torch.library.opcheck(ops.layer_norm_backward.default,
                          (dy, x, residual, dy, w, b.float(), 1e-5, True, True, True, True, torch.bfloat16))
    torch.library.opcheck(ops.layer_norm_backward.default,
                          (dy, x, residual, dy, w, b.float(), 1e-5, True, True, True, True, torch.bfloat16, torch.float32))
    torch.library.opcheck(ops.rms_norm_backward.default, (dy, x, x, None, w, 1e-6, 0.0, True, True, True, torch.float16))
    torch.library.opcheck(ops.rms_norm_backward.default, (dy.half(), xh, xh, None, b, 1e-6, 1.0, True, True, False))
    torch.library.opcheck(ops.rms_norm_backward.default, (dy, x, None, None, None, 1e-6, 0.0, False, True, True))


def test_trains_through_compile():
    def block(x, residual, w, b, w2):
        out, s = ops.add_layer_norm(x, residual, w, b, 1e-5, True)
        h = ops.rms_norm(out, w2, 1e-6, 0.0, True)
        out2, _ = ops.add_rms_norm(h, s, w2, 1e-6, 1.0, False, False)
        return ops.layer_norm(out2 * s, w, None, 1e-5).pow(2).sum()

    inputs = [torch.randn(2, 5, 32), torch.randn(2, 5, 32), torch.randn(32), torch.randn(32), torch.randn(32)]
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    eager = _grads(block, inputs, [torch.tensor(1.0)])
    traced = _grads(compiled, inputs, [torch.tensor(1.0)])
    for got, want in zip(traced, eager, strict=True):
        torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------------------------
# Real sizes on a GPU: BERT-base (8 x 512 tokens x 768) and a Llama-7B-wide row (4096 x 4096)

GPU_SIZES = [((8, 512, 768), 1e-12), ((4096, 4096), 1e-6)]
GPU_DTYPES = [(torch.float16, 1e-3), (torch.bfloat16, 1e-2)]


def _cuda(tensors):
    return [None if t is None else t.cuda() for t in tensors]


def _check_gpu(op, ref, tensors, scalars, out_grads, atol, torch_same_fn=None):
    """_check on the GPU, adding the relative (norm-wise) error, where a wrong row among many
    shows even when the largest error does not."""
    tensors, out_grads = _cuda(tensors), _cuda(out_grads)
    ours = _grads(lambda *t: op(*t, *scalars), tensors, out_grads)
    gold = _grads(lambda *t: ref(*t, *scalars), _upcast(tensors), _upcast(out_grads))
    torch_same = _grads(lambda *t: (torch_same_fn or ref)(*t, *scalars), tensors, out_grads)
    _assert_grads_within_torch_error(ours, torch_same, gold, atol)
    for i, (o, t, g) in enumerate(zip(ours, torch_same, gold, strict=True)):
        rel_ours = ((o.float() - g).norm() / g.norm()).item()
        rel_torch = ((t.float() - g).norm() / g.norm()).item()
        assert rel_ours <= 2 * rel_torch + 1e-6, f"grad {i}: relative err {rel_ours:.3g} vs torch {rel_torch:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", GPU_DTYPES)
@pytest.mark.parametrize("shape,eps", GPU_SIZES)
def test_gpu_layer_norm_backward(shape, eps, dtype, atol):
    n = shape[-1]
    x, dy = _randn(shape, dtype, scale=2.0, shift=0.5), _randn(shape, dtype)
    weight, bias = _randn((n,), dtype), _randn((n,), dtype)
    _check_gpu(ops.layer_norm, layer_norm_ref, [x, weight, bias], [eps], [dy], atol, _f_layer_norm)


@pytest.mark.gpu
@pytest.mark.parametrize("store_sum", [False, True])
@pytest.mark.parametrize("dtype,atol", GPU_DTYPES)
@pytest.mark.parametrize("shape,eps", GPU_SIZES)
def test_gpu_add_layer_norm_backward(shape, eps, dtype, atol, store_sum):
    n = shape[-1]
    x, residual = _randn(shape, dtype), _randn(shape, dtype, scale=3.0)
    weight, bias = _randn((n,), dtype), _randn((n,), dtype)
    out_grads = [_randn(shape, dtype), _randn(shape, dtype) if store_sum else None]
    _check_gpu(ops.add_layer_norm, add_layer_norm_ref, [x, residual, weight, bias], [eps, store_sum], out_grads,
               atol)


@pytest.mark.gpu
@pytest.mark.parametrize("flavour", ["llama", "gemma", "torch_fp32_weight"])
@pytest.mark.parametrize("dtype,atol", GPU_DTYPES)
@pytest.mark.parametrize("shape,eps", GPU_SIZES)
def test_gpu_rms_norm_backward(shape, eps, dtype, atol, flavour):
    x, dy = _randn(shape, dtype, scale=4.0), _randn(shape, dtype)
    weight, weight_offset, cast_before_weight = _rms_weight(shape[-1], dtype, flavour)
    _check_gpu(ops.rms_norm, rms_norm_ref, [x, weight], [eps, weight_offset, cast_before_weight], [dy], atol)


@pytest.mark.gpu
@pytest.mark.parametrize("store_sum", [False, True])
@pytest.mark.parametrize("dtype,atol", GPU_DTYPES)
@pytest.mark.parametrize("shape,eps", GPU_SIZES)
def test_gpu_add_rms_norm_backward(shape, eps, dtype, atol, store_sum):
    x, residual = _randn(shape, dtype), _randn(shape, dtype, scale=3.0)
    weight = _randn((shape[-1],), dtype)
    out_grads = [_randn(shape, dtype), _randn(shape, dtype) if store_sum else None]
    _check_gpu(ops.add_rms_norm, add_rms_norm_ref, [x, residual, weight], [eps, 0.0, True, store_sum],
               out_grads, atol)
