"""Host time by function in generate(max_new_tokens=1) (llama-1.1b, batch 1, 32-token prompt), and the
CUDA calls that make the host wait. Dev tool: PYTHONPATH=src python3 bench/profile_generate_host.py"""
import collections, functools, statistics, sys, time
sys.path.insert(0, "bench")
import torch
from torch.profiler import ProfilerActivity, profile
from transfuse.runtime import decode_loop
from transformers.generation import utils as gu
from profile_step_replay import optimized_generate_setup

model, ids, gen = optimized_generate_setup()
acc = collections.defaultdict(list)

def timed(owner, name, label):
    orig = getattr(owner, name)
    @functools.wraps(orig)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            acc[label].append((time.perf_counter() - t) * 1e3)
    setattr(owner, name, wrapper)

timed(gu.GenerationMixin, "_prepare_generation_config", "hf _prepare_generation_config")
timed(gu.GenerationMixin, "_prepare_cache_for_generation", "hf _prepare_cache_for_generation")
timed(gu.GenerationMixin, "_prefill", "hf _prefill (launch)")
timed(gu.GenerationMixin, "_get_logits_processor", "hf _get_logits_processor")
timed(gu.GenerationMixin, "_prepare_special_tokens", "hf _prepare_special_tokens")
timed(decode_loop.DecodeLoop, "_reset", "transfuse _reset")
timed(decode_loop.DecodeLoop, "_generate", "transfuse _generate (all)")
with torch.inference_mode():
    for n in (1, 1, 1, 128, 128):
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen)
    acc.clear()
    walls = []
    for _ in range(20):
        torch.cuda.synchronize(); t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **gen)
        torch.cuda.synchronize(); walls.append((time.perf_counter() - t) * 1e3)
    print(f"generate(1) wall median {statistics.median(walls):.3f} ms")
    for k, v in sorted(acc.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"  {k:<40} {statistics.median(v):.3f} ms")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **gen)
        torch.cuda.synchronize()
    for e in prof.events():
        if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaMemcpy", "aten::_local_scalar_dense", "cudaEventSynchronize") and e.cpu_time_total > 50:
            stack = list(e.stack or [])[:8]
            print(f"{e.name} {e.cpu_time_total:.0f} us <- " + " | ".join(stack))
