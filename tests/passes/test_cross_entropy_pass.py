"""The LM head of a model that returns its logits next to its loss (nanoGPT's `return logits,
loss`), in training: head and loss become one transfuse.linear_logits_cross_entropy (padded GEMM,
one kernel pass for the returned logits, the loss and its gradient). Through AOTAutograd, as
optimize() trains: logits, loss and gradients equal eager's, with and without a second loss on the
returned logits, for the reductions and settings the op takes, and under bf16 autocast within
eager bf16's error. Eval graphs keep the plain CrossEntropy op.

Run: PYTHONPATH=src TRITON_INTERPRET=1 python3 -m pytest -q tests/passes/test_cross_entropy_pass.py"""

import copy

import pytest
import torch
import torch.nn.functional as F

import transfuse
from transfuse.ops.cross_entropy import linear_logits_cross_entropy
from tests.helpers import rewrite_counts


class TiedHead(torch.nn.Module):
    """nanoGPT's head and loss (transfuse/bench/nanogpt.py GPT.forward): an LM head tied to the token
    embedding, the loss over logits.view(-1, V), the logits returned too."""

    def __init__(self, vocab=97, hidden=32, bias=False, ignore_index=-1, label_smoothing=0.0, reduction="mean"):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, hidden)
        self.ln = torch.nn.Linear(hidden, hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=bias)
        self.lm_head.weight = self.wte.weight
        self.settings = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction)

    def forward(self, idx, targets):
        x = torch.tanh(self.ln(self.wte(idx)))
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), **self.settings)
        return logits, loss


def _step(model, ids, targets, logits_loss):
    logits, loss = model(ids, targets)
    total = loss.sum() if loss.dim() else loss
    if logits_loss:
        total = total + logits.float().pow(2).mean()
    total.backward()
    return logits, loss


def _inputs(vocab=97):
    ids = torch.randint(0, vocab, (2, 11))
    targets = torch.randint(0, vocab, (2, 11))
    targets[0, :3] = -1
    return ids, targets


def _grads(model):
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("reduction,label_smoothing", [("mean", 0.0), ("sum", 0.1), ("none", 0.0)])
@pytest.mark.parametrize("logits_loss", [False, True], ids=["loss-only", "logits-loss"])
def test_training_step_equals_eager(logits_loss, reduction, label_smoothing):
    torch.manual_seed(0)
    model = TiedHead(label_smoothing=label_smoothing, reduction=reduction, bias=reduction == "sum").train()
    reference = copy.deepcopy(model)
    ids, targets = _inputs()
    transfuse.optimize(model)
    logits, loss = _step(model, ids, targets, logits_loss)
    ref_logits, ref_loss = _step(reference, ids, targets, logits_loss)
    assert logits.shape == ref_logits.shape and logits.is_contiguous()
    logits.view(-1)  # as eager's logits allow
    assert torch.allclose(logits, ref_logits, rtol=1e-5, atol=1e-6)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    ours, theirs = _grads(model), _grads(reference)
    for name, ref in theirs.items():
        assert ref is not None and ref.abs().max() > 0, name
        error = ((ours[name] - ref).norm() / ref.norm()).item()  # fp32 rounding, summed in another order
        assert error < 1e-5, (name, error)
    rewrites = rewrite_counts(model)
    assert rewrites["CrossEntropy"] == 1 and rewrites["VocabPadding"] == 1, rewrites
    graph = model._transfuse_state.backend.graphs[0].graph
    targets_called = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets_called.count(linear_logits_cross_entropy) == 1
    assert F.linear not in targets_called and F.cross_entropy not in targets_called  # the head went in too


def test_vocabulary_multiple_of_64_is_not_padded():
    torch.manual_seed(0)
    model = TiedHead(vocab=128).train()
    reference = copy.deepcopy(model)
    ids, targets = _inputs(128)
    transfuse.optimize(model)
    _, loss = _step(model, ids, targets, True)
    _, ref_loss = _step(reference, ids, targets, True)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    grad, ref = model.wte.weight.grad, reference.wte.weight.grad
    assert ((grad - ref).norm() / ref.norm()).item() < 1e-5
    assert rewrite_counts(model)["CrossEntropy"] == 1 and rewrite_counts(model)["VocabPadding"] == 0


def test_bf16_autocast_within_eager_bf16_error():
    """fp32 parameters, bf16 GEMM (the pass casts the head's input as autocast does), fp32 loss;
    gradients as close to fp32's as eager bf16's."""
    torch.manual_seed(0)
    model = TiedHead().train()
    fp32, eager = copy.deepcopy(model), copy.deepcopy(model)
    ids, targets = _inputs()
    transfuse.optimize(model)
    _, gold = _step(fp32, ids, targets, False)
    results = []
    for m in (eager, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, loss = _step(m, ids, targets, False)
        results.append((logits, loss))
    assert results[1][0].dtype == results[0][0].dtype == torch.bfloat16
    assert results[1][1].dtype == torch.float32
    # one scalar: eager's own error may happen to be tiny, so the slack is bf16's precision (2^-8)
    assert abs(results[1][1] - gold) <= 2 * abs(results[0][1] - gold) + 4e-3 * abs(gold)
    for (name, p), e, g in zip(model.named_parameters(), eager.parameters(), fp32.parameters()):
        assert p.grad.dtype == torch.float32
        err, err_eager = (p.grad - g.grad).abs().max().item(), (e.grad - g.grad).abs().max().item()
        assert err <= 2 * err_eager + 1e-2 * g.grad.abs().max().item(), (name, err, err_eager)
    assert rewrite_counts(model)["VocabPadding"] == 1


def test_eval_keeps_the_plain_cross_entropy():
    torch.manual_seed(0)
    model = TiedHead().eval()
    ids, targets = _inputs()
    with torch.no_grad():
        ref_logits, ref_loss = model(ids, targets)
    transfuse.optimize(model)
    with torch.no_grad():
        logits, loss = model(ids, targets)
    assert torch.allclose(logits, ref_logits, rtol=1e-5, atol=1e-6)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert rewrite_counts(model)["CrossEntropy"] == 1 and rewrite_counts(model)["VocabPadding"] == 0
