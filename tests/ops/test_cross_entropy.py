"""torch.ops.transfuse.linear_logits_cross_entropy (and its backward op): the LM head and its loss
for a model that returns its logits too. Logits, loss and the gradients of x, weight and bias
against plain PyTorch (F.linear, then F.cross_entropy of the upcast logits) for every reduction,
with ignored rows, label smoothing, padded and unpadded vocabularies, a gradient reaching the
logits output or not, half precision with fp32 parameters (autocast's case), and opcheck.

Run: PYTHONPATH=src TRITON_INTERPRET=1 python3 -m pytest -q tests/ops/test_cross_entropy.py"""

import pytest
import torch
import torch.nn.functional as F

import transfuse.kernels.cross_entropy as kernels
from transfuse.ops.cross_entropy import linear_logits_cross_entropy

ops = torch.ops.transfuse
ROWS, HIDDEN = 23, 16


def _inputs(vocab, dtype, param_dtype=None, has_bias=True, ignore_index=-100, device="cpu", rows=ROWS,
            hidden=HIDDEN):
    param_dtype = param_dtype or dtype
    x = torch.randn(rows, hidden, device=device).to(dtype)
    weight = (torch.randn(vocab, hidden, device=device) * (3.0 / hidden**0.5)).to(param_dtype)
    bias = torch.randn(vocab, device=device).to(param_dtype) if has_bias else None
    target = torch.randint(0, vocab, (rows,), device=device)
    target[2::5] = ignore_index
    return x, weight, bias, target


def _reference(x, weight, bias, target, ignore_index, label_smoothing, reduction):
    """What eager autocast code computes: the linear in x's dtype, the loss on upcast logits."""
    logits = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
    loss = F.cross_entropy(logits.float(), target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction=reduction)
    return logits, loss


def _run(fn, x, weight, bias, target, logits_grad, seed=1):
    """fn -> (logits, loss); backpropagates a random grad_output into the loss and, with logits_grad,
    a second loss on the logits. Returns (logits, loss, grad_x, grad_weight, grad_bias)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in (x, weight, bias)]
    logits, loss = fn(*leaves, target)
    gen = torch.Generator(device=loss.device).manual_seed(seed)
    total = (loss * (torch.randn(loss.shape, generator=gen, device=loss.device) + 2.0)).sum()
    if logits_grad:
        total = total + (logits.float() * torch.randn(logits.shape, generator=gen, device=loss.device)).sum() * 0.1
    total.backward()
    return (logits.detach(), loss.detach(), *(None if t is None else t.grad for t in leaves))


def _assert_close(name, ours, same, gold, atol):
    """err(ours) <= 2 * err(torch in the same dtype) + atol * max|gold|, against an fp64 gold."""
    if gold is None:
        assert ours is None, name
        return
    assert ours.shape == gold.shape and ours.dtype == same.dtype, (name, ours.shape, ours.dtype, same.dtype)
    err = (ours.double() - gold.double()).abs().max().item()
    err_torch = (same.double() - gold.double()).abs().max().item()
    scale = max(gold.abs().max().item(), 1e-30)
    assert err <= 2 * err_torch + atol * scale, f"{name}: err {err:.3g} vs torch {err_torch:.3g}"


def check(x, weight, bias, target, ignore_index, label_smoothing, reduction, pad, logits_grad, atol):
    def ours(x_, w_, b_, t_):
        return linear_logits_cross_entropy(x_, w_, b_, t_, ignore_index, label_smoothing, reduction, pad)

    def ref(x_, w_, b_, t_):
        return _reference(x_, w_, b_, t_, ignore_index, label_smoothing, reduction)

    def gold(x_, w_, b_, t_):
        return _reference(x_.double(), w_.double(), None if b_ is None else b_.double(), t_, ignore_index,
                          label_smoothing, reduction)

    results = [_run(fn, x, weight, bias, target, logits_grad) for fn in (ours, ref, gold)]
    for name, o, s, g in zip(("logits", "loss", "grad_x", "grad_weight", "grad_bias"), *results):
        _assert_close(name, o, s, g, atol)
    assert results[0][0].is_contiguous()
    assert results[0][3].abs().max() > 0 and results[0][2].abs().max() > 0  # not a vacuous comparison


DTYPES = [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)]


@pytest.mark.parametrize("dtype,atol", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduction,label_smoothing", [("mean", 0.0), ("mean", 0.1), ("sum", 0.1), ("none", 0.0)])
@pytest.mark.parametrize("logits_grad", [False, True], ids=["loss-only", "logits-grad"])
def test_matches_torch(logits_grad, reduction, label_smoothing, dtype, atol):
    x, weight, bias, target = _inputs(97, dtype)
    check(x, weight, bias, target, -100, label_smoothing, reduction, 64, logits_grad, atol)


@pytest.mark.parametrize("vocab,pad", [(128, 0), (97, 0), (131, 64)])
def test_vocabularies_and_fp32_parameters_with_bf16_x(vocab, pad):
    """Autocast's case: fp32 weight (tied, say) and bias, a bf16 GEMM; their gradients come back fp32."""
    x, weight, bias, target = _inputs(vocab, torch.bfloat16, param_dtype=torch.float32, ignore_index=-1)
    check(x, weight, bias, target, -1, 0.0, "mean", pad, False, 1e-2)


def test_no_bias_leading_dims_and_only_the_logits_differentiated():
    x, weight, _, target = _inputs(97, torch.float32)
    x3, target2 = x.reshape(1, ROWS, HIDDEN), target.reshape(1, ROWS)
    w = weight.clone().requires_grad_(True)
    logits, loss = linear_logits_cross_entropy(x3, w, None, target2, -100, 0.0, "none", 64)
    assert logits.shape == (1, ROWS, 97) and loss.shape == (1, ROWS)
    logits.sum().backward()  # the loss gets no gradient: grad_weight = sum over rows of x
    assert torch.allclose(w.grad, x.sum(0).expand(97, -1), rtol=1e-5, atol=1e-5)


def test_one_pass_over_the_logits_in_the_backward(monkeypatch):
    """The forward keeps no gradient buffer: the backward forms d loss / d logits in one elementwise
    pass from the returned logits and lse, with the logits' own gradient (None or not) in that pass."""
    calls = []
    real = kernels.cross_entropy_logits_grad
    monkeypatch.setattr(kernels, "cross_entropy_logits_grad", lambda *a, **k: calls.append(a[6] is not None) or real(*a, **k))
    x, weight, bias, target = _inputs(97, torch.float32)
    w = weight.clone().requires_grad_(True)
    _, loss = linear_logits_cross_entropy(x, w, bias, target, -100, 0.0, "mean", 64)
    (loss * 3.0).backward()
    assert calls == [False]
    w_ref = weight.clone().requires_grad_(True)
    _, ref = _reference(x, w_ref, bias, target, -100, 0.0, "mean")
    (ref * 3.0).backward()
    assert torch.allclose(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6)
    logits, loss = linear_logits_cross_entropy(x, w, bias, target, -100, 0.0, "mean", 64)
    (loss + logits.sum()).backward()
    assert calls == [False, True]  # the logits' gradient is added in the same pass


def test_logits_modified_in_place_before_backward_is_an_error():
    """The backward reads the returned logits: changing them first must fail, not give wrong gradients."""
    x, weight, bias, target = _inputs(97, torch.float32)
    w = weight.clone().requires_grad_(True)
    logits, loss = linear_logits_cross_entropy(x, w, bias, target, -100, 0.0, "mean", 64)
    with torch.no_grad():
        logits.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_no_gradient_in_no_grad_mode():
    x, weight, bias, target = _inputs(97, torch.float32)
    with torch.no_grad():
        logits, loss, lse = ops.linear_logits_cross_entropy(x, weight.requires_grad_(True), bias, target,
                                                            -100, 0.0, "mean", 64, False)
    ref_logits, ref = _reference(x, weight.detach(), bias, target, -100, 0.0, "mean")
    assert lse.shape == (0,) and torch.allclose(loss, ref) and torch.equal(logits, ref_logits)


def test_all_rows_ignored():
    x, weight, bias, target = _inputs(97, torch.float32)
    target.fill_(-100)
    w = weight.clone().requires_grad_(True)
    _, loss = linear_logits_cross_entropy(x, w, bias, target, -100, 0.0, "mean", 64)
    loss.backward()
    assert loss.isnan() and torch.equal(w.grad, torch.zeros_like(w))  # torch: NaN loss, zero gradients


def _opcheck_cases():
    x, weight, bias, target = _inputs(37, torch.float32, rows=13)
    xh = x.bfloat16()
    logits = torch.randn(13, 37)
    lse = torch.logsumexp(logits, dim=1)
    return [
        ("linear_logits_cross_entropy", (x, weight, bias, target, -100, 0.1, "mean", 64, True)),
        ("linear_logits_cross_entropy", (xh, weight, None, target, -100, 0.0, "none", 0, True)),
        ("linear_logits_cross_entropy", (x, weight, bias, target, -100, 0.0, "sum", 16, False)),
        ("linear_logits_cross_entropy_backward",
         (torch.rand(()), None, logits, lse, x, weight, bias, target, -100, 0.1, "mean", 64, True, True, True)),
        ("linear_logits_cross_entropy_backward",
         (torch.rand(13), torch.randn(13, 37), logits, lse, x, weight, None, target, -100, 0.0, "none", 0,
          True, False, False)),
        ("linear_logits_cross_entropy_backward",
         (None, torch.randn(13, 37), logits, lse, x, weight, bias, target, -100, 0.0, "sum", 16, False, True, True)),
    ]


OPCHECK_IDS = [f"{name}-{i}" for i, (name, _) in enumerate(_opcheck_cases())]


@pytest.mark.parametrize("case", range(len(OPCHECK_IDS)), ids=OPCHECK_IDS)
def test_opcheck(case):
    name, args = _opcheck_cases()[case]
    if name == "linear_logits_cross_entropy" and args[-1]:
        args = (*(a.clone().requires_grad_(True) if i < 3 and a is not None else a for i, a in enumerate(args)),)
    torch.library.opcheck(getattr(ops, name).default, args)


def test_fake_shapes():
    x, weight, bias, target = _inputs(97, torch.bfloat16, param_dtype=torch.float32)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fx, fw, fb, ft = (mode.from_tensor(t) for t in (x, weight, bias, target))
        logits, loss, lse = ops.linear_logits_cross_entropy(fx, fw, fb, ft, -100, 0.0, "none", 64, True)
    assert (logits.shape, logits.dtype, loss.shape, loss.dtype) == ((ROWS, 97), torch.bfloat16, (ROWS,), torch.float32)
    assert lse.shape == (ROWS,) and lse.dtype == torch.float32
