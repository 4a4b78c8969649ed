"""One decode step's kernels in order (llama-1.1b), the ones outside the layers named with their
durations and gaps, the layers' counted; after the tok/s of generate(128).
Dev tool: PYTHONPATH=src python3 bench/profile_step_kernels.py [batch]"""
import collections, statistics, sys, time
sys.path.insert(0, "bench")
import torch
from torch.profiler import ProfilerActivity, profile
import transfuse
from profile_step_replay import build

torch.manual_seed(0)
model, prompt = build("llama-1.1b")
transfuse.optimize(model)
batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
ids = torch.randint(3, model.config.vocab_size, (batch, prompt), device="cuda")
gen = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
with torch.inference_mode():
    for n in (8, 8, 128):
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen)
    ts = []
    for _ in range(5):
        torch.cuda.synchronize(); t = time.perf_counter()
        model.generate(ids, max_new_tokens=128, min_new_tokens=128, **gen)
        torch.cuda.synchronize(); ts.append((time.perf_counter() - t) * 1e3)
    print(f"generate(128) batch {batch}: {statistics.median(ts):.2f} ms, {128 * batch / statistics.median(ts) * 1e3:.0f} tok/s")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **gen)
        torch.cuda.synchronize()
kern = sorted([e for e in prof.events() if e.device_type.name == "CUDA"], key=lambda e: e.time_range.start)
marks = [i for i, e in enumerate(kern) if "decode_step" in e.name]
a, b = marks[3], marks[4]
step = kern[a + 1: b + 1]
span = step[-1].time_range.end - kern[a].time_range.end
busy = sum(e.time_range.end - e.time_range.start for e in step)
print(f"one step: {len(step)} kernels, span {span:.1f} us, kernel time {busy:.1f} us")
# By kernel name over the step: calls, total time, and the idle time before them (launch gaps).
rows = collections.defaultdict(lambda: [0, 0.0, 0.0])
prev_end = kern[a].time_range.end
for e in step:
    row = rows[e.name[:70]]
    row[0] += 1
    row[1] += e.time_range.end - e.time_range.start
    row[2] += e.time_range.start - prev_end
    prev_end = e.time_range.end
print(f"{'calls':>5} {'total us':>9} {'mean us':>8} {'gaps us':>8}  kernel")
for name, (n, tot, gaps) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
    print(f"{n:5d} {tot:9.1f} {tot / n:8.2f} {gaps:8.1f}  {name}")
print(f"total gaps {span - busy:.1f} us")
# The second layer in order (its kernels sit between the first and second attention launches' successors).
attn = [i for i, e in enumerate(step) if "_attention_fwd" in e.name or "attention_decode" in e.name]
if len(attn) >= 3:
    print("one layer in order:")
    prev_end = step[attn[0]].time_range.end
    for e in step[attn[0] + 1: attn[1] + 1]:
        print(f"  {e.time_range.end - e.time_range.start:7.2f} us  (gap {e.time_range.start - prev_end:5.2f})  {e.name[:80]}")
        prev_end = e.time_range.end
