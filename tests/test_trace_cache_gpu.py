"""The trace cache on the GPU: a fresh process loads the trace another process saved, and serves
several shapes (buckets, CUDA graphs) with eager's outputs for its own weights."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent("""
    import sys, torch, transfuse
    from transformers import BertConfig, BertModel
    torch.manual_seed(int(sys.argv[1]))  # each process its own weights
    config = BertConfig(hidden_size=256, num_hidden_layers=3, num_attention_heads=4, intermediate_size=1024,
                        attn_implementation="sdpa")
    model32 = BertModel(config).cuda().eval()
    model16 = BertModel(config).cuda().half().eval()
    model16.load_state_dict(model32.state_dict())
    eager16 = BertModel(config).cuda().half().eval()
    eager16.load_state_dict(model32.state_dict())
    transfuse.optimize(model16, trace_cache=True)
    worst = 0.0
    with torch.inference_mode():
        for batch, seq in [(8, 128), (1, 16), (3, 77), (8, 128), (2, 300)]:
            ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")
            mask = torch.ones(batch, seq, dtype=torch.long, device="cuda")
            mask[-1, seq // 2:] = 0
            ref = model32(input_ids=ids, attention_mask=mask).last_hidden_state
            out = model16(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            base = eager16(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            keep = mask.bool()
            err = ((out - ref)[keep].norm() / ref[keep].norm()).item()
            err_eager = ((base - ref)[keep].norm() / ref[keep].norm()).item()
            worst = max(worst, err / (2 * err_eager + 1e-4))
    print("WORST", worst)
    print("STATUS", model16._transfuse_state.trace_cache.describe())
""")


def _run(seed: int, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(seed)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("WORST", "STATUS")))


def test_a_fresh_process_loads_the_saved_trace_on_the_gpu(tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRANSFUSE_CACHE_DIR=str(tmp_path), PYTHONPATH=f"{root / 'src'}{os.pathsep}{root}")
    first = _run(0, env)
    assert "traced in" in first["STATUS"] and "5 call(s) served" in first["STATUS"], first["STATUS"]
    assert float(first["WORST"]) <= 1.0
    second = _run(1, env)
    assert "loaded" in second["STATUS"] and "5 call(s) served, 0 refused" in second["STATUS"], second["STATUS"]
    assert float(second["WORST"]) <= 1.0  # within twice eager fp16's error of fp32 (+1e-4)
