"""CausalMaskFromShapes: a mask computed from the sequence length alone is proven causal at compile
time (run at lengths beyond its integer constants) and becomes is_causal in a training graph;
CausalKeyPadding: the same mask and a padding input on the keys becomes is_causal and a key mask;
masks that are not exactly that are left as they are."""


import pytest
import torch
import torch.nn.functional as F

import transfuse
from tests.helpers import rewrite_counts

DIM, HEADS = 16, 2


def causal(q_idx, k_idx):
    return k_idx <= q_idx


def sliding_window(q_idx, k_idx):  # Mistral's: causal and at most 4 keys back
    return (k_idx <= q_idx) & (q_idx - k_idx < 4)


def long_window(q_idx, k_idx):  # causal at every length the test runs (11), not beyond 100
    return (k_idx <= q_idx) & (q_idx - k_idx < 100)


def everything(q_idx, k_idx):
    return k_idx >= 0


class Attention(torch.nn.Module):
    """One attention layer whose mask is built from aranges of the sequence length, as Hugging Face's
    create_causal_mask builds one under tracing."""

    def __init__(self, rule, additive=False, manual=False, pad_queries=False):
        super().__init__()
        self.rule, self.additive, self.manual, self.pad_queries = rule, additive, manual, pad_queries
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.out = torch.nn.Linear(DIM, DIM)

    def forward(self, x, padding=None):
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        positions = torch.arange(seq, device=x.device)
        mask = self.rule(positions[:, None], positions[None, :])[None, None].expand(batch, 1, seq, seq)
        if padding is not None and self.pad_queries:
            mask = mask & padding[:, None, :, None].bool()
        elif padding is not None:
            mask = mask & padding[:, None, None, :].bool()
        if self.additive:  # Hugging Face's eager masks add the dtype's minimum; others -inf
            mask = torch.where(mask, 0.0, float("-inf") if self.additive == "inf" else torch.finfo(x.dtype).min)
        if self.manual:
            scores = q @ k.transpose(-2, -1) / (DIM // HEADS) ** 0.5 + mask
            y = torch.softmax(scores, dim=-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(batch, seq, DIM))


def _train_step(model, x, padding=None):
    model(x, padding).square().sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _check(rule, expect_causal, padding=False, pattern="CausalMaskFromShapes", dynamic=True, **kwargs):
    torch.manual_seed(0)
    model = Attention(rule, **kwargs).train()
    reference = Attention(rule, **kwargs).train()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 11, DIM)
    pad = torch.ones(2, 11)
    pad[1, -3:] = 0
    pad = pad if padding else None
    expected = _train_step(reference, x, pad)
    transfuse.optimize(model, dynamic=dynamic)
    got = _train_step(model, x, pad)
    assert (rewrite_counts(model)[pattern] == 1) == expect_causal, rewrite_counts(model)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("additive", [False, True], ids=["bool", "additive"])
def test_causal_mask_from_shapes_becomes_is_causal(additive):
    _check(causal, True, additive=additive)


@pytest.mark.parametrize("rule,causal", [(causal, True), (sliding_window, False)], ids=["causal", "window"])
def test_static_shapes_are_probed_at_their_one_length(rule, causal):
    _check(rule, causal, dynamic=False)
    _check(rule, causal, padding=True, pattern="CausalKeyPadding", dynamic=False)


def test_hand_written_attention_with_an_additive_causal_mask():
    _check(causal, True, additive=True, manual=True)


@pytest.mark.parametrize("rule", [sliding_window, long_window], ids=["window-4", "window-100"])
def test_sliding_window_is_not_causal(rule):
    """Causal at every length up to its window: only a probe longer than the window tells them apart."""
    _check(rule, False)


def test_unmasked_is_not_causal():
    _check(everything, False)


@pytest.mark.parametrize("additive", [False, "inf"], ids=["bool", "additive-inf"])
def test_causal_mask_with_key_padding_becomes_is_causal_and_a_key_mask(additive):
    """Hugging Face's mask when the model gets an attention_mask: causal and the kept keys."""
    _check(causal, True, padding=True, pattern="CausalKeyPadding", additive=additive)


def test_key_padding_with_a_finite_minimum_is_left_alone():
    """A query whose keys are all padded spreads evenly over every key under a finite additive mask
    (eager), not over none (-inf, is_causal with a key mask): such masks keep their own form."""
    _check(causal, False, padding=True, pattern="CausalKeyPadding", additive=True)


def test_padding_on_the_queries_is_left_alone():
    _check(causal, False, padding=True, pattern="CausalKeyPadding", pad_queries=True)


def test_sliding_window_with_key_padding_is_left_alone():
    _check(long_window, False, padding=True, pattern="CausalKeyPadding")


def test_padding_of_other_sizes_behaves_as_in_eager():
    """The synthetic model broadcasts its padding as it is: one row serves the whole batch (as in
    eager), and a padding longer than the sequence is an error (as in eager), not sliced."""
    torch.manual_seed(0)
    model = Attention(causal).train()
    reference = Attention(causal).train()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 11, DIM)
    transfuse.optimize(model)
    _train_step(model, x, torch.ones(2, 11))
    assert rewrite_counts(model)["CausalKeyPadding"] == 1
    one_row = torch.ones(1, 11)
    one_row[0, 8:] = 0
    torch.testing.assert_close(model(x, one_row), reference(x, one_row), rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError):
        reference(x, torch.ones(2, 15))
    with pytest.raises(RuntimeError):  # Dynamo's re-trace meets eager's broadcast error
        model(x, torch.ones(2, 15))


def test_key_padding_mask_checks_the_sizes_it_was_proven_for():
    from transfuse.passes.causal_mask import key_padding_mask

    padding = torch.tensor([[1, 1, 0, 5], [0, 2, 1, 1], [1, 1, 1, 1]])
    keep = key_padding_mask(padding, 2, 3, (False, False))  # the model read P[b, k] of a larger P
    assert keep.shape == (2, 1, 1, 3) and torch.equal(keep[:, 0, 0], padding[:2, :3] != 0)
    with pytest.raises(RuntimeError, match="attention_mask of shape"):
        key_padding_mask(padding, 3, 5, (False, False))  # smaller than the batch and keys
    with pytest.raises(RuntimeError, match="attention_mask of shape"):
        key_padding_mask(padding, 2, 4, (True, False))  # its rows must be the batch's
    assert torch.equal(key_padding_mask(padding, 3, 4, (True, True))[:, 0, 0], padding != 0)
