"""Where the first call's seconds go: cProfile of one transfuse call in a fresh process.

    PYTHONPATH=src python3 bench/profile_first_call.py [batch seq [all|pattern]]   (run twice: cold, then warm caches)
"""

import cProfile
import pstats
import sys
import time

import torch
from transformers import BertConfig, BertModel

import transfuse

batch, seq = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (8, 128)
torch.manual_seed(0)
model = BertModel(BertConfig()).cuda().half().eval()
inputs = {"input_ids": torch.randint(0, 30522, (batch, seq), device="cuda"),
          "attention_mask": torch.ones(batch, seq, dtype=torch.long, device="cuda")}
transfuse.optimize(model)
torch.cuda.synchronize()
profile = cProfile.Profile()
start = time.perf_counter()
with torch.inference_mode():
    profile.runcall(model, **inputs)
torch.cuda.synchronize()
print(f"first call {time.perf_counter() - start:.2f} s")
stats = pstats.Stats(profile).sort_stats("cumulative")
if len(sys.argv) > 3 and sys.argv[3] == "all":  # the whole picture: top cumulative, then top own time
    stats.print_stats(70)
    stats.sort_stats("tottime").print_stats(40)
    sys.exit(0)
pattern = sys.argv[3] if len(sys.argv) > 3 else (
    r"convert_frame.py.*\((_compile|compile_inner|_fullgraph_capture_frame)\)|backend.py.*(__call__|compiled)"
    r"|cuda_graphs.py|buckets.py.*(__call__|_capture)|ops/gemm.py.*(_measure|_choose|_disk_path)"
    r"|jit.py.*(_do_compile|run)|autotuner.py.*run|compiler.py.*(compile|_init_handles)|symbolic_convert.py.*\(run\)"
    r"|guards.py.*(__init__|build_guards)|passes/.*run|padding.py.*plan_padding")
stats.print_stats(pattern, 40)
