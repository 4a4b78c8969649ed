"""copy.deepcopy of an optimized model (an EMA copy, a copy to evaluate): the copy runs its own
weights, through its own optimization, and the original is left as it was."""

import copy
import io

import pytest
import torch
import transformers

import transfuse
from tests.models.test_generate import _seq2seq


def _scaled(model: torch.nn.Module) -> None:
    """The same changes to every copy it is given (a seeded generator, parameters in module order):
    not a common scale, which norms would take out and leave greedy tokens as they were."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5 * (p.std() if p.numel() > 1 else 1.0))


def test_a_deep_copy_runs_its_own_weights():
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48, vocab_size=97,
        max_position_embeddings=64)).eval()
    ids = torch.randint(3, 97, (2, 7))
    with torch.no_grad():
        expected = model(ids).last_hidden_state
        transfuse.optimize(model)
        model(ids)
        twin = copy.deepcopy(model)
        _scaled(twin)
        plain = transfuse.restore(copy.deepcopy(twin))
        torch.testing.assert_close(twin(ids).last_hidden_state, plain(ids).last_hidden_state)
        torch.testing.assert_close(model(ids).last_hidden_state, expected)
    assert twin._transfuse_state is not model._transfuse_state
    assert not hasattr(plain, "_transfuse_state") and "forward" not in plain.__dict__
    with pytest.raises(transfuse.TransfuseError, match=r"cannot be pickled \(nor copy.copy'd\): save model.state_dict"):
        torch.save(model, io.BytesIO())
    torch.save(plain, io.BytesIO())  # restored: an ordinary module again


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_a_deep_copy_generates_with_its_own_weights(family):
    """generate() goes through closures over the model (the static cache, the decode loop's class,
    the encoder-decoder's compiled encoder): the copy's are its own."""
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=48,
            max_position_embeddings=64, vocab_size=97, pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval()
    else:
        model = _seq2seq("t5", layers=1).eval()
    ids = torch.randint(3, 97, (2, 6))
    kwargs = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False)
    reference = copy.deepcopy(model)
    _scaled(reference)
    with torch.no_grad():
        expected = reference.generate(ids, **kwargs)
        transfuse.optimize(model)
        before = model.generate(ids, **kwargs)
        twin = copy.deepcopy(model)
        _scaled(twin)
        assert torch.equal(twin.generate(ids, **kwargs), expected)
        assert torch.equal(model.generate(ids, **kwargs), before)
    assert twin._transfuse_state.decode_loop is not model._transfuse_state.decode_loop
    # nothing of the original's generate() path is the copy's (the closures hold the original model)
    for name in ("generate", "_prepare_encoder_decoder_kwargs_for_generation"):
        assert name not in model.__dict__ or twin.__dict__.get(name) is not model.__dict__[name], name
