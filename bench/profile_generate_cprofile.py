"""Wall time of generate(1) and generate(128) (llama-1.1b, batch 1, 32-token prompt), then a cProfile of
ten generate(1) calls by cumulative and own time. Dev tool: PYTHONPATH=src python3 bench/profile_generate_cprofile.py"""
import cProfile, pstats, statistics, sys, time, io
sys.path.insert(0, "bench")
import torch
from profile_step_replay import optimized_generate_setup
model, ids, gen = optimized_generate_setup()
with torch.inference_mode():
    for n in (1, 1, 1, 128, 128):
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen)
    for n in (1, 128):
        walls = []
        for _ in range(10):
            torch.cuda.synchronize(); t = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen)
            torch.cuda.synchronize(); walls.append((time.perf_counter() - t) * 1e3)
        print(f"generate({n}) wall median {statistics.median(walls):.3f} ms")
    # host-only time of generate(1): GPU made idle first, host time to return
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu = []
    for _ in range(10):
        torch.cuda.synchronize()
        ev0.record(); model.generate(ids, max_new_tokens=1, min_new_tokens=1, **gen); ev1.record(); torch.cuda.synchronize()
        gpu.append(ev0.elapsed_time(ev1))
    print(f"generate(1) events median {statistics.median(gpu):.3f} ms")
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    for _ in range(10):
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **gen)
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
    print(s.getvalue())
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue())
