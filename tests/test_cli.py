"""The `transfuse` command, the bench harness's arithmetic and formatting, and the CPU demo.

Fast CPU tests: no GPU numbers are checked here (those come from `transfuse bench` on the device)."""

import argparse
import json
import math
import types

import pytest
import torch

from transfuse import bench, cli
from transfuse.bench import encoder, floor, report, timing

BERT_BASE = types.SimpleNamespace(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                  intermediate_size=3072, vocab_size=30522, max_position_embeddings=512,
                                  type_vocab_size=2)
TINY = types.SimpleNamespace(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,  # 768, 12, 12
                             intermediate_size=128, vocab_size=100, max_position_embeddings=512,  # 3072, 30522
                             type_vocab_size=2)


# --- argument parsing ----------------------------------------------------------------------------

def test_parse_shapes():
    assert bench.parse_shapes("1x16, 8X128,") == [(1, 16), (8, 128)]
    for bad in ["8", "8x", "0x16", "axb", "1x2x3", ""]:
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_shapes(bad)


def test_bench_defaults_and_overrides():
    parser = bench.build_parser("encoder")
    args = parser.parse_args([])
    assert args.shapes == [(1, 16), (1, 128), (1, 512), (8, 128), (8, 512), (32, 128), (32, 512)]
    assert args.providers == ["eager", "compile", "compile-ro", "transfuse"]
    assert (args.dtype, args.attn, args.out, args.model) == ("fp16", "sdpa", "bench/results", "encoder")
    assert args.iters >= 50
    args = parser.parse_args(["--shapes", "2x64", "--providers", "eager,transfuse", "--dtype", "bf16",
                              "--attn", "eager", "--iters", "60", "--out", "/tmp/x"])
    assert (args.shapes, args.providers, args.dtype, args.attn, args.iters, args.out) == (
        [(2, 64)], ["eager", "transfuse"], "bf16", "eager", 60, "/tmp/x")
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "fp8"])


@pytest.mark.parametrize("argv, expect", [
    (["bench", "--help"], "--providers"),
    (["demo", "--help"], "--cpu"),
    (["--help"], "bench"),
])
def test_help(argv, expect, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 0
    assert expect in capsys.readouterr().out


def test_unknown_benchmark():
    with pytest.raises(SystemExit, match="unknown benchmark"):
        bench.main(["--model", "no-such-model"])


def test_interpreter_reexec_when_kernels_came_first(monkeypatch):
    calls = []
    monkeypatch.setattr(cli.os, "execv", lambda exe, argv: calls.append(argv))
    monkeypatch.delenv(cli._REEXEC_MARK, raising=False)
    monkeypatch.setitem(cli.sys.modules, "transfuse.kernels._config", types.SimpleNamespace(INTERPRET=False))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    cli._use_interpreter(["demo", "--cpu"])
    assert cli.os.environ["TRITON_INTERPRET"] == "1"
    assert calls and calls[0][-3:] == ["transfuse", "demo", "--cpu"]
    monkeypatch.setitem(cli.sys.modules, "transfuse.kernels._config", types.SimpleNamespace(INTERPRET=True))
    calls.clear()
    cli._use_interpreter(["demo"])
    assert not calls


# --- floor formulas ------------------------------------------------------------------------------

def test_param_count_matches_bert_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(**{k: getattr(TINY, k) for k in vars(TINY)})
    model = transformers.BertModel(config)
    counts = floor.encoder_param_count(config)
    assert sum(counts.values()) == sum(p.numel() for p in model.parameters())
    assert counts["layers"] == sum(p.numel() for p in model.encoder.parameters())
    assert counts["pooler"] == sum(p.numel() for p in model.pooler.parameters())


def test_bert_base_numbers():
    assert sum(floor.encoder_param_count(BERT_BASE).values()) == 109_482_240  # bert-base-uncased's size
    # (1, 128): linear 2*128*12*(4*768^2 + 2*768*3072) + attention 4*1*12*128^2*64*12 + pooler 2*768^2
    assert floor.encoder_flops(BERT_BASE, 1, 128) == 21_743_271_936 + 603_979_776 + 1_179_648
    # attention grows with S^2, the rest with B*S
    f = lambda b, s: floor.encoder_flops(BERT_BASE, b, s, with_pooler=False)  # noqa: E731
    assert f(1, 256) - 2 * f(1, 128) == 4 * 12 * 64 * 12 * (256**2 - 2 * 128**2)
    assert f(8, 128) == 8 * f(1, 128)


def test_min_bytes_by_hand():
    b, s, h, elt = 3, 5, 64, 2
    layer = 4 * (h * h + h) + (h * 128 + 128) + (128 * h + h) + 4 * h
    weights = 2 * layer + (h * h + h) + 2 * h  # layers, pooler, embedding norm
    gathered = b * s * h + s * h + h  # word rows, position rows, one token-type row
    outputs = b * s * h + b * h
    expected = (weights + gathered + outputs) * elt + 2 * b * s * 8
    assert floor.encoder_min_bytes(TINY, b, s, elt) == expected
    assert floor.encoder_min_bytes(TINY, b, s, elt, with_mask=False) == expected - b * s * 8


def test_floor_ms_takes_the_larger_bound():
    assert floor.floor_ms(2e12, 1e6, 1000.0, 1000.0) == pytest.approx(2.0)  # compute: 2e12 / 1e15 s
    assert floor.floor_ms(1e6, 3e9, 1000.0, 1000.0) == pytest.approx(3.0)  # memory: 3e9 / 1e12 s


# --- timing --------------------------------------------------------------------------------------

def test_percentiles_match_numpy():
    np = pytest.importorskip("numpy")
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    t = timing.summarize(values)
    assert (t.median_ms, t.p10_ms, t.p90_ms, t.n) == pytest.approx(
        (np.median(values), np.percentile(values, 10), np.percentile(values, 90), 6))


def test_measure_warms_up_and_rotates():
    seen = []
    t = timing.measure(lambda x: seen.append(x), [(0,), (1,), (2,)], warmup=2, iters=7, cuda=False)
    assert t.n == 7
    assert seen == [0, 1] + [i % 3 for i in range(7)]
    seconds, out = timing.time_first_call(lambda **kw: kw["a"] + 1, {"a": 1}, cuda=False)
    assert out == 2 and seconds >= 0


# --- report formatting ---------------------------------------------------------------------------

def _fake_results():
    rows = []
    for shape, ms in [("1x16", {"eager": 4.0, "compile": 2.0, "compile-ro": 1.0, "transfuse": 0.5}),
                      ("8x512", {"eager": 20.0, "compile": 10.0, "compile-ro": 8.0, "transfuse": None})]:
        entries = {}
        for p, m in ms.items():
            entries[p] = ({"median_ms": m, "p10_ms": m * 0.9, "p90_ms": m * 1.1, "n": 50, "first_call_s": 1.5,
                           "rel_err": 1e-3, "error": None} if m is not None
                          else {"error": "RuntimeError: boom", "first_call_s": 0.2})
        row = {"shape": shape, "floor_ms": 0.25, "providers": entries}
        encoder._speedups(row)
        rows.append(row)
    return {
        "benchmark": "encoder", "title": "fake",
        "environment": {"date": "2025-01-02", "gpu": "NVIDIA H100 80GB HBM3", "gpu_slug": report.slugify("NVIDIA H100 80GB HBM3"),
                        "torch": "2.11", "cuda": "12.8", "triton": "3.6", "transformers": "5.0", "python": "3.12"},
        "config": {"dtype": "fp16", "shapes": ["1x16", "8x512"]},
        "ceilings": {"matmul_tflops": 700.0, "copy_gbps": 3000.0},
        "providers": ["eager", "compile", "compile-ro", "transfuse"], "target": "transfuse",
        "headline_baselines": ["compile-ro", "eager"], "rows": rows,
    }


def test_markdown_table():
    results = _fake_results()
    assert results["rows"][0]["providers"]["transfuse"]["speedup"] == {
        "eager": 8.0, "compile": 4.0, "compile-ro": 2.0, "transfuse": 1.0}
    table = report.markdown_table(results)
    lines = table.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["shape", "eager ms", "compile ms", "compile-ro ms", "transfuse ms", "transfuse vs compile-ro",
                      "transfuse vs eager", "transfuse rel err", "eager rel err", "floor ms"]
    first = [c.strip() for c in lines[2].strip("|").split("|")]
    assert first == ["1x16", "4.00", "2.00", "1.00", "0.500", "2.00x", "8.00x", "1.0e-03", "1.0e-03", "0.250"]
    second = [c.strip() for c in lines[3].strip("|").split("|")]
    assert second[4] == "error[1]" and second[5] == "-"
    assert "[1] transfuse: RuntimeError: boom" in table
    assert "error" in report.details_table(results)


def test_write_outputs(tmp_path):
    results = _fake_results()
    assert report.result_stem(results) == "2025-01-02-nvidia-h100-80gb-hbm3-encoder"
    paths = report.write_outputs(results, tmp_path)
    assert json.loads(paths["json"].read_text())["rows"][1]["providers"]["transfuse"]["error"] == "RuntimeError: boom"
    assert "| shape |" in paths["md"].read_text()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "png" not in paths
    else:
        assert paths["png"].stat().st_size > 0


# --- the encoder benchmark and the demo on CPU ---------------------------------------------------

def test_encoder_runs_on_cpu_and_records_failures(tmp_path, monkeypatch):
    pytest.importorskip("transformers")

    def broken(model, args):
        raise RuntimeError("provider setup exploded")

    monkeypatch.setitem(encoder.PROVIDERS, "broken", broken)
    args = bench.build_parser("encoder").parse_args(
        ["--device", "cpu", "--config", "tiny", "--dtype", "bf16", "--providers", "eager,broken",
         "--shapes", "2x8", "--iters", "3", "--warmup", "1", "--pad", "0.5", "--out", str(tmp_path), "--no-progress"])
    results = encoder.run(args)
    (row,) = results["rows"]
    eager = row["providers"]["eager"]
    assert eager["error"] is None and eager["n"] == 3
    assert 0 < eager["rel_err"] < 3e-2  # bf16 vs the fp32 copy
    assert row["providers"]["broken"]["error"] == "setup: RuntimeError: provider setup exploded"
    assert list(tmp_path.glob("*-cpu-encoder.json"))  # checkpointed after each provider


# The benchmarks' harness is under test here, not their models (the model tests cover those): their
# CPU geometry is made one layer of hidden 32, 2 heads of 16, so that each generate() runs a few
# interpreted kernels instead of tens.
_ONE_LAYER = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=48)


def test_decoder_bench_runs_on_cpu(tmp_path, capsys, monkeypatch):
    """`transfuse bench --model llama-1.1b` at the tiny geometry: every provider generates, the
    tables print, a prompt past the positions is reported as skipped, results are written."""
    from transfuse.bench import decoder

    config_cls, config = decoder.GEOMETRIES["tiny"]
    monkeypatch.setitem(decoder.GEOMETRIES, "tiny", (config_cls, {**config, **_ONE_LAYER}))
    argv = ["--model", "decoder-tiny", "--device", "cpu", "--dtype", "fp32", "--providers", "eager,transfuse",
            "--batches", "2", "--prompt", "4", "--new-tokens", "3", "--ttft-prompts", "8,500", "--iters", "1", "--warmup", "0",
            "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    text = capsys.readouterr().out
    assert "| transfuse | 2 |" in text and "beyond the model's 128 positions" in text
    (path,) = tmp_path.glob("*-cpu-tiny.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["provider"] for r in rows] == ["eager", "transfuse"] and not any("error" in r for r in rows)
    model = decoder.make_model("tiny")
    # untied head: the input table is read a row at a time, the output head whole
    weights = sum(p.numel() * 4 for p in model.parameters()) - model.get_input_embeddings().weight.numel() * 4
    assert decoder.step_bytes(model, 1, 0) == weights


def test_errors_ignore_padding():
    ref = torch.randn(2, 4, 8)
    out = ref.clone()
    out[1, 3] += 100.0  # a padded position
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    assert encoder.errors_vs(out, ref, mask) == (0.0, 0.0)
    out[0, 0, 0] += 1.0
    rel, mx = encoder.errors_vs(out, ref, mask)
    assert mx == pytest.approx(1.0) and rel == pytest.approx(1.0 / ref.masked_fill(mask[..., None] == 0, 0).norm().item())


def test_demo_on_cpu(capsys):
    import transfuse

    if not hasattr(transfuse, "optimize"):
        pytest.skip("transfuse.optimize() is not written yet")
    if not torch.cuda.is_available():
        import os

        assert os.environ.get("TRITON_INTERPRET") == "1", "conftest sets the interpreter on CPU"
    from transfuse import demo

    rc = demo.run_cpu()
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    assert "max abs error vs eager" in out.out
    assert math.isfinite(float(out.out.split("max abs error vs eager: ")[1].split()[0]))


def test_seq2seq_bench_runs_on_cpu(tmp_path, capsys, monkeypatch):
    """`transfuse bench --model t5-base` at the tiny geometry: greedy and beam search for each
    provider, transfuse's tokens equal eager's (fp32), the error columns, results written."""
    from transfuse.bench import seq2seq

    config_cls, config = seq2seq.GEOMETRIES["tiny"]
    monkeypatch.setitem(seq2seq.GEOMETRIES, "tiny", (config_cls, {**config, "num_layers": 1, "num_decoder_layers": 1,
                                                                   "d_model": 32, "d_ff": 48, "num_heads": 2}))
    # batch 1: the harness is under test (beam2 still runs two decoder rows); a batch of 2 cost 8 s more
    argv = ["--model", "seq2seq-tiny", "--device", "cpu", "--dtype", "fp32", "--providers", "eager,transfuse",
            "--batches", "1", "--searches", "greedy,beam2", "--input", "5", "--new-tokens", "2", "--iters", "1", "--warmup", "0",
            "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    text = capsys.readouterr().out
    assert "| transfuse | greedy | 1 |" in text and "| transfuse | beam2 | 1 |" in text
    (path,) = tmp_path.glob("*-cpu-tiny.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["provider"] for r in rows] == ["eager", "transfuse"] and not any("error" in r for r in rows)
    assert all(p["tokens_equal"] == 1.0 for r in rows for p in r["points"])
    greedy = [p for r in rows for p in r["points"] if p["search"] == "greedy"]
    # fp32 providers against the fp32 reference: the same argmax everywhere, a rounding-size error
    assert all(p["argmax_equal_fp32"] == 1.0 and 0 <= p["logits_rel_err"] < 1e-4 for p in greedy), greedy
