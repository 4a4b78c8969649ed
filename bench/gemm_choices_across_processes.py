"""bert-base fp16 at 1x128 through optimize() in one process: median latency of 200 calls (CUDA events)
and the GEMM dispatch choices it used (loaded from the on-disk tuning cache or measured afresh),
with a digest so that several processes can be compared.

    for i in 1 2; do PYTHONPATH=src python3 bench/gemm_choices_across_processes.py $i; done
    TRANSFUSE_CACHE_DIR=/tmp/fresh PYTHONPATH=src python3 bench/gemm_choices_across_processes.py 3
"""
import statistics, sys, torch, transfuse
from transformers import BertConfig, BertModel
from transfuse.ops.gemm import gemm_choices
torch.manual_seed(0)
model = BertModel(BertConfig(attn_implementation="sdpa")).eval().cuda().half()
opt = transfuse.optimize(model)
ids = torch.randint(0, 30522, (1, 128), device="cuda"); mask = torch.ones_like(ids)
with torch.inference_mode():
    for _ in range(10):
        opt(input_ids=ids, attention_mask=mask)
    ts = []
    for _ in range(200):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); a.record(); opt(input_ids=ids, attention_mask=mask); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
import hashlib
lines = []
for k, c in sorted(gemm_choices().items(), key=str):
    lines.append(f"  {k.m_bucket}x{k.n}x{k.k} {k.activation} res={k.has_residual}: {c.backend}{'/sk' + str(c.split_k) if c.backend == 'triton' else ''} "
          + " ".join(f"{n}={t * 1000:.1f}us" for n, t in c.times_ms.items()))
print(f"proc {sys.argv[1]}: 1x128 median {statistics.median(ts):.3f} ms, p10 {sorted(ts)[20]:.3f}; {len(lines)} GEMM choices, digest "
      f"{hashlib.md5(chr(10).join(lines).encode()).hexdigest()[:10]}")
if sys.argv[1] == "1":
    print("\n".join(lines))
