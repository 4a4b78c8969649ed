"""transfuse.kernels.attention_train / torch.ops.transfuse.attention_train*: forward (out, lse) and every
gradient against the fp32 reference. Interpreter-sized tests first, then GPU tests at real sizes
(`@pytest.mark.gpu`): error no worse than twice PyTorch's own error in the same dtype plus a small atol."""

import pytest
import torch
import torch.nn.functional as F
import triton
from torch._subclasses.fake_tensor import FakeTensorMode

import transfuse.ops.attention_train  # noqa: F401  (registers the ops)
from transfuse.kernels import attention_train as kernels
from transfuse.kernels._config import INTERPRET
from transfuse.kernels.attention_train import TILE_SHAPES, attention_train_bwd, attention_train_fwd
from tests.kernels.attention_cases import FP32_MIN, qkv
from transfuse.reference.attention_train import attention_train_ref

NEG_INF = float("-inf")

# The interpreter runs the kernels in numpy, which warns about the -inf arithmetic of masked scores.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _forward_backward(fn, q, k, v, bias, scale, is_causal, grad_out, grad_lse):
    """(out, lse, dq, dk, dv, dbias or None) of fn(q, k, v, bias, scale, is_causal) -> (out, lse), on leaf
    copies of the inputs; dbias only when `bias` requires grad; grad_lse None leaves lse unused."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    leaves = [q, k, v]
    if bias is not None and bias.requires_grad:
        bias = bias.detach().clone().requires_grad_()
        leaves.append(bias)
    elif bias is not None:
        bias = bias.detach()
    out, lse = fn(q, k, v, bias, scale, is_causal)
    if grad_lse is None:
        grads = torch.autograd.grad(out, leaves, grad_out)
    else:
        grads = torch.autograd.grad((out, lse), leaves, (grad_out, grad_lse))
    return (out.detach(), lse.detach(), *grads, *([None] if len(grads) == 3 else []))


def _ours(q, k, v, bias, scale, is_causal):
    return torch.ops.transfuse.attention_train_fwd(q, k, v, bias, scale, is_causal)[:2]


def _max_err(a, b):
    return (a.float() - b.float()).abs().max().item()


NAMES = ("out", "lse", "dq", "dk", "dv", "dbias")


def _assert_close_fp32(ours, ref, atol=1e-5):
    """Every tensor within atol * max(1, |ref|); identical -inf positions (lse of rows that see no key)."""
    for name, a, b in zip(NAMES, ours, ref):
        if b is None:
            assert a is None, name
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, f"{name}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        assert not a.isnan().any(), f"{name} has NaN"
        inf = b.isinf()
        assert torch.equal(a.isinf(), inf) and torch.equal(a[inf], b[inf]), f"{name}: -inf pattern differs"
        err = _max_err(a[~inf], b[~inf]) if (~inf).any() else 0.0
        tol = atol * max(1.0, b[~inf].abs().max().item() if (~inf).any() else 0.0)
        assert err <= tol, f"{name}: err {err:.3e} > {tol:.3e}"


def _check_fp32(q, k, v, bias, scale, is_causal, use_lse, atol=1e-5):
    batch, nheads, seqlen_q, head_dim = q.shape
    grad_out = torch.randn_like(q)
    grad_lse = torch.randn(batch, nheads, seqlen_q, device=q.device) if use_lse else None
    ours = _forward_backward(_ours, q, k, v, bias, scale, is_causal, grad_out, grad_lse)
    ref = _forward_backward(attention_train_ref, q, k, v, bias, scale, is_causal, grad_out, grad_lse)
    _assert_close_fp32(ours, ref, atol)
    return ours


# ---- fp32 against the reference ------------------------------------------------------------------------

CASES = [
    # batch, nheads, nheads_kv, seqlen_q, seqlen_k, head_dim, is_causal, use_lse
    (1, 2, 2, 37, 37, 16, False, False),
    (2, 1, 1, 37, 37, 16, True, True),
    (1, 4, 2, 37, 37, 24, True, False),    # GQA 4 -> 2, head dim padded to 32
    (1, 4, 1, 21, 21, 16, False, True),    # MQA
    (2, 2, 1, 13, 37, 16, False, False),   # seqlen_q < seqlen_k
    (1, 2, 2, 37, 19, 24, True, True),     # causal, seqlen_q > seqlen_k: rows >= 19 see every key
    (1, 2, 2, 19, 37, 16, True, False),    # causal, seqlen_q < seqlen_k: keys >= 19 are seen by no row
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:6])) + ("-causal" if c[6] else "")
                         + ("-lse" if c[7] else ""))
def test_matches_reference(case, device):
    batch, nheads, nheads_kv, seqlen_q, seqlen_k, head_dim, is_causal, use_lse = case
    q, k, v = qkv(batch, nheads, nheads_kv, seqlen_q, seqlen_k, head_dim, torch.float32, device)
    ours = _check_fp32(q, k, v, None, head_dim ** -0.5, is_causal, use_lse)
    if is_causal and seqlen_q < seqlen_k:
        # Top-left alignment: key j is visible to query i iff j <= i, so keys past seqlen_q get nothing.
        assert ours[3][:, :, seqlen_q:].eq(0).all() and ours[4][:, :, seqlen_q:].eq(0).all()


def test_matches_sdpa_causal_alignment(device):
    """Same top-left causal alignment as F.scaled_dot_product_attention(is_causal=True) when seqlen_q != seqlen_k."""
    for seqlen_q, seqlen_k in ((11, 29), (29, 11)):
        q, k, v = qkv(1, 2, 2, seqlen_q, seqlen_k, 16, torch.float32, device)
        out = attention_train_fwd(q, k, v, None, 0.3, True)[0]
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3),
                                   atol=1e-5, rtol=1e-5)


# ---- bias ----------------------------------------------------------------------------------------------

B, H, S = 2, 2, 37


def _bias(name, device):
    """(bias, is_causal, nheads_kv) for each bias form: shape in the name; `_grad` ones require grad."""
    if name == "1HSS_grad":        # T5's position bias: broadcast over batch
        return torch.randn(1, H, S, S, device=device).requires_grad_(), True, H
    if name == "BHSS_grad":        # full shape: dS stored straight into dbias
        return torch.randn(B, H, S, S, device=device).requires_grad_(), False, H
    if name == "SS_grad_gqa":      # 2-D, broadcast over batch and heads; GQA sums dK/dV over the group
        return torch.randn(S, S, device=device).requires_grad_(), True, 1
    if name == "B11S_grad":        # one row for every query: summed over queries in the kernel
        return torch.randn(B, 1, 1, S, device=device).requires_grad_(), False, H
    if name == "SS_rows_minus100":  # whole rows at -100: lse < -88, so a padded key's exp(0 - lse) overflows
        bias = torch.randn(S, S, device=device)
        bias[3:6] = -100.0
        return bias, False, H
    if name == "B11S_pad_min":     # HF-style padding mask, finfo.min, no grad
        keep = torch.arange(S, device=device)[None, :] < torch.tensor([S, 20], device=device)[:, None]
        return torch.zeros(B, 1, 1, S, device=device).masked_fill(~keep[:, None, None, :], FP32_MIN), True, H
    raise KeyError(name)


@pytest.mark.parametrize("name", ["1HSS_grad", "BHSS_grad", "SS_grad_gqa", "B11S_grad", "SS_rows_minus100",
                                  "B11S_pad_min"])
def test_bias(name, device):
    bias, is_causal, nheads_kv = _bias(name, device)
    q, k, v = qkv(B, H, nheads_kv, S, S, 16, torch.float32, device)
    ours = _check_fp32(q, k, v, bias, 0.25, is_causal, use_lse=name == "1HSS_grad")
    assert (ours[5] is not None) == bias.requires_grad


def test_fully_masked_rows_no_nan(device):
    """Rows whose every score is -inf: out 0, lse -inf, zero gradients everywhere they reach, no NaN."""
    # Padding-style (batch, 1, 1, seqlen_k) bias: sequence 1 has no key at all, sequence 0 has 15.
    keep = torch.arange(S, device=device)[None, :] < torch.tensor([15, 0], device=device)[:, None]
    pad = torch.zeros(B, 1, 1, S, device=device).masked_fill(~keep[:, None, None, :], NEG_INF).requires_grad_()
    q, k, v = qkv(B, H, H, S, S, 16, torch.float32, device)
    out, lse, dq, dk, dv, dbias = _check_fp32(q, k, v, pad, 0.25, False, use_lse=True)
    for t in (out, dq, dk, dv, dbias):
        assert not t.isnan().any()
        assert t[1].eq(0).all()
    assert lse[1].eq(NEG_INF).all() and lse[0].isfinite().all()
    assert dk[0, :, 15:].eq(0).all() and dv[0, :, 15:].eq(0).all() and dbias[0, ..., 15:].eq(0).all()

    # One fully masked row in a 2-D bias that requires grad, under causal.
    bias = torch.randn(S, S, device=device)
    bias[5] = NEG_INF
    bias.requires_grad_()
    out, lse, dq, dk, dv, dbias = _check_fp32(q, k, v, bias, 0.25, True, use_lse=False)
    assert out[:, :, 5].eq(0).all() and lse[:, :, 5].eq(NEG_INF).all() and dq[:, :, 5].eq(0).all()
    assert dbias[5].eq(0).all() and dbias.triu(1).eq(0).all() and dbias.tril().ne(0).any()


@pytest.mark.parametrize("bias_grad", [False, True])
def test_rows_masked_by_finite_min(device, bias_grad):
    """Left padding + causal with an HF-style finfo.min mask: rows < 10 see only padded keys, and every
    score of theirs rounds to finfo.min. Eager spreads their softmax evenly over their keys j <= i; the
    backward must recompute those weights (1 / (i + 1)), not 1, with a nonzero output gradient there
    (a padded position whose next token is a label). The lse alone cannot: it rounds to finfo.min."""
    pad = 10
    q, k, v = qkv(2, 2, 2, S, S, 16, torch.float32, device)
    bias = torch.zeros(1, 1, 1, S, device=device)
    bias[..., :pad] = FP32_MIN
    bias.requires_grad_(bias_grad)
    grad_out = torch.randn_like(q)
    ours = _forward_backward(_ours, q, k, v, bias, 0.25, True, grad_out, None)
    ref = _forward_backward(attention_train_ref, q, k, v, bias, 0.25, True, grad_out, None)
    _assert_close_fp32(ours, ref)
    torch.testing.assert_close(ours[0][:, :, 4], v[:, :, :5].mean(2), atol=1e-5, rtol=1e-5)
    # dV of key 0 gets 1/(i+1) of every padded row i's output gradient (and the unpadded rows' share)
    assert ours[4][:, :, 0].abs().max() < 10 * grad_out.abs().max()


def test_rows_masked_by_finite_min_in_a_full_bias(device):
    """Falcon-RW's ALiBi mask: a full (batch, heads, seqlen_q, seqlen_k) bias with finfo.min over the
    causal triangle and the left padding, no is_causal. A padded query's scores all round to finfo.min:
    eager's softmax (Hugging Face's "eager" attention) spreads it evenly over every key, and its
    gradients are the softmax Jacobian's at that point. PyTorch's SDPA backward gives those rows l times
    that (it recomputes P from an lse that rounds to finfo.min, so every weight comes back as 1), and on
    a GPU its forward sums V there instead of averaging it: the explicit softmax is the reference."""
    T, pad = 13, 4
    q, k, v = qkv(2, 2, 2, T, T, 16, torch.float32, device)
    allowed = torch.ones(T, T, device=device).tril().bool()[None] & (torch.arange(T, device=device) >= pad)[None, None]
    alibi = torch.randn(2, 2, 1, T, device=device) * 0.3
    bias = alibi.masked_fill(~torch.cat([torch.ones_like(allowed), allowed])[:, None], FP32_MIN)
    grad_out = torch.randn_like(q)
    ours = _forward_backward(_ours, q, k, v, bias, 0.25, False, grad_out, None)

    def explicit(q, k, v, bias, scale, is_causal):  # in fp64, results in fp32
        s = q.double() @ k.double().transpose(-1, -2) * scale + bias.double()
        return (torch.softmax(s, -1) @ v.double()).float(), torch.logsumexp(s, -1).float()

    ref = _forward_backward(explicit, q, k, v, bias, 0.25, False, grad_out, None)
    _assert_close_fp32(ours, ref)
    assert ours[2][1, :, 1:pad].abs().max() > 1e-3  # the padded queries do get a gradient


# ---- low precision ---------------------------------------------------------------------------------

def _torch_same_dtype(q, k, v, bias, scale, is_causal, grad_out):
    """PyTorch's own attention in q's dtype (GQA by repeating k/v): out and its gradients."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    leaves = [q, k, v]
    if bias is not None and bias.requires_grad:
        bias = bias.detach().clone().requires_grad_()
        leaves.append(bias)
    if bias is not None and is_causal:  # SDPA takes one or the other: fold the causal mask into the bias
        above = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1)
        bias = bias + torch.zeros(above.shape, dtype=bias.dtype, device=q.device).masked_fill(above, NEG_INF)
        is_causal = False
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         attn_mask=bias, is_causal=is_causal, scale=scale)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return (out.detach(), *grads, *([None] if len(grads) == 3 else []))


def _check_low_precision(q, k, v, bias, scale, is_causal, atol):
    """err(ours vs fp32 reference) <= 2 * err(torch in the same dtype vs fp32 reference) + atol * max(1, |ref|),
    for out and every gradient; lse (fp32, no torch counterpart) within 1e-3 * max(1, |lse|)."""
    if INTERPRET and q.dtype == torch.bfloat16:
        # The interpreter converts fp32 to bf16 by truncation (one ulp) where a GPU rounds (half an ulp):
        # allow one more bf16 ulp. Remove when the interpreter rounds to nearest.
        atol += torch.finfo(torch.bfloat16).eps
    grad_out = torch.randn_like(q)
    ours = _forward_backward(_ours, q, k, v, bias, scale, is_causal, grad_out, None)
    bias32 = bias.detach().float().requires_grad_(bias.requires_grad) if bias is not None else None
    ref = _forward_backward(attention_train_ref, q.float(), k.float(), v.float(), bias32, scale, is_causal,
                            grad_out.float(), None)
    theirs = _torch_same_dtype(q, k, v, bias, scale, is_causal, grad_out)
    assert ours[1].dtype == torch.float32 and _max_err(ours[1], ref[1]) <= 1e-3 * max(1.0, ref[1].abs().max().item())
    ours = (ours[0], *ours[2:])
    ref = (ref[0], *ref[2:])
    for name, a, b, t in zip(("out", "dq", "dk", "dv", "dbias"), ours, ref, theirs):
        if b is None:
            assert a is None and t is None, name
            continue
        assert a.dtype == t.dtype and a.shape == t.shape and b.dtype == torch.float32, name
        err, torch_err = _max_err(a, b), _max_err(t, b)
        tol = 2 * torch_err + atol * max(1.0, b.abs().max().item())
        assert err <= tol, f"{name}: err {err:.3e} vs torch {torch_err:.3e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision(dtype, device):
    q, k, v = qkv(1, 4, 2, 37, 37, 24, dtype, device)
    bias = torch.randn(1, 4, 37, 37, dtype=dtype, device=device).requires_grad_()
    _check_low_precision(q, k, v, bias, 24 ** -0.5, dtype == torch.float16, atol=1e-3)


# ---- layout ----------------------------------------------------------------------------------------

def test_strided_inputs(device):
    """q, k, v as views of one fused projection (no copies), a grad_out of another layout, and a q whose
    head dim is not the unit stride; gradients get the inputs' dense layout where they have one."""
    batch, seqlen, nheads, head_dim = 2, 23, 2, 24
    qkv = torch.randn(batch, seqlen, 3, nheads, head_dim, device=device)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    assert not q.is_contiguous()
    _check_fp32(q, k, v, None, 0.3, True, use_lse=False)

    q2 = torch.randn(batch, nheads, head_dim, seqlen, device=device).transpose(-1, -2)  # stride(-1) != 1
    bias = torch.randn(batch, nheads, seqlen, seqlen, device=device).transpose(-1, -2).requires_grad_()
    _check_fp32(q2, k, v, bias, 0.3, False, use_lse=True)

    out, _, stats = attention_train_fwd(q, k, v, None, 0.3, False)
    out.transpose(1, 2).view(batch, seqlen, nheads * head_dim)  # a free view: raises if not
    for grad_out in (torch.randn(batch, seqlen, nheads, head_dim, device=device).transpose(1, 2),
                     torch.randn(batch, nheads, head_dim, seqlen, device=device).transpose(-1, -2)):
        ref = attention_train_bwd(grad_out.contiguous(), q, k, v, None, out, stats, 0.3, False, False)
        dq, dk, dv, dbias = attention_train_bwd(grad_out, q, k, v, None, out, stats, 0.3, False, False)
        assert dbias is None and all(torch.equal(a, b) for a, b in zip((dq, dk, dv), ref[:3]))

    # A q laid out as (batch, seqlen, nheads, headdim) (a dense view) gets a dq of that layout.
    q3 = torch.randn(batch, seqlen, nheads, head_dim, device=device).transpose(1, 2)
    dq3 = attention_train_bwd(grad_out, q3, k, v, None, out, stats, 0.3, False, False)[0]
    assert dq3.stride() == q3.stride()


@pytest.mark.parametrize("blocks", TILE_SHAPES, ids=lambda b: f"{b[0]}x{b[1]}")
def test_every_gpu_tile_shape(blocks, device):
    """Each (BLOCK_M, BLOCK_N) of the GPU config lists, pinned: the causal diagonal, the partial blocks
    and the dS zero fill for rows above the diagonal cross differently for each."""
    seqlen_q, seqlen_k = 45, 37
    q, k, v = qkv(1, 2, 1, seqlen_q, seqlen_k, 16, torch.float32, device)
    bias = torch.randn(1, 2, seqlen_q, seqlen_k, device=device)
    grad_out = torch.randn_like(q)
    ref = _forward_backward(attention_train_ref, q, k, v, bias.clone().requires_grad_(), 0.25, True, grad_out, None)
    out, lse, stats = attention_train_fwd(q, k, v, bias, 0.25, True, blocks=blocks)
    grads = attention_train_bwd(grad_out, q, k, v, bias, out, stats, 0.25, True, True, blocks=blocks)
    _assert_close_fp32((out, lse, *grads), ref)


@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
def test_gpu_config_prune(kernel):
    """keep() offers the autotuner only tiles of its table (never a no-bias tile with a bias), none
    larger than the bucketed sequence, and at least one for any sequence."""
    tiles = sorted({t[:4] for by_dim in kernels._TILES[kernel].values() for ts in by_dim.values() for t in ts})
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in tiles]
    keep = kernels._keep(kernel)
    for dtype, block_d, has_bias, bucket_q, bucket_k in [
        (torch.float16, 64, False, 1024, 1024), (torch.bfloat16, 128, True, 1024, 1024),
        (torch.float16, 256, True, 16384, 512), (torch.float32, 128, False, 256, 256),
        (torch.float16, 64, True, 16, 16), (torch.float16, 128, False, 1024, 32),
    ]:
        named = {"q_ptr": torch.empty(0, dtype=dtype), "seqlen_q_bucket": bucket_q, "seqlen_k_bucket": bucket_k}
        kept = keep(configs, named, BLOCK_D=block_d, HAS_BIAS=has_bias)
        assert kept
        allowed = kernels._allowed_tiles(kernel, dtype == torch.float32, block_d, has_bias)
        shapes = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept]
        assert all(t in allowed for t in shapes)
        fitting = [t for t in allowed if t[0] <= bucket_q and t[1] <= bucket_k]
        assert sorted(shapes) == sorted(fitting) if fitting else len(shapes) == 1
        if has_bias:
            by_dim = kernels._TILES[kernel]["fp32" if dtype == torch.float32 else "16bit"]
            no_bias = {t[:4] for t in by_dim[min(d for d in by_dim if d >= block_d)] if len(t) > 4}
            assert not no_bias & set(shapes)


# ---- the ops -------------------------------------------------------------------------------------

def test_schemas():
    assert str(torch.ops.transfuse.attention_train.default._schema) == (
        "transfuse::attention_train(Tensor q, Tensor k, Tensor v, Tensor? bias, float scale, bool is_causal) -> Tensor")
    assert str(torch.ops.transfuse.attention_train_fwd.default._schema) == (
        "transfuse::attention_train_fwd(Tensor q, Tensor k, Tensor v, Tensor? bias, float scale, bool is_causal)"
        " -> (Tensor, Tensor, Tensor)")
    assert str(torch.ops.transfuse.attention_train_bwd.default._schema) == (
        "transfuse::attention_train_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? bias, Tensor out, "
        "Tensor stats, Tensor? grad_lse, float scale, bool is_causal, bool bias_needs_grad)"
        " -> (Tensor, Tensor, Tensor, Tensor)")


def _small(device, requires_grad=True):
    _, k, v = qkv(1, 2, 1, 11, 13, 16, torch.float32, device)
    q = torch.randn(1, 11, 2, 16, device=device).transpose(1, 2)  # the (batch, seqlen, heads, dim) layout
    bias = torch.randn(1, 2, 11, 13, device=device)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, bias)]


def test_opcheck(device):
    q, k, v, bias = _small(device)
    torch.library.opcheck(torch.ops.transfuse.attention_train_fwd.default, (q, k, v, bias, 0.25, True))
    torch.library.opcheck(torch.ops.transfuse.attention_train.default, (q, k, v, bias.detach(), 0.25, False))
    q, k, v, bias = _small(device, requires_grad=False)
    out, lse, stats = attention_train_fwd(q, k, v, bias, 0.25, True)
    grad_out = torch.randn_like(out)
    torch.library.opcheck(torch.ops.transfuse.attention_train_bwd.default,
                          (grad_out, q, k, v, bias, out, stats, torch.randn_like(lse), 0.25, True, True))


def test_packed_backward_writes_the_three_gradients_side_by_side(device):
    """attention_train_bwd_packed (a fused QKV linear's gradient, passes/backward_packed_qkv.py): dq,
    dk and dv, as attention_train_bwd gives them, laid along the last dim in the given order; with
    grouped KV heads of their own width. Its fake implementation agrees, and opcheck passes."""
    gen = torch.Generator().manual_seed(7)
    b, t, d = 2, 9, 16
    q = torch.randn(b, t, 4, d, generator=gen).to(device).transpose(1, 2)
    k, v = (torch.randn(b, t, 2, d, generator=gen).to(device).transpose(1, 2) for _ in range(2))
    out, lse, stats = attention_train_fwd(q, k, v, None, 0.25, True)
    grad_out = torch.randn(out.shape, generator=gen).to(device)
    dq, dk, dv, _ = attention_train_bwd(grad_out, q, k, v, None, out, stats, 0.25, True, False)
    order = [2, 0, 1]
    packed, dbias = torch.ops.transfuse.attention_train_bwd_packed(
        grad_out, q, k, v, None, out, stats, None, 0.25, True, False, order)
    assert packed.shape == (b, t, 4 * d + 2 * 2 * d) and packed.is_contiguous() and dbias.numel() == 0
    rows = {i: g.transpose(1, 2).reshape(b, t, -1) for i, g in enumerate((dq, dk, dv))}
    torch.testing.assert_close(packed, torch.cat([rows[i] for i in order], -1), rtol=0, atol=0)
    # what else k and v receive (a returned KV cache's gradients), added in the kernel
    extra_k = torch.randn(b, t, 2, d, generator=gen).to(device).transpose(1, 2)
    extra_v = torch.randn(k.shape, generator=gen).to(device)
    with_extra, _ = torch.ops.transfuse.attention_train_bwd_packed(
        grad_out, q, k, v, None, out, stats, None, 0.25, True, False, order, extra_k, extra_v)
    rows[1], rows[2] = ((g + e).transpose(1, 2).reshape(b, t, -1) for g, e in ((dk, extra_k), (dv, extra_v)))
    torch.testing.assert_close(with_extra, torch.cat([rows[i] for i in order], -1), rtol=1e-6, atol=1e-6)
    with FakeTensorMode() as mode:
        fake = torch.ops.transfuse.attention_train_bwd_packed(
            *(mode.from_tensor(x) for x in (grad_out, q, k, v)), None,
            *(mode.from_tensor(x) for x in (out, stats)), None, 0.25, True, False, order)
    assert fake[0].shape == packed.shape and fake[0].stride() == packed.stride()
    torch.library.opcheck(torch.ops.transfuse.attention_train_bwd_packed.default,
                          (grad_out, q, k, v, None, out, stats, None, 0.25, True, False, order, extra_k, None))


def test_op_autograd_and_fake_layout(device):
    """The public op is differentiable in every input; fake tensors get the real shapes and strides."""
    q, k, v, bias = _small(device)
    out = torch.ops.transfuse.attention_train(q, k, v, bias, 0.25, True)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, bias), grad_out)
    ref = _forward_backward(attention_train_ref, q, k, v, bias, 0.25, True, grad_out, None)
    _assert_close_fp32((out, ref[1], *grads), (ref[0], ref[1], *ref[2:]))

    real = attention_train_fwd(q.detach(), k.detach(), v.detach(), bias.detach(), 0.25, True)
    real_grads = attention_train_bwd(grad_out, q.detach(), k.detach(), v.detach(), bias.detach(), real[0],
                                     real[2], 0.25, True, True)
    plain = [t.detach() for t in (q, k, v, bias, grad_out)]
    with FakeTensorMode() as mode:
        fq, fk, fv, fb, fg = (mode.from_tensor(t) for t in plain)
        fake = torch.ops.transfuse.attention_train_fwd(fq, fk, fv, fb, 0.25, True)
        fake_grads = torch.ops.transfuse.attention_train_bwd(fg, fq, fk, fv, fb, fake[0], fake[2], None, 0.25,
                                                             True, True)
    for a, b in zip((*real, *real_grads), (*fake, *fake_grads)):
        assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def test_compile_fullgraph_dynamic(device):
    """The public op inside torch.compile (fullgraph, dynamic shapes), backward included, at two lengths."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda *args: torch.ops.transfuse.attention_train(*args, 0.25, True),
                             backend="aot_eager", fullgraph=True, dynamic=True)
    for seqlen in (17, 23):
        q, k, v = qkv(1, 2, 1, seqlen, seqlen, 16, torch.float32, device)
        bias = torch.randn(1, 2, seqlen, seqlen, device=device).requires_grad_()
        grad_out = torch.randn_like(q)
        ours = _forward_backward(lambda *a: (compiled(*a[:4]), torch.zeros(())), q, k, v, bias, 0.25, True,
                                 grad_out, None)
        ref = _forward_backward(attention_train_ref, q, k, v, bias, 0.25, True, grad_out, None)
        _assert_close_fp32((ours[0], ref[1], *ours[2:]), ref)  # the op gives no lse: ref's stands in


def test_bad_arguments(device):
    q, k, v = qkv(1, 3, 2, 9, 9, 16, torch.float32, device)
    with pytest.raises(ValueError):  # 3 query heads over 2 kv heads
        attention_train_fwd(q, k, v, None, 0.25, False)
    q, k, v = qkv(1, 2, 2, 9, 9, 16, torch.float32, device)
    with pytest.raises(TypeError):  # a bool mask must be converted by the caller
        attention_train_fwd(q, k, v, torch.ones(9, 9, dtype=torch.bool, device=device), 0.25, False)
    with pytest.raises(ValueError):
        attention_train_fwd(q, k, v, torch.zeros(3, 9, device=device), 0.25, False)
    with pytest.raises(ValueError):
        attention_train_fwd(*qkv(1, 2, 2, 9, 9, 320, torch.float32, device), None, 0.25, False)
    with pytest.raises(ValueError):  # the unmasked blocks scale the row maximum: scale >= 0 only
        attention_train_fwd(q, k, v, None, -0.25, False)


# ---- GPU, real sizes -------------------------------------------------------------------------------

GPU_ATOL = {torch.float16: 1e-3, torch.bfloat16: 2e-3}
FP16, BF16 = torch.float16, torch.bfloat16

# Each case compiles and autotunes three kernels for its (dtype, head dim, flags): both dtypes are
# covered per head dim where it matters, not the whole cross product.
GPU_CASES = [
    # batch, nheads, nheads_kv, seqlen_q, seqlen_k, head_dim, is_causal, dtype
    (2, 12, 12, 1024, 1024, 64, True, FP16),
    (2, 12, 12, 1024, 1024, 64, True, BF16),
    (2, 12, 12, 1024, 1024, 64, False, BF16),
    (2, 12, 12, 257, 257, 80, False, FP16),
    (2, 12, 12, 257, 257, 80, True, BF16),
    (2, 12, 12, 257, 257, 128, True, FP16),
    (2, 12, 4, 1024, 1024, 128, True, BF16),    # GQA
    (2, 12, 1, 257, 1024, 64, False, FP16),     # MQA, seqlen_q != seqlen_k
    (1, 4, 4, 512, 512, 256, True, BF16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "x".join(map(str, c[:6])) + ("-causal" if c[6] else "")
                         + "-" + str(c[7])[6:])
def test_gpu_matches_reference(case):
    batch, nheads, nheads_kv, seqlen_q, seqlen_k, head_dim, is_causal, dtype = case
    q, k, v = qkv(batch, nheads, nheads_kv, seqlen_q, seqlen_k, head_dim, dtype, "cuda")
    _check_low_precision(q, k, v, None, head_dim ** -0.5, is_causal, GPU_ATOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("kind, dtype", [("t5_position_bias", FP16), ("t5_position_bias", BF16),
                                         ("padding_inf", BF16), ("full_bias", FP16)])
def test_gpu_bias(kind, dtype):
    batch, nheads, seqlen, head_dim = 2, 12, 512, 64
    q, k, v = qkv(batch, nheads, nheads, seqlen, seqlen, head_dim, dtype, "cuda")
    if kind == "t5_position_bias":  # (1, H, S, S), requires grad: dbias summed over the batch
        bias = torch.randn(1, nheads, seqlen, seqlen, dtype=dtype, device="cuda").requires_grad_()
    elif kind == "padding_inf":     # (B, 1, 1, S) with -inf, no grad, causal
        keep = torch.arange(seqlen, device="cuda")[None, :] < torch.tensor([seqlen, 300], device="cuda")[:, None]
        bias = torch.zeros(batch, 1, 1, seqlen, dtype=dtype, device="cuda").masked_fill(
            ~keep[:, None, None, :], NEG_INF)
    else:                           # (B, H, S, S), requires grad: dS stored straight into dbias
        bias = torch.randn(batch, nheads, seqlen, seqlen, dtype=dtype, device="cuda").requires_grad_()
    _check_low_precision(q, k, v, bias, head_dim ** -0.5, kind == "padding_inf", GPU_ATOL[dtype])


@pytest.mark.gpu
def test_gpu_fp32():
    q, k, v = qkv(2, 4, 2, 257, 257, 80, torch.float32, "cuda")
    bias = torch.randn(1, 4, 257, 257, device="cuda").requires_grad_()
    _check_fp32(q, k, v, bias, 80 ** -0.5, True, use_lse=True, atol=1e-4)


@pytest.mark.gpu
def test_gpu_deterministic():
    """No atomics: two backward passes give bitwise equal gradients."""
    q, k, v = qkv(2, 12, 4, 1024, 1024, 128, torch.bfloat16, "cuda")
    bias = torch.randn(1, 12, 1024, 1024, dtype=torch.bfloat16, device="cuda")
    out, _, stats = attention_train_fwd(q, k, v, bias, 0.125, True)
    grad_out = torch.randn_like(out)
    first = attention_train_bwd(grad_out, q, k, v, bias, out, stats, 0.125, True, True)
    second = attention_train_bwd(grad_out, q, k, v, bias, out, stats, 0.125, True, True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
