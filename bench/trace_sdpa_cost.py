"""Fake-tensor seconds that Dynamo spends on bert-base's SDPA calls in one trace, three ways: SDPA as
it is, math-only SDPA (tracing_sdpa's switch), and transfuse's stand-in op (tracing_sdpa._TRACED).
No transfuse backend: a backend that runs the graph as traced, so only the trace is measured.

    PYTHONPATH=src python3 bench/trace_sdpa_cost.py as-is|math|stand-in [--device cpu|cuda]

One mode per process (a fresh Dynamo); prints the first call's seconds and get_fake_value's seconds
over every node and over the SDPA nodes.
"""

import argparse
import contextlib
import time

import torch
import torch._dynamo.utils as dynamo_utils
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import BertConfig, BertModel

from transfuse import tracing_sdpa


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["as-is", "math", "stand-in"])
    parser.add_argument("--device", default="cpu")
    cli = parser.parse_args()
    model = BertModel(BertConfig(attn_implementation="sdpa")).eval().to(cli.device)
    ids = torch.randint(0, 1000, (2, 16), device=cli.device)
    seconds = {"sdpa": 0.0, "all": 0.0}
    real = dynamo_utils.get_fake_value

    def timed(node, tx, allow_non_graph_fake=False):
        start = time.perf_counter()
        try:
            return real(node, tx, allow_non_graph_fake)
        finally:
            spent = time.perf_counter() - start
            seconds["all"] += spent
            if "sdpa" in str(node.target) or "scaled_dot" in str(node.target):
                seconds["sdpa"] += spent

    import torch._dynamo.variables.builder as builder
    import torch._dynamo.variables.torch as torch_variables
    for module in (dynamo_utils, builder, torch_variables):
        if hasattr(module, "get_fake_value"):
            module.get_fake_value = timed

    def backend(gm, example_inputs):
        tracing_sdpa.untrace(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend, dynamic=True)
    ctx = sdpa_kernel(SDPBackend.MATH) if cli.mode == "math" else contextlib.nullcontext()
    original = F.scaled_dot_product_attention
    if cli.mode == "stand-in":
        F.scaled_dot_product_attention = tracing_sdpa._TRACED
    start = time.perf_counter()
    try:
        with torch.inference_mode(), ctx:
            compiled(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        F.scaled_dot_product_attention = original
    print(f"{cli.mode}: first call {time.perf_counter() - start:.2f} s, get_fake_value {seconds['all']:.3f} s, "
          f"of it SDPA nodes {seconds['sdpa']:.3f} s ({torch.__version__}, {cli.device})")


if __name__ == "__main__":
    main()
