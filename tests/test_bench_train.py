"""`transfuse bench --train` on CPU at the tiny geometry, and the nanoGPT-style model it trains.

Smoke tests only: no timing is checked (GPU figures come from `transfuse bench --train` on the device)."""

import math

import pytest
import torch

from transfuse import bench
from transfuse.bench import nanogpt, train

pytest.importorskip("transformers")


def test_train_bench_runs_on_cpu(capsys):
    """Both archs, eager and SDPA, one iteration each: rows without errors, finite losses that agree
    between the two attention paths (same weights, data and seed), and the table printed."""
    args = bench.build_parser("train").parse_args(
        ["--model", "train", "--geometry", "tiny", "--providers", "eager,sdpa", "--iters", "1", "--warmup", "0",
         "--no-save", "--device", "cpu"])
    results = train.run(args)
    rows = {(r["arch"], r["provider"]): r for r in results["rows"]}
    assert list(rows) == [("nanogpt", "eager"), ("nanogpt", "sdpa"), ("hf", "eager"), ("hf", "sdpa")]
    for row in rows.values():
        assert "error" not in row, row
        assert row["ms_per_iter"] > 0 and row["tokens_per_s"] > 0 and math.isfinite(row["final_loss"])
        assert row["optimizer"] in ("fused", "foreach")
    # Random tokens from a 97-token vocabulary: a barely trained model's loss is near ln(97).
    assert abs(rows["nanogpt", "eager"]["final_loss"] - math.log(97)) < 0.5
    # nanoGPT's dropout is 0, so the paths differ by bf16 rounding only; HF's 0.1 dropout draws
    # different masks in its eager and SDPA attention, hence the looser bound.
    assert rows["nanogpt", "sdpa"]["final_loss"] == pytest.approx(rows["nanogpt", "eager"]["final_loss"], abs=2e-2)
    assert rows["hf", "sdpa"]["final_loss"] == pytest.approx(rows["hf", "eager"]["final_loss"], abs=0.2)
    train.write_and_print(results, args)
    text = capsys.readouterr().out
    assert "| nanogpt | eager |" in text and "| hf | sdpa |" in text


def test_train_bench_alias_and_error_rows(monkeypatch, capsys):
    """`--train` selects the benchmark; a provider that raises gets a one-line error row and the
    next provider still runs."""
    monkeypatch.setitem(train.PROVIDERS, "broken", train.Provider(sdpa=False, pad=False, wrap="no-such-wrapper"))
    argv = ["--train", "--arch", "nanogpt", "--geometry", "tiny", "--providers", "broken,eager", "--iters", "1",
            "--warmup", "1", "--no-save", "--device", "cpu"]
    assert bench.main(argv) == 0
    text = capsys.readouterr().out
    assert "| nanogpt | broken | ValueError: provider 'broken': unknown wrapper 'no-such-wrapper' |" in text
    assert "| nanogpt | eager | " in text


def test_nanogpt_manual_and_sdpa_attention_agree():
    """The hand-written attention and F.scaled_dot_product_attention give the same loss and gradients
    (fp32, no dropout), and switching drops or restores the mask buffer."""
    torch.manual_seed(0)
    model = nanogpt.GPT(nanogpt.tiny_config())
    idx = torch.randint(0, 97, (2, 24))
    targets = torch.randint(0, 97, (2, 24))
    targets[0, :3] = -1  # ignored positions

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        logits, loss = model(idx, targets)
        loss.backward()
        return logits, loss.detach(), [p.grad.clone() for p in model.parameters()]

    assert all("bias" in blk.attn._buffers for blk in model.transformer.h)
    logits, manual, manual_grads = loss_and_grads()
    assert logits.shape == (2, 24, 97)
    nanogpt.set_attention(model, sdpa=True)
    assert not any("bias" in blk.attn._buffers for blk in model.transformer.h)
    _, fused, fused_grads = loss_and_grads()
    torch.testing.assert_close(fused, manual, rtol=1e-5, atol=1e-5)
    for a, b in zip(fused_grads, manual_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    nanogpt.set_attention(model, sdpa=False)
    _, again, _ = loss_and_grads()
    torch.testing.assert_close(again, manual)
    last, none = model(idx)  # no targets: the last position's scores only
    assert last.shape == (2, 1, 97) and none is None


def test_nanogpt_pad_vocab_keeps_rows_and_tying():
    torch.manual_seed(0)
    model = nanogpt.GPT(nanogpt.tiny_config())
    before = model.lm_head.weight.detach().clone()
    nanogpt.pad_vocab(model, 64)
    assert model.lm_head.weight.shape == (128, 64) and model.config.vocab_size == 128
    assert model.transformer.wte.weight is model.lm_head.weight
    torch.testing.assert_close(model.lm_head.weight[:97].detach(), before)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in set(model.parameters()))


def test_largest_batch_search_and_flops():
    limit = 37
    calls = []

    def fits(b):
        calls.append(b)
        return b <= limit

    assert train.largest_batch(fits, 8, 1024) == (37, False)
    assert calls[:4] == [8, 16, 32, 64]  # doubling, then bisection between 32 and 64
    assert train.largest_batch(lambda b: True, 8, 100) == (100, True)
    assert train.largest_batch(lambda b: b <= 3, 8, 100) == (3, False)
    assert train.largest_batch(lambda b: False, 8, 100) == (0, False)
    assert train.is_oom(RuntimeError("wrapped", )) is False
    err = RuntimeError("compile failed")
    err.__cause__ = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert train.is_oom(err)
    # GPT-2 124M at 8 x 1024: 6 x (123.5M dense + 9.4M causal attention) FLOPs a token, 6.5 TFLOP
    assert train.train_flops("gpt2-124m", 8, 1024) == pytest.approx(6.536e12, rel=1e-3)
