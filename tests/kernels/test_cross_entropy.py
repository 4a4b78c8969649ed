"""Fused linear + cross-entropy (transfuse.kernels.cross_entropy, transfuse.ops.cross_entropy) against
the plain-PyTorch reference: loss and the gradients of x, weight and bias, for every reduction, with
ignored rows, label smoothing, odd vocabularies with and without padding, several chunks, and half
precision with a tolerance relative to PyTorch's own error in that dtype. Tiny shapes: on CPU the
kernel runs in Triton's interpreter. The gpu-marked tests at the end run GPT-2-sized heads.

Run: PYTHONPATH=src TRITON_INTERPRET=1 python3 -m pytest -q tests/kernels/test_cross_entropy.py"""

import pytest
import torch
import torch.nn.functional as F

import transfuse.ops.cross_entropy  # noqa: F401  (registers the ops)
from transfuse.kernels.cross_entropy import (
    CrossEntropyConfig,
    cross_entropy_fwd_inplace_grad,
    default_chunk_rows,
    linear_cross_entropy_fwd,
)
from transfuse.ops.cross_entropy import linear_cross_entropy
from transfuse.reference.cross_entropy import linear_cross_entropy_ref

ops = torch.ops.transfuse

# dtype, atol relative to the largest reference value, added to twice torch's own error
DTYPES = [(torch.float32, 2e-6), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)]
# (vocab, pad_vocab_to): odd vocabularies, padded and not, and one already a multiple of 64
VOCABS = [(97, 0), (97, 64), (131, 64), (128, 64)]
ROWS, HIDDEN = 37, 24


def _inputs(rows, hidden, vocab, dtype, *, has_bias=True, param_dtype=None, ignore_index=-100,
            ignored_every=5, device="cpu"):
    """Random x, weight, bias (logits of std ~3: a peaked softmax, not a uniform one) and targets
    with every `ignored_every`-th row set to ignore_index (0: none)."""
    param_dtype = param_dtype or dtype
    x = torch.randn(rows, hidden, device=device).to(dtype)
    weight = (torch.randn(vocab, hidden, device=device) * (3.0 / hidden**0.5)).to(param_dtype)
    bias = torch.randn(vocab, device=device).to(param_dtype) if has_bias else None
    target = torch.randint(0, vocab, (rows,), device=device)
    if ignored_every:
        target[1::ignored_every] = ignore_index
    return x, weight, bias, target


def _leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


def _loss_and_grads(fn, x, weight, bias, target, grad_output_seed=1):
    """fn(x, weight, bias, target) -> loss; returns (loss, grad_x, grad_weight, grad_bias) for a random
    grad_output (a 'none' loss gets a random vector, a scalar one a random scalar)."""
    x, weight, bias = _leaves(x, weight, bias)
    loss = fn(x, weight, bias, target)
    gen = torch.Generator().manual_seed(grad_output_seed)
    grad_output = torch.randn(loss.shape, generator=gen).to(loss.device) + 2.0
    inputs = [t for t in (x, weight, bias) if t is not None]
    grads = list(torch.autograd.grad(loss, inputs, grad_output))
    if bias is None:
        grads.append(None)
    return (loss.detach(), *grads)


def _assert_within_torch_error(name, ours, torch_same, gold, atol):
    """err(ours) <= 2 * err(torch in the same dtype) + atol * max|gold| against the fp32 reference."""
    if gold is None:
        assert ours is None
        return
    assert ours.shape == gold.shape, name
    assert ours.dtype == torch_same.dtype, f"{name}: {ours.dtype} vs torch's {torch_same.dtype}"
    err_ours = (ours.double() - gold.double()).abs().max().item()
    err_torch = (torch_same.double() - gold.double()).abs().max().item()
    scale = max(gold.abs().max().item(), 1e-30)
    assert err_ours <= 2 * err_torch + atol * scale, (
        f"{name}: err {err_ours:.3g} vs torch {err_torch:.3g} (+{atol * scale:.3g})")


def _check_against_reference(ours_fn, x, weight, bias, target, ignore_index, label_smoothing, reduction, atol):
    def ref(x_, w_, b_, t_):
        return linear_cross_entropy_ref(x_, w_, b_, t_, ignore_index, label_smoothing, reduction)

    def gold_fn(x_, w_, b_, t_):
        return ref(x_.double(), w_.double(), None if b_ is None else b_.double(), t_)

    ours = _loss_and_grads(ours_fn, x, weight, bias, target)
    torch_same = _loss_and_grads(ref, x, weight, bias, target)
    gold = _loss_and_grads(gold_fn, x, weight, bias, target)
    for name, o, s, g in zip(("loss", "grad_x", "grad_weight", "grad_bias"), ours, torch_same, gold):
        _assert_within_torch_error(name, o, s, g, atol)
    # a test that cannot fail is a defect: the gradients it compares are not all zero
    assert ours[2].abs().max() > 0 and ours[1].abs().max() > 0


# ---------------------------------------------------------------------------------------------
# The op against the reference


# Every vocabulary in fp32; half precision, whose code paths are fp32's with other roundings, on
# fewer of them (the interpreter's CPU time): bf16 unpadded and padded, fp16 padded.
HALF_VOCABS = {torch.float16: [(97, 64)], torch.bfloat16: [(97, 0), (131, 64)]}
MATRIX = [pytest.param(*d, *v, id=f"{str(d[0])[6:]}-V{v[0]}-pad{v[1]}") for d in DTYPES for v in VOCABS
          if d[0] == torch.float32 or v in HALF_VOCABS[d[0]]]


@pytest.mark.parametrize("dtype,atol,vocab,pad", MATRIX)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_reference(reduction, label_smoothing, vocab, pad, dtype, atol):
    """The entry point: gradients computed in the forward (fused op) for 'mean'/'sum', recomputed in
    the backward for 'none'; chunks of 24 and 13 rows."""
    x, weight, bias, target = _inputs(ROWS, HIDDEN, vocab, dtype)

    def ours(x_, w_, b_, t_):
        return linear_cross_entropy(x_, w_, b_, t_, -100, label_smoothing, reduction, pad, 24)

    _check_against_reference(ours, x, weight, bias, target, -100, label_smoothing, reduction, atol)


@pytest.mark.parametrize("dtype,atol", DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_recompute_path_matches_reference(reduction, dtype, atol):
    """torch.ops.transfuse.linear_cross_entropy itself: loss only in the forward, the gradients from
    linear_cross_entropy_backward, smoothing, padding and chunks together."""
    x, weight, bias, target = _inputs(ROWS, HIDDEN, 131, dtype)

    def ours(x_, w_, b_, t_):
        return ops.linear_cross_entropy(x_, w_, b_, t_, -100, 0.1, reduction, 64, 16)

    _check_against_reference(ours, x, weight, bias, target, -100, 0.1, reduction, atol)


@pytest.mark.parametrize("ignore_index,chunk_rows", [(-100, 1), (-1, 0), (-1, 1), (-1, 12), (-1, 64), (3, 5)])
def test_ignore_index_and_chunks(ignore_index, chunk_rows):
    """A custom ignore_index (also one inside [0, V)) and chunkings of 13 rows: one chunk (auto), one
    row per chunk, a last chunk of one row, a chunk larger than the input, uneven chunks. The mean's
    denominator counts the valid rows of all chunks."""
    x, weight, bias, target = _inputs(13, HIDDEN, 97, torch.float32, ignore_index=ignore_index, ignored_every=3)
    assert (target == ignore_index).any()

    def ours(x_, w_, b_, t_):
        return linear_cross_entropy(x_, w_, b_, t_, ignore_index, 0.1, "mean", 0, chunk_rows)

    _check_against_reference(ours, x, weight, bias, target, ignore_index, 0.1, "mean", 2e-6)


@pytest.mark.parametrize("dtype,atol", DTYPES[1:], ids=["fp16", "bf16"])
def test_fp32_parameters_with_half_x(dtype, atol):
    """Autocast-style: x in half precision, weight and bias fp32, cast to x's dtype for the matmuls;
    their gradients come back in fp32, the loss and grad_x as the reference's."""
    x, weight, bias, target = _inputs(ROWS, HIDDEN, 97, dtype, param_dtype=torch.float32)

    def ours(x_, w_, b_, t_):
        return linear_cross_entropy(x_, w_, b_, t_, -100, 0.0, "mean", 64, 16)

    _check_against_reference(ours, x, weight, bias, target, -100, 0.0, "mean", atol)
    loss, grad_x, grad_weight, grad_bias = _loss_and_grads(ours, x, weight, bias, target)
    assert loss.dtype == torch.float32 and grad_x.dtype == dtype
    assert grad_weight.dtype == torch.float32 and grad_bias.dtype == torch.float32


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_no_bias(reduction):
    x, weight, _, target = _inputs(ROWS, HIDDEN, 97, torch.float32, has_bias=False)

    def ours(x_, w_, b_, t_):
        return linear_cross_entropy(x_, w_, b_, t_, -100, 0.0, reduction, 64, 16)

    _check_against_reference(ours, x, weight, None, target, -100, 0.0, reduction, 2e-6)


def test_only_some_inputs_require_grad():
    """A frozen weight (LoRA, tied embeddings frozen): the fused op computes no grad_weight, and the
    gradients it does compute are the reference's."""
    x, weight, bias, target = _inputs(ROWS, HIDDEN, 97, torch.float32)
    x_leaf = x.clone().requires_grad_(True)
    loss = linear_cross_entropy(x_leaf, weight, bias, target, -100, 0.0, "mean", 0, 16)
    (grad_x,) = torch.autograd.grad(loss, [x_leaf])
    x_ref = x.clone().requires_grad_(True)
    (ref_x,) = torch.autograd.grad(linear_cross_entropy_ref(x_ref, weight, bias, target), [x_ref])
    torch.testing.assert_close(grad_x, ref_x)
    _, _, grad_weight, grad_bias = ops.linear_cross_entropy_fused(
        x, weight, bias, target, -100, 0.0, "mean", 0, 16, True, False, False)
    assert grad_weight.shape == (0,) and grad_bias.shape == (0,)


def test_leading_dims_and_no_grad():
    """The entry point takes x: (..., H) and target: (...); 'none' comes back in target's shape; under
    no_grad it runs the loss-only op, to the same numbers."""
    x, weight, bias, target = _inputs(2 * 7, HIDDEN, 97, torch.float32)
    x3, target3 = x.view(2, 7, HIDDEN), target.view(2, 7)
    with torch.no_grad():
        loss = linear_cross_entropy(x3, weight, bias, target3, reduction="none", pad_vocab_to=64)
        mean = linear_cross_entropy(x3, weight, bias, target3)
    assert loss.shape == (2, 7)
    ref = linear_cross_entropy_ref(x, weight, bias, target, reduction="none").view(2, 7)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(mean, linear_cross_entropy_ref(x, weight, bias, target))
    assert (loss[target3 == -100] == 0).all() and (loss[target3 != -100] > 0).all()


def test_all_rows_ignored():
    """torch's 'mean' over no valid row is 0/0 = NaN with all-zero gradients; 'sum' is 0."""
    x, weight, bias, target = _inputs(9, HIDDEN, 97, torch.float32)
    target.fill_(-100)
    for reduction in ("mean", "sum"):
        ours = _loss_and_grads(lambda *a: linear_cross_entropy(*a, reduction=reduction, chunk_rows=4),
                               x, weight, bias, target)
        ref = _loss_and_grads(lambda *a: linear_cross_entropy_ref(*a, reduction=reduction), x, weight, bias, target)
        assert torch.isnan(ours[0]) == torch.isnan(ref[0])
        for o, r in zip(ours, ref):
            torch.testing.assert_close(o, r, equal_nan=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_no_rows(reduction):
    """An empty batch: torch's 'mean' is NaN, 'sum' 0, 'none' empty; the gradients are zeros."""
    x, weight, bias, target = _inputs(0, HIDDEN, 97, torch.float32)
    ours = _loss_and_grads(lambda *a: linear_cross_entropy(*a, reduction=reduction), x, weight, bias, target)
    ref = _loss_and_grads(lambda *a: linear_cross_entropy_ref(*a, reduction=reduction), x, weight, bias, target)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r, equal_nan=True)


def test_weight_is_not_modified_by_padding():
    x, weight, bias, target = _inputs(ROWS, HIDDEN, 97, torch.bfloat16)
    weight_before, bias_before = weight.clone(), bias.clone()
    w_leaf, b_leaf = _leaves(weight, bias)
    loss = linear_cross_entropy(x, w_leaf, b_leaf, target, pad_vocab_to=64, chunk_rows=16)
    loss.backward()
    assert torch.equal(weight, weight_before) and torch.equal(bias, bias_before)
    assert torch.equal(w_leaf.detach(), weight_before)
    assert w_leaf.grad.shape == (97, HIDDEN) and b_leaf.grad.shape == (97,)


# ---------------------------------------------------------------------------------------------
# The kernel on a logits buffer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.25])
def test_kernel_several_blocks_and_padding(label_smoothing, dtype):
    """BLOCK_V=16 over V=97 (7 blocks) inside a buffer 112 wide, 4 rows per program over 11 rows (the
    last program partial): the running max grows from block to block (a ramp) so the online
    rescaling is exercised; padded columns and ignored rows get zeros."""
    rows, vocab, width = 11, 97, 112
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(rows, width, generator=gen) * 4 + torch.linspace(0, 30, width)).to(dtype)
    logits[:, vocab:] = 1e4  # garbage in the padding: must not take part
    target = torch.randint(0, vocab, (rows,), generator=gen)
    target[[0, 5]] = -100
    scale = torch.rand(rows, generator=gen) + 0.5  # per-row grad_output, as in a 'none' backward

    z = logits[:, :vocab].float().requires_grad_(True)
    ref_loss = F.cross_entropy(z, target, reduction="none", label_smoothing=label_smoothing)
    (ref_grad,) = torch.autograd.grad(ref_loss, [z], scale)

    buffer = logits.clone()
    loss = cross_entropy_fwd_inplace_grad(buffer, target, vocab, -100, label_smoothing, scale,
                                          config=CrossEntropyConfig(BLOCK_V=16, ROWS_PER_PROGRAM=4, num_warps=4))
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(buffer[:, :vocab], ref_grad)  # a few fp32 ulps: another summation order
    else:
        # the fp32 gradient rounded once to bf16 (to nearest even): equal but where the two fp32 values
        # straddle a rounding boundary, and then by one bf16 ulp
        torch.testing.assert_close(buffer[:, :vocab].float(), ref_grad.to(dtype).float(), atol=1e-6, rtol=2**-8)
        assert (buffer[:, :vocab] != ref_grad.to(dtype)).float().mean() < 0.01
    assert (buffer[:, vocab:] == 0).all()
    assert (buffer[[0, 5]] == 0).all() and (loss[[0, 5]] == 0).all()

    # without grad_scale the logits are only read
    untouched = logits.clone()
    loss_only = cross_entropy_fwd_inplace_grad(untouched, target, vocab, -100, label_smoothing, None,
                                               config=CrossEntropyConfig(BLOCK_V=16, ROWS_PER_PROGRAM=4, num_warps=4))
    torch.testing.assert_close(loss_only, loss, atol=0, rtol=0)
    assert torch.equal(untouched, logits)


def test_target_out_of_range_raises():
    x, weight, bias, target = _inputs(5, HIDDEN, 97, torch.float32, ignored_every=0)
    target[2] = 97
    with pytest.raises(IndexError, match="out of"):
        linear_cross_entropy(x, weight, bias, target)


def test_argument_errors():
    x, weight, bias, target = _inputs(5, HIDDEN, 97, torch.float32)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(x, weight, bias, target, reduction="avg")
    with pytest.raises(TypeError, match="autocast"):
        linear_cross_entropy(x, weight.half(), bias, target)
    with pytest.raises(ValueError, match="target"):
        linear_cross_entropy(x, weight, bias, target.int())
    with pytest.raises(ValueError, match="label_smoothing"):
        linear_cross_entropy(x, weight, bias, target, label_smoothing=1.5)
    with pytest.raises(ValueError, match="'mean' or 'sum'"):
        linear_cross_entropy_fwd(x, weight, bias, target, -100, 0.0, "none", needs_grad_x=True)
    # the fused op asked for no grad_x cannot give one in backward
    x_leaf = x.clone().requires_grad_(True)
    loss, *_ = ops.linear_cross_entropy_fused(x_leaf, weight, bias, target, -100, 0.0, "mean", 0, 0,
                                              False, False, False)
    with pytest.raises(RuntimeError, match="not computed"):
        loss.backward()


def test_default_chunk_rows():
    # GPT-2: 50304 padded columns in bf16, 256 MiB: 2668 rows fit, rounded down to 2560
    assert default_chunk_rows(8192, 50304, 2) == 2560
    assert default_chunk_rows(100, 50304, 2) == 100  # never more than there are rows
    assert default_chunk_rows(8192, 50304, 2, chunk_bytes=1000) == 1  # at least one row
    assert default_chunk_rows(8192, 1024, 4, chunk_bytes=100 * 4096) == 100  # < 128: not rounded


# ---------------------------------------------------------------------------------------------
# The ops' registration


def _opcheck_cases():
    x, weight, bias, target = _inputs(13, 16, 37, torch.float32)
    xh, wh, bh = x.bfloat16(), weight.bfloat16(), bias.bfloat16()
    return [
        ("linear_cross_entropy", (x, weight, bias, target, -100, 0.1, "mean", 0, 8)),
        ("linear_cross_entropy", (xh, weight, None, target, -100, 0.0, "none", 64, 0)),
        ("linear_cross_entropy", (x, weight, bias, target, -100, 0.0, "sum", 16)),
        ("linear_cross_entropy_fused", (x, weight, bias, target, -100, 0.1, "mean", 64, 8, True, True, True)),
        ("linear_cross_entropy_fused", (xh, wh, bh, target, -100, 0.0, "sum", 0, 0, True, False, True)),
        ("linear_cross_entropy_backward",
         (torch.rand(()), x, weight, bias, target, -100, 0.1, "mean", 64, 0, True, True, True)),
        ("linear_cross_entropy_backward",
         (torch.rand(13), xh, wh, None, target, -100, 0.0, "none", 0, 0, True, False, False)),
    ]


OPCHECK_IDS = [f"{name}-{i}" for i, (name, _) in enumerate(_opcheck_cases())]


@pytest.mark.parametrize("case", range(len(OPCHECK_IDS)), ids=OPCHECK_IDS)
def test_opcheck(case):
    name, args = _opcheck_cases()[case]
    if name != "linear_cross_entropy_backward":
        # exercise the autograd registrations too: the inputs that get a gradient require one (for the
        # fused op, those its needs_grad_* flags compute)
        wanted = args[9:12] if name == "linear_cross_entropy_fused" else (True, True, True)
        args = (*(a.clone().requires_grad_(True) if i < 3 and a is not None and wanted[i] else a
                  for i, a in enumerate(args)),)
    torch.library.opcheck(getattr(ops, name).default, args)


def test_schemas():
    assert str(ops.linear_cross_entropy.default._schema) == (
        "transfuse::linear_cross_entropy(Tensor x, Tensor weight, Tensor? bias, Tensor target, SymInt ignore_index, "
        "float label_smoothing, str reduction, SymInt pad_vocab_to, SymInt chunk_rows=0) -> Tensor")


# ---------------------------------------------------------------------------------------------
# GPU, real sizes (GPT-2 small's head: 8 x 1024 tokens, H 768, V 50257)


@pytest.mark.gpu
@pytest.mark.parametrize("pad", [0, 64])
@pytest.mark.parametrize("reduction,label_smoothing", [("mean", 0.0), ("mean", 0.1), ("sum", 0.0)])
def test_gpu_gpt2_head(reduction, label_smoothing, pad):
    rows, hidden, vocab = 8 * 1024, 768, 50257
    x, weight, bias, target = _inputs(rows, hidden, vocab, torch.bfloat16, has_bias=False, ignored_every=7,
                                      device="cuda")

    def ours(x_, w_, b_, t_):
        return linear_cross_entropy(x_, w_, b_, t_, -100, label_smoothing, reduction, pad)

    _check_against_reference(ours, x, weight, None, target, -100, label_smoothing, reduction, 1e-2)


@pytest.mark.gpu
def test_gpu_gpt2_head_none_and_memory():
    """'none' (recomputing backward) at full size, and the point of the op: the peak memory of the
    fused forward + backward stays well under one fp32 copy of the (rows, V) logits (1.6 GB here;
    eager holds about three times that). Expected ~0.65 GB: a 256 MiB logits chunk, the fp32
    grad_weight accumulator and one chunk's fp32 partial (150 MB each), the padded bf16 weight."""
    rows, hidden, vocab = 8 * 1024, 768, 50257
    x, weight, _, target = _inputs(rows, hidden, vocab, torch.bfloat16, has_bias=False, device="cuda")

    def ours(x_, w_, b_, t_):
        return linear_cross_entropy(x_, w_, b_, t_, reduction="none", pad_vocab_to=64)

    _check_against_reference(ours, x, weight, None, target, -100, 0.0, "none", 1e-2)

    x_leaf, w_leaf = _leaves(x, weight)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    linear_cross_entropy(x_leaf, w_leaf, None, target, pad_vocab_to=64).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    full_logits_fp32 = rows * vocab * 4
    assert peak < 0.6 * full_logits_fp32, f"peak {peak / 2**20:.0f} MiB"


# ---------------------------------------------------------------------------------------------
# The logits-returning head (linear_logits_cross_entropy): the kernel's logits copy and the
# backward's gradient-add pass. Op-level tests: tests/ops/test_cross_entropy.py.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_copies_the_logits_out_in_the_same_pass(dtype):
    """copy_to gets the real columns of every row, ignored ones included, as they were before the
    gradient overwrote them; loss and gradient are those of the run without a copy."""
    rows, vocab, padded = 19, 150, 192
    logits = (torch.randn(rows, padded) * 3).to(dtype)
    target = torch.randint(0, vocab, (rows,))
    target[::4] = -1
    config = CrossEntropyConfig(BLOCK_V=64, ROWS_PER_PROGRAM=4, num_warps=4)  # three blocks, a partial one
    plain, copied = logits.clone(), logits.clone()
    copy = torch.full((rows, vocab), 7.0, dtype=dtype)
    scale = torch.tensor(0.25)
    loss_plain = cross_entropy_fwd_inplace_grad(plain, target, vocab, -1, 0.1, scale, config=config)
    loss_copied = cross_entropy_fwd_inplace_grad(copied, target, vocab, -1, 0.1, scale, copy_to=copy, config=config)
    assert torch.equal(copy, logits[:, :vocab])
    assert torch.equal(loss_plain, loss_copied) and torch.equal(plain, copied)
    assert torch.equal(copied[:, vocab:], torch.zeros(rows, padded - vocab, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_stores_the_rows_log_sum_exp(dtype):
    """lse_out gets logsumexp over the real columns of every valid row (padding excluded), 0 on ignored
    rows; loss and copy are those of the run without it."""
    rows, vocab, padded = 19, 150, 192
    logits = (torch.randn(rows, padded) * 3).to(dtype)
    target = torch.randint(0, vocab, (rows,))
    target[::4] = -1
    config = CrossEntropyConfig(BLOCK_V=64, ROWS_PER_PROGRAM=4, num_warps=4)
    lse = torch.full((rows,), 7.0)
    copy = torch.empty(rows, vocab, dtype=dtype)
    loss = cross_entropy_fwd_inplace_grad(logits.clone(), target, vocab, -1, 0.1, None, copy_to=copy, lse_out=lse,
                                          config=config)
    plain = cross_entropy_fwd_inplace_grad(logits.clone(), target, vocab, -1, 0.1, None, config=config)
    expected = torch.logsumexp(logits[:, :vocab].double(), dim=1).float()
    valid = target != -1
    torch.testing.assert_close(lse[valid], expected[valid], rtol=1e-6, atol=1e-5)
    assert torch.equal(lse[~valid], torch.zeros(int((~valid).sum())))
    assert torch.equal(loss, plain) and torch.equal(copy, logits[:, :vocab])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["scalar", "per-row", "no-loss-grad", "no-grad-logits", "smoothing"])
def test_logits_grad(case, dtype):
    """The logits-returning head's backward pass: scale * d loss / d logits recomputed from the logits
    and lse, plus the logits' own gradient, zero-padded to Vp; fp32 arithmetic, one rounding."""
    from transfuse.kernels.cross_entropy import cross_entropy_logits_grad

    rows, vocab, padded = 21, 97, 128
    logits = (torch.randn(rows, 2 * vocab) * 3).to(dtype)[:, ::2].contiguous()
    target = torch.randint(0, vocab, (rows,))
    target[::5] = -100
    eps = 0.1 if case == "smoothing" else 0.0
    lse = torch.logsumexp(logits.double(), dim=1).float()
    grad_logits = torch.randn(rows, 2 * vocab).to(dtype)[:, ::2]  # a row stride that is not V
    scale = torch.rand(rows) + 0.5 if case == "per-row" else torch.tensor(1.5)
    use_loss, use_logits = case != "no-loss-grad", case != "no-grad-logits"
    out = cross_entropy_logits_grad(logits, lse, target, -100, eps, scale if use_loss else None,
                                    grad_logits if use_logits else None, padded)
    expected = torch.zeros(rows, padded, dtype=torch.float64)
    if use_loss:
        soft = torch.exp(logits.double() - lse.double()[:, None])
        valid = target != -100
        onehot = F.one_hot(target.clamp(min=0), vocab).double()
        grad = (soft - (1 - eps) * onehot - eps / vocab) * (scale[:, None] if scale.dim() else scale).double()
        expected[:, :vocab] += torch.where(valid[:, None], grad, 0.0)
    if use_logits:
        expected[:, :vocab] += grad_logits.double()
    assert out.dtype == dtype and out.shape == (rows, padded)
    assert torch.equal(out[:, vocab:], torch.zeros(rows, padded - vocab, dtype=dtype))
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.double(), expected.to(dtype).double(), rtol=tol, atol=tol)


def test_logits_grad_by_column_chunks():
    """Columns [col_start, col_end) of the gradient, the last chunk reaching into the padding: the
    same values as those columns of the whole."""
    from transfuse.kernels.cross_entropy import cross_entropy_logits_grad

    rows, vocab, padded = 13, 97, 128
    logits = torch.randn(rows, vocab) * 3
    target = torch.randint(0, vocab, (rows,))
    target[::5] = -100
    lse = torch.logsumexp(logits, dim=1)
    grad_logits = torch.randn(rows, vocab)
    whole = cross_entropy_logits_grad(logits, lse, target, -100, 0.1, torch.tensor(0.5), grad_logits, padded)
    for start, end in [(0, 48), (48, 96), (96, 128)]:
        part = cross_entropy_logits_grad(logits, lse, target, -100, 0.1, torch.tensor(0.5), grad_logits, padded,
                                         start, end)
        assert part.shape == (rows, end - start) and torch.equal(part, whole[:, start:end]), (start, end)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_returning_head_by_chunks_equals_one_chunk(bias):
    """linear_logits_cross_entropy_fwd by row chunks and its backward by column chunks (grad_x summed
    over them in fp32) give what one chunk gives."""
    from transfuse.kernels.cross_entropy import linear_logits_cross_entropy_bwd, linear_logits_cross_entropy_fwd

    rows, hidden, vocab = 23, 16, 150
    x = torch.randn(rows, hidden)
    weight, b = torch.randn(vocab, hidden) * 0.3, (torch.randn(vocab) if bias else None)
    target = torch.randint(0, vocab, (rows,))
    target[::6] = -100
    args = (x, weight, b, target, -100, 0.1, "mean", 64, True)
    logits, loss, lse = linear_logits_cross_entropy_fwd(*args)
    logits_c, loss_c, lse_c = linear_logits_cross_entropy_fwd(*args, chunk_rows=5)
    for ours, whole in ((logits_c, logits), (lse_c, lse), (loss_c, loss)):  # the CPU GEMM blocks by M
        torch.testing.assert_close(ours, whole, rtol=1e-6, atol=1e-6)
    grads = [linear_logits_cross_entropy_bwd(torch.tensor(1.0), torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)),
                                             logits, lse, x, weight, b, target, -100, 0.1, "mean", 64, True, True, bias,
                                             chunk_cols=cols) for cols in (0, 64)]
    (gx, gw, gb), (gx_c, gw_c, gb_c) = grads
    torch.testing.assert_close(gx_c, gx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw_c, gw, rtol=1e-6, atol=1e-6)
    assert not bias or torch.equal(gb_c, gb)


@pytest.mark.gpu
@pytest.mark.parametrize("logits_grad", [False, True], ids=["loss-only", "logits-grad"])
@pytest.mark.parametrize("reduction,label_smoothing", [("mean", 0.0), ("mean", 0.1), ("sum", 0.0), ("none", 0.0)])
def test_gpu_gpt2_head_returning_logits(reduction, label_smoothing, logits_grad):
    """nanoGPT's training head at full size (8 x 1024 tokens, H 768, V 50257 padded to 50304, bf16 with
    the fp32 tied weight, as under autocast) against fp32/fp64 torch."""
    from tests.ops.test_cross_entropy import _inputs as logits_inputs
    from tests.ops.test_cross_entropy import check

    x, weight, _, target = logits_inputs(50257, torch.bfloat16, param_dtype=torch.float32, has_bias=False,
                                         ignore_index=-1, device="cuda", rows=8 * 1024, hidden=768)
    check(x, weight, None, target, -1, label_smoothing, reduction, 64, logits_grad, 1e-2)


@pytest.mark.gpu
def test_gpu_gpt2_head_returning_logits_fp16_with_bias():
    from tests.ops.test_cross_entropy import _inputs as logits_inputs
    from tests.ops.test_cross_entropy import check

    x, weight, bias, target = logits_inputs(50257, torch.float16, device="cuda", rows=3 * 1000 + 7, hidden=768)
    check(x, weight, bias, target, -100, 0.1, "mean", 64, True, 2e-3)
