"""bert-base fp16 at 1x128 through optimize() in one process: median latency of 200 calls (CUDA events)
and the GEMM dispatch choices it used (loaded from the on-disk tuning cache or measured afresh),
with a digest so that several processes can be compared.

    for i in 1 2; do PYTHONPATH=src python3 bench/gemm_choices_across_processes.py $i; done
    TRANSFUSE_CACHE_DIR=/tmp/fresh PYTHONPATH=src python3 bench/gemm_choices_across_processes.py 3
"""
import hashlib
import sys

import torch
from transformers import BertConfig, BertModel

import transfuse
from transfuse.bench.timing import measure
from transfuse.ops.gemm import gemm_choices

torch.manual_seed(0)
model = BertModel(BertConfig(attn_implementation="sdpa")).eval().cuda().half()
opt = transfuse.optimize(model)
ids = torch.randint(0, 30522, (1, 128), device="cuda")
with torch.inference_mode():
    timing = measure(opt, [dict(input_ids=ids, attention_mask=torch.ones_like(ids))], warmup=10, iters=200)
lines = []
for k, c in sorted(gemm_choices().items(), key=str):
    backend = c.backend + (f"/sk{c.split_k}" if c.backend == "triton" else "")
    times = " ".join(f"{n}={t * 1000:.1f}us" for n, t in c.times_ms.items())
    lines.append(f"  {k.m_bucket}x{k.n}x{k.k} {k.activation} res={k.has_residual}: {backend} {times}")
digest = hashlib.md5("\n".join(lines).encode()).hexdigest()[:10]
print(f"proc {sys.argv[1]}: 1x128 median {timing.median_ms:.3f} ms, p10 {timing.p10_ms:.3f}; "
      f"{len(lines)} GEMM choices, digest {digest}")
if sys.argv[1] == "1":
    print("\n".join(lines))
