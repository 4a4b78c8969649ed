"""Host time of one transfuse bert-base call (fp16, 1x128): median enqueue time, then a cProfile of 500
steady-state calls. Dev tool: PYTHONPATH=src python3 bench/profile_encoder_host.py"""
import cProfile, io, pstats, statistics, time
import torch
from transformers import BertConfig, BertModel
import transfuse
torch.manual_seed(0)
model = BertModel(BertConfig(attn_implementation="sdpa")).cuda().half().eval()
model = transfuse.optimize(model)
ids = torch.randint(0, 30000, (1, 128), device="cuda")
mask = torch.ones_like(ids)
with torch.inference_mode():
    for _ in range(20):
        model(input_ids=ids, attention_mask=mask)
    torch.cuda.synchronize()
    ts = []
    for _ in range(200):
        torch.cuda.synchronize(); t = time.perf_counter(); model(input_ids=ids, attention_mask=mask); ts.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    print(f"host enqueue median {statistics.median(ts):.3f} ms")
    pr = cProfile.Profile(); pr.enable()
    for _ in range(500):
        model(input_ids=ids, attention_mask=mask)
    torch.cuda.synchronize(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(40); print(s.getvalue())
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); print(s.getvalue())
