"""Backward of the GEMM with epilogue (transfuse.ops.linear_autograd, transfuse.kernels.activation_backward):
the activation-gradient kernel against torch's own autograd, the ops' gradients against eager
F.linear + activation (+ residual) with a tolerance relative to PyTorch's own error in the same
dtype, what is saved for the backward against eager's, schemas, opcheck and torch.compile tracing.
Tiny odd shapes on CPU (Triton's interpreter)."""

import pytest
import torch

from transfuse.kernels.activation_backward import activation_bwd, activation_fwd
from transfuse.kernels.gemm import ACTIVATIONS, is_gated
from transfuse.reference.activation_backward import activation_bwd_ref, activation_ref
from transfuse.reference.gemm import linear_ref

ops = torch.ops.transfuse
# The kernels' sigmoid forms overflow exp to inf on purpose where an activation saturates; the
# interpreter computes with numpy, which warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

SCHEMAS = {
    "linear_train": "transfuse::linear_train(Tensor x, Tensor weight, Tensor? bias, str activation, "
    "Tensor? residual) -> Tensor",
    "linear_train_fwd": "transfuse::linear_train_fwd(Tensor x, Tensor weight, Tensor? bias, str activation, "
    "Tensor? residual) -> (Tensor, Tensor)",
    "activation_backward": "transfuse::activation_backward(Tensor grad_out, Tensor pre, str activation) -> Tensor",
    "activation_bias_backward": "transfuse::activation_bias_backward(Tensor grad_out, Tensor pre, str activation, "
    "ScalarType? dbias_dtype=None) -> (Tensor, Tensor)",
    "bias_grad": "transfuse::bias_grad(Tensor dy, ScalarType? out_dtype=None) -> Tensor",
    "activation": "transfuse::activation(Tensor pre, str activation) -> Tensor",
}
# dtype, atol added to twice torch's own max error, as a fraction of the gradient's largest value
DTYPES = [(torch.float32, 1e-5), (torch.float16, 1e-3), (torch.bfloat16, 1e-2)]
GRAD_NAMES = ("x", "weight", "bias", "residual")


def _randn(shape, dtype, scale=1.0):
    return (scale * torch.randn(shape, dtype=torch.float32)).to(dtype)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema(name):
    assert str(getattr(ops, name).default._schema) == SCHEMAS[name]


# ---------------------------------------------------------------------------------------------
# The kernels against torch's autograd of the activation alone


def _pre(lead, n, activation, dtype):
    """Pre-activations over the activations' interesting range, with saturated values (|x| ~ 20,
    where exp overflows in the sigmoid forms) in the first row."""
    width = 2 * n if is_gated(activation) else n
    pre = _randn((*lead, width), dtype, scale=3.0)
    pre.view(-1, width)[0, : min(4, width)] = torch.tensor([-20.0, 20.0, -90.0, 90.0])[: min(4, width)].to(dtype)
    return pre


@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_bwd_matches_autograd(activation, dtype, atol):
    pre = _pre((3, 7), 37, activation, dtype)
    grad_out = _randn((3, 7, 37), dtype)
    ours = activation_bwd(grad_out, pre, activation)
    gold = activation_bwd_ref(grad_out, pre, activation, upcast=True)
    eager = activation_bwd_ref(grad_out, pre, activation)
    assert ours.shape == pre.shape and ours.dtype == dtype and ours.is_contiguous()
    assert torch.isfinite(ours).all()
    err_ours = (ours.float() - gold).abs().max().item()
    err_torch = (eager.float() - gold).abs().max().item()
    assert err_ours <= 2 * err_torch + atol * gold.abs().max().item(), (err_ours, err_torch)


@pytest.mark.parametrize("activation", ["gelu", "silu_mul"])
def test_activation_bwd_reads_strided_and_expanded_grads(activation):
    pre = _pre((5,), 19, activation, torch.float32)
    transposed = torch.randn(19, 5).t()  # column-major, as a transposed upstream gradient
    expanded = torch.randn(1, 19).expand(5, 19)  # stride 0 along rows, as the gradient of a sum
    for grad_out in (transposed, expanded):
        torch.testing.assert_close(activation_bwd(grad_out, pre, activation),
                                   activation_bwd_ref(grad_out, pre, activation))


@pytest.mark.parametrize("has_residual", [False, True])
@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_fwd_matches_reference(activation, dtype, atol, has_residual):
    pre = _pre((2, 9), 21, activation, dtype)
    residual = _randn((9, 2, 21), dtype).transpose(0, 1) if has_residual else None  # strided
    ours = activation_fwd(pre, activation, residual)
    gold = activation_ref(pre, activation, residual, upcast=True)
    eager = activation_ref(pre, activation, residual)
    assert ours.shape == gold.shape and ours.dtype == dtype and ours.is_contiguous()
    err_ours = (ours.float() - gold).abs().max().item()
    err_torch = (eager.float() - gold).abs().max().item()
    assert err_ours <= 2 * err_torch + atol * gold.abs().max().item(), (err_ours, err_torch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_fwd_gpu_tiles_match_reference(activation):
    """The GPU's 128-column tiles (activation_fwd_config) at a shape crossing both tile edges, bf16,
    and the recompute op giving the forward's bits."""
    pre = _pre((3, 1001), 3000 + 7, activation, torch.bfloat16).cuda()
    ours = activation_fwd(pre, activation)
    gold = activation_ref(pre, activation, None, upcast=True)
    eager = activation_ref(pre, activation, None)
    err_ours = (ours.float() - gold).abs().max().item()
    err_torch = (eager.float() - gold).abs().max().item()
    assert err_ours <= 2 * err_torch + 1e-2 * gold.abs().max().item(), (err_ours, err_torch)
    assert torch.equal(ops.activation(pre, activation), ours)


def test_activation_op_is_the_forward_kernel():
    """transfuse.activation (what the backward recomputes) is bit for bit linear_train_fwd's output."""
    x, w, b = _randn((5, 8), torch.float32), _randn((12, 8), torch.float32), _randn((12,), torch.float32)
    for activation in ("gelu", "silu_mul"):
        out, pre = ops.linear_train_fwd(x, w, b, activation, None)
        assert torch.equal(ops.activation(pre, activation), out)


def test_activation_kernels_reject_bad_shapes():
    with pytest.raises(ValueError, match="2N"):
        activation_bwd(torch.randn(3, 4), torch.randn(3, 7), "silu_mul")
    with pytest.raises(ValueError, match="grad_out"):
        activation_bwd(torch.randn(3, 5), torch.randn(3, 4), "gelu")
    with pytest.raises(ValueError, match="residual"):
        activation_fwd(torch.randn(3, 4), "gelu", torch.randn(3, 4).half())


# ---------------------------------------------------------------------------------------------
# The ops' gradients against eager F.linear + activation + residual


def _problem(lead, k, n, activation, dtype, has_bias, has_residual):
    rows = 2 * n if is_gated(activation) else n
    x = _randn((*lead, k), dtype)
    weight = _randn((rows, k), dtype, k**-0.5)
    bias = _randn((rows,), dtype) if has_bias else None
    residual = _randn((*lead, n), dtype) if has_residual else None
    return [x, weight, bias, residual]


def _grads(fn, tensors, grad_out):
    """(output, {name: gradient}) of fn(*tensors) for every tensor given (None passes through),
    backpropagating grad_out."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), {name: leaf.grad for name, leaf in zip(GRAD_NAMES, leaves) if leaf is not None}


def _assert_within_torch_error(ours, torch_same, gold, atol, what):
    """Our max error against the fp32 reference is at most twice torch's in the same dtype, plus
    atol of the reference's largest value."""
    assert ours.shape == gold.shape and ours.dtype == torch_same.dtype, (what, ours.shape, ours.dtype, gold.shape)
    err_ours = (ours.float() - gold).abs().max().item()
    err_torch = (torch_same.float() - gold).abs().max().item()
    assert err_ours <= 2 * err_torch + atol * gold.abs().max().item(), (
        f"{what}: err {err_ours:.3g} vs torch {err_torch:.3g}")


def _check_op(op, activation, dtype, atol, has_bias, has_residual, lead=(3, 5), k=37, n=21):
    """op's output and gradients against eager linear + activation + residual (linear_ref, which
    autograd differentiates with torch's own formulas) in fp32 (gold) and in dtype (torch's error)."""
    tensors = _problem(lead, k, n, activation, dtype, has_bias, has_residual)
    grad_out = _randn((*lead, n), dtype)
    out, ours = _grads(lambda x, w, b, r: op(x, w, b, activation, r), tensors, grad_out)
    upcast = [None if t is None else t.float() for t in tensors]
    gold_out, gold = _grads(lambda x, w, b, r: linear_ref(x, w, b, activation, r), upcast, grad_out.float())
    eager_out, eager = _grads(lambda x, w, b, r: linear_ref(x, w, b, activation, r), tensors, grad_out)
    _assert_within_torch_error(out, eager_out, gold_out, atol, "out")
    for name in gold:
        _assert_within_torch_error(ours[name], eager[name], gold[name], atol, f"d{name}")
    return ours


@pytest.mark.parametrize("has_bias,has_residual", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_train_gradients_fp32(activation, has_bias, has_residual):
    _check_op(ops.linear_train, activation, torch.float32, 1e-5, has_bias, has_residual)


@pytest.mark.parametrize("dtype,atol", DTYPES[1:])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_train_gradients_half(activation, dtype, atol):
    _check_op(ops.linear_train, activation, dtype, atol, True, True)


@pytest.mark.parametrize("dtype,atol", DTYPES[::2])
@pytest.mark.parametrize("activation", ["none", "gelu_tanh", "silu_mul"])
def test_linear_gradients_recompute_pre(activation, dtype, atol):
    """transfuse.linear, the inference op, is differentiable too (its backward recomputes pre)."""
    _check_op(ops.linear, activation, dtype, atol, True, True, lead=(4,), k=19, n=13)


def test_only_the_gradients_asked_for():
    x, w, b, r = _problem((2, 3), 19, 11, "gelu", torch.float32, True, True)
    g = torch.randn(2, 3, 11)
    _, full = _grads(lambda *t: ops.linear_train(t[0], t[1], t[2], "gelu", t[3]), [x, w, b, r], g)
    # a frozen weight and bias (LoRA, a frozen layer): only x's gradient
    xg = x.clone().requires_grad_(True)
    ops.linear_train(xg, w, b, "gelu", r).backward(g)
    torch.testing.assert_close(xg.grad, full["x"])
    # weight alone (the first layer: x is an embedding output that needs no gradient)
    wg = w.clone().requires_grad_(True)
    ops.linear_train(x, wg, b, "gelu", r).backward(g)
    torch.testing.assert_close(wg.grad, full["weight"])
    # the residual alone: its gradient is grad_out itself
    rg = r.clone().requires_grad_(True)
    ops.linear_train(x, w, b, "gelu", rg).backward(g)
    torch.testing.assert_close(rg.grad, g)


def test_bias_gradient_of_an_autocast_linear():
    """Under autocast an fp32 bias reaches the linear as a bf16 copy: eager's bias gradient is the
    bf16 column sum (fp32 accumulation, one rounding), widened to fp32 by the cast's backward.
    linear_train behind the same cast gives the same dtype and, for "none" (grad_pre = grad_out),
    the same values up to the order of the fp32 additions."""
    x, w, b, _ = _problem((4, 9), 24, 40, "none", torch.float32, True, False)
    g = torch.randn(4, 9, 40).bfloat16()
    b_eager, b_ours = b.clone().requires_grad_(True), b.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.nn.functional.linear(x, w, b_eager).backward(g)
    ops.linear_train(x.bfloat16(), w.bfloat16(), b_ours.bfloat16(), "none", None).backward(g)
    assert b_eager.grad.dtype == b_ours.grad.dtype == torch.float32
    gold = g.double().sum((0, 1))
    err_eager = (b_eager.grad.double() - gold).abs().max().item()
    err_ours = (b_ours.grad.double() - gold).abs().max().item()
    assert err_ours <= 2 * err_eager + 1e-6 * gold.abs().max().item(), (err_ours, err_eager)
    assert (b_ours.grad.bfloat16().float() == b_ours.grad).all()  # rounded once to bf16, as eager


@pytest.mark.parametrize("activation", ["none", "gelu", "silu_mul"])
def test_bias_gradient_paths(activation):
    """dbias from each path of the backward (bias_grad on grad_out, the activation kernel's own sum,
    bias_grad on grad_pre + the gradient reaching pre) against eager, in bf16."""
    x, w, b, _ = _problem((5, 7), 19, 24, activation, torch.bfloat16, True, False)
    g_out = _randn((5, 7, 24), torch.bfloat16)
    g_pre = _randn((5, 7, w.shape[0]), torch.bfloat16)
    for with_pre_grad in (False, True) if activation != "none" else (False,):
        def loss(op, x, w, b):
            if op == "eager":
                pre = torch.nn.functional.linear(x, w, b)
                out = linear_ref(x, w, b, activation)
            else:
                out, pre = ops.linear_train_fwd(x, w, b, activation, None)
            total = (out.float() * g_out.float()).sum()
            return total + (pre.float() * g_pre.float()).sum() if with_pre_grad else total

        grads = {}
        for op in ("ours", "eager", "gold"):
            leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, b)]
            if op == "gold":
                leaves = [t.detach().float().requires_grad_(True) for t in (x, w, b)]
            grads[op] = torch.autograd.grad(loss("eager" if op == "gold" else op, *leaves), leaves[2])[0]
        assert grads["ours"].dtype == grads["eager"].dtype == torch.bfloat16
        err_ours = (grads["ours"].float() - grads["gold"]).abs().max().item()
        err_eager = (grads["eager"].float() - grads["gold"]).abs().max().item()
        assert err_ours <= 2 * err_eager + 1e-2 * grads["gold"].abs().max().item(), (with_pre_grad, err_ours, err_eager)


def test_pre_output_gradient_is_added():
    """linear_train_fwd's second output is differentiable: a gradient reaching pre joins grad_pre."""
    x, w, b, _ = _problem((7,), 19, 11, "silu_mul", torch.float32, True, False)
    g_out, g_pre = torch.randn(7, 11), torch.randn(7, 22)

    def ours(x, w, b):
        out, pre = ops.linear_train_fwd(x, w, b, "silu_mul", None)
        return (out * g_out).sum() + (pre * g_pre).sum()

    def eager(x, w, b):
        pre = torch.nn.functional.linear(x, w, b)
        return (linear_ref(x, w, b, "silu_mul") * g_out).sum() + (pre * g_pre).sum()

    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    got = torch.autograd.grad(ours(*leaves), leaves)
    want = torch.autograd.grad(eager(*leaves), leaves)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


# ---------------------------------------------------------------------------------------------
# What the backward keeps


def _saved_bytes(fn, *tensors) -> int:
    """Bytes of the distinct tensors autograd keeps for fn's backward that are not its inputs (the
    inputs, parameters among them, are held by the caller anyway)."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    inputs = {t.untyped_storage().data_ptr() for t in leaves}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*leaves)
    del out
    return sum(nbytes for ptr, nbytes in saved.items() if ptr not in inputs)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_saves_no_more_than_eager(activation):
    x, w, b, r = _problem((4, 9), 24, 40, activation, torch.float32, True, True)
    ours = _saved_bytes(lambda *t: ops.linear_train(*t[:3], activation, t[3]), x, w, b, r)
    eager = _saved_bytes(lambda *t: linear_ref(*t[:3], activation, t[3]), x, w, b, r)
    assert ours <= eager, (ours, eager)
    pre_bytes = 4 * 9 * w.shape[0] * 4
    assert ours == (0 if activation == "none" else pre_bytes)  # pre alone, besides the inputs


# ---------------------------------------------------------------------------------------------
# opcheck, fake implementations, torch.compile


def _opcheck_cases():
    """(op name, args); inputs that require grad exercise the autograd registrations too."""
    x, w, b, r = (t.requires_grad_(True) for t in _problem((2, 5), 19, 13, "gelu", torch.float32, True, True))
    xg, wg = (t.requires_grad_(True) for t in _problem((7,), 19, 13, "silu_mul", torch.float32, False, False)[:2])
    return [
        ("linear_train_fwd", (x, w, b, "gelu", r)),
        ("linear_train_fwd", (xg, wg, None, "silu_mul", None)),
        ("linear_train_fwd", (x.detach().half(), w.detach().half().requires_grad_(True), None, "none",
                              r.detach().half())),
        ("linear", (x, w, b.detach(), "tanh", r.detach())),  # only x and weight need gradients
        ("activation_backward", (torch.randn(2, 5, 13), torch.randn(2, 5, 26), "silu_mul")),
        ("activation_backward", (torch.randn(13, 7).t().bfloat16(), torch.randn(7, 13).bfloat16(), "gelu_tanh")),
        ("activation_bias_backward", (torch.randn(2, 5, 13), torch.randn(2, 5, 26), "silu_mul")),
        ("activation_bias_backward", (torch.randn(13, 7).t().bfloat16(), torch.randn(7, 13).bfloat16(), "gelu")),
        ("bias_grad", (torch.randn(3, 5, 13),)),
        ("bias_grad", (torch.randn(4, 30, 11).half()[:, ::3],)),
    ]


OPCHECK_IDS = [f"{name}-{i}" for i, (name, _) in enumerate(_opcheck_cases())]


@pytest.mark.parametrize("case", range(len(OPCHECK_IDS)), ids=OPCHECK_IDS)
def test_opcheck(case):
    name, args = _opcheck_cases()[case]
    torch.library.opcheck(getattr(ops, name).default, args)


def test_backward_traces_through_torch_compile():
    x, w, b, r = _problem((3, 4), 19, 13, "gelu", torch.float32, True, True)

    def step(x, w, b, r):
        return (ops.linear_train(x, w, b, "gelu", r) * 2).sum()

    leaves = [t.clone().requires_grad_(True) for t in (x, w, b, r)]
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(*leaves), leaves)
    want = torch.autograd.grad(step(*leaves), leaves)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)
