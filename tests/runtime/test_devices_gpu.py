"""A model on another GPU than the current device (runtime/call_lock.py makes the model's device
current for each call), and a model split across GPUs (left as it was, and reported). Needs two
GPUs: run on the device tool's nvidia-h200-x2."""

from __future__ import annotations

import copy

import pytest
import torch

import transfuse
from tests.helpers import rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]


def _bert(layers=2):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(BertConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=96,
                                vocab_size=211, max_position_embeddings=128)).eval()


def _ids(b, s, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 211, (b, s), generator=gen).to(device), torch.ones(b, s, dtype=torch.long, device=device)


@pytest.mark.parametrize("model_device, current", [(1, 0), (0, 1)])
def test_model_on_another_gpu_than_the_current_one(model_device, current):
    ref32 = _bert().to(f"cuda:{model_device}")
    eager = copy.deepcopy(ref32).half()
    opt = transfuse.optimize(copy.deepcopy(eager))
    with torch.cuda.device(current), torch.no_grad():
        for i, (b, s) in enumerate([(2, 16), (3, 40), (2, 16), (3, 40), (1, 7), (1, 7), (2, 16)]):
            ids, mask = _ids(b, s, f"cuda:{model_device}", i)
            mask[-1, s // 2:] = 0  # padding in the last row
            out = opt(input_ids=ids, attention_mask=mask).last_hidden_state
            assert torch.cuda.current_device() == current  # the caller's device again
            assert out.device == torch.device(f"cuda:{model_device}")
            ref = ref32(input_ids=ids, attention_mask=mask).last_hidden_state
            half = eager(input_ids=ids, attention_mask=mask).last_hidden_state
            err, bound = rel_err(out, ref), 2 * rel_err(half, ref) + 1e-4
            assert err <= bound, (b, s, err, bound)
    report = transfuse.report(opt)
    assert "CUDA graphs: on" in report and "captured 0" not in report, report


def test_model_moved_to_another_gpu_after_its_first_calls():
    ref32 = _bert().cuda(0)
    opt = transfuse.optimize(copy.deepcopy(ref32).half())
    with torch.no_grad():
        ids, mask = _ids(2, 24, "cuda:0", 0)
        for _ in range(3):
            opt(input_ids=ids, attention_mask=mask)
        opt.to("cuda:1")
        ref32.to("cuda:1")
        ids, mask = ids.to("cuda:1"), mask.to("cuda:1")
        for _ in range(3):
            out = opt(input_ids=ids, attention_mask=mask).last_hidden_state
        assert torch.cuda.current_device() == 0
        ref = ref32(input_ids=ids, attention_mask=mask).last_hidden_state
        half = copy.deepcopy(ref32).half()(input_ids=ids, attention_mask=mask).last_hidden_state
    assert out.device == torch.device("cuda:1")
    assert rel_err(out, ref) <= 2 * rel_err(half, ref) + 1e-4


def test_generate_on_another_gpu():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=97, max_position_embeddings=128)
    eager = LlamaForCausalLM(config).to("cuda:1").half().eval()
    opt = transfuse.optimize(copy.deepcopy(eager))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 97, (2, 9), generator=gen).to("cuda:1")
    with torch.no_grad():
        want = eager.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
        for _ in range(2):  # the second call replays the decode loop's graphs
            got = opt.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
            assert torch.cuda.current_device() == 0
            # tokens where eager's top two logits are apart; the logits themselves below
            assert got.shape == want.shape
        logits_opt = opt(got).logits.float()
        logits_eager = eager(got).logits.float()
    assert rel_err(logits_opt, logits_eager) < 2e-2
    agree = (got == want).float().mean().item()
    assert agree >= 0.9, (got, want)
    assert "decode loop" in transfuse.report(opt)


def test_training_step_on_another_gpu():
    from transfuse.bench.nanogpt import GPT, tiny_config

    torch.manual_seed(0)
    fp32 = GPT(tiny_config(n_embd=64, block_size=64)).to("cuda:1").train()
    eager, ours = copy.deepcopy(fp32), copy.deepcopy(fp32)
    transfuse.optimize(ours)  # training graphs (cudagraph trees) by default on a GPU
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 97, (2, 48), generator=gen).to("cuda:1")
    y = x.roll(-1, 1)
    fp32(x, y)[1].backward()
    for model in (eager, ours):
        for _ in range(3):  # the graphs record, then replay
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(x, y)[1].backward()
            assert torch.cuda.current_device() == 0
    for (name, p), e, r in zip(ours.named_parameters(), eager.parameters(), fp32.parameters()):
        assert p.grad is not None and p.grad.device == r.device, name
        err_ours = ((p.grad.float() - r.grad).norm() / r.grad.norm()).item()
        err_eager = ((e.grad.float() - r.grad).norm() / r.grad.norm()).item()
        assert err_ours <= 2 * err_eager + 1e-3, (name, err_ours, err_eager)
    assert "ManualAttention" in transfuse.report(ours)


class _TwoGpus(torch.nn.Module):
    """A user's own pipeline over two GPUs: a layer on each, the activations moved between them."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(32, 48).to("cuda:0")
        self.second = torch.nn.Linear(48, 16).to("cuda:1")

    def forward(self, x):
        return self.second(torch.nn.functional.gelu(self.first(x)).to("cuda:1"))


def test_model_split_across_gpus_runs_as_it_was():
    torch.manual_seed(0)
    model = _TwoGpus()
    opt = transfuse.optimize(copy.deepcopy(model))
    x = torch.randn(4, 32, device="cuda:0")
    with torch.no_grad():
        got, want = opt(x), model(x)
    assert torch.equal(got, want)  # the model's own kernels: the same bits
    report = transfuse.report(opt)
    assert "left to eager" in report and "2 devices (cuda:0, cuda:1)" in report, report
