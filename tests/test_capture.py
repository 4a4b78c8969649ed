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


def test_each_optimized_model_compiles_on_a_code_object_of_its_own():
    """Hugging Face's forward decorators share one code object among all models; Dynamo caps the
    entries per code object (256): the 257th model optimized in a process ran as written, silently.
    Here the cap is 2 and five models of one class must all compile."""
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, vocab_size=50)
    ids = torch.randint(0, 50, (1, 5))
    limit = torch._dynamo.config.accumulated_recompile_limit
    with torch._dynamo.config.patch(accumulated_recompile_limit=2):  # not monkeypatch: its undo deletes it
        for _ in range(5):
            model = transformers.BertModel(config).eval()
            with torch.no_grad():
                ref = model(ids).last_hidden_state
                transfuse.optimize(model)
                out = model(ids).last_hidden_state
            assert len(model._transfuse_state.backend.records) == 1
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert torch._dynamo.config.accumulated_recompile_limit == limit


def test_a_model_split_across_devices_runs_as_it_was():
    """Parameters on two devices (device_map="auto", offloading): one CUDA graph or kernel launch is
    one device's, so the model is left as it was, and the report says why."""

    class Split(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 4)
            self.offloaded = torch.nn.Parameter(torch.empty(4, 4, device="meta"))  # not read by forward

        def forward(self, x):
            return torch.relu(self.layer(x))

    torch.manual_seed(0)
    model = Split()
    x = torch.randn(3, 8)
    want = model(x)
    transfuse.optimize(model)
    assert torch.equal(model(x), want)
    report = transfuse.report(model)
    assert "left to eager: its tensors are on 2 devices (cpu, meta)" in report, report
    assert "nothing compiled" in report
