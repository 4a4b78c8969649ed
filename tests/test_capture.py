"""optimize() inside other compilers: an outer torch.compile (as Hugging Face's generate() does
for a static cache) calls the optimized forward instead of tracing through it."""

import torch
import transformers

import transfuse
from tests.helpers import rel_err, tiny_bert_twins


def test_outer_torch_compile_keeps_the_transfuse_graph():
    model, eager, ids = tiny_bert_twins()
    transfuse.optimize(model)
    outer = torch.compile(model, backend="eager")
    with torch.no_grad():
        out = outer(input_ids=ids).last_hidden_state
        ref = eager(input_ids=ids).last_hidden_state
    assert rel_err(out, ref) < 1e-5
    (record,) = model._transfuse_state.backend.records
    assert record.rewrites["TorchSDPA"] == 2  # transfuse traced and rewrote it, not the outer compile


def test_generate_does_not_compile_again_and_restore_gives_it_back():
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96, max_position_embeddings=64, vocab_size=97)
    model = transformers.LlamaForCausalLM(cfg).eval()
    before = model.generation_config.disable_compile
    transfuse.optimize(model)
    assert model.generation_config.disable_compile is True
    transfuse.restore(model)
    assert model.generation_config.disable_compile == before
