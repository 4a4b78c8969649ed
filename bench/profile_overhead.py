"""Where the time of one optimized bert-base call goes at small shapes: the whole call, the host
work before the GPU starts, and the CUDA-graph replay alone. Dev tool: PYTHONPATH=src python3 bench/profile_overhead.py"""

import cProfile
import io
import pstats
import statistics
import time

import torch
from transformers import BertConfig, BertModel

import transfuse


def events(fn, n=100):
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    torch.manual_seed(0)
    model = BertModel(BertConfig()).cuda().half().eval()
    model = transfuse.optimize(model)
    for batch, seq in [(1, 16), (8, 128)]:
        ids = torch.randint(0, 30522, (batch, seq), device="cuda")
        mask = torch.ones(batch, seq, dtype=torch.long, device="cuda")
        call = lambda: model(input_ids=ids, attention_mask=mask)  # noqa: E731
        with torch.inference_mode():
            for _ in range(5):
                call()
            full = events(call)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(100):
                call()
            host = (time.perf_counter() - t0) * 10  # ms per call, host side, GPU may lag
            torch.cuda.synchronize()
            runner = model._transfuse_state.backend.runners[-1]
            captured = list(runner.graphs.values())[-1]
            replay = events(captured.graph.replay)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(50):
                call()
            pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
        print(f"{batch}x{seq}: full call {full:.3f} ms, host-only {host:.3f} ms/call, graph replay {replay:.3f} ms")
        print("\n".join(s.getvalue().splitlines()[:34]))


if __name__ == "__main__" and __import__("sys").argv[-1] != "kernels":
    main()


def kernels(shapes=((1, 16), (8, 128), (32, 512))):
    """Per-kernel GPU time inside one replay, from the profiler: what dominates each shape."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = transfuse.optimize(BertModel(BertConfig()).cuda().half().eval())
    for batch, seq in shapes:
        ids = torch.randint(0, 30522, (batch, seq), device="cuda")
        mask = torch.ones(batch, seq, dtype=torch.long, device="cuda")
        with torch.inference_mode():
            for _ in range(3):
                model(input_ids=ids, attention_mask=mask)
            captured = list(model._transfuse_state.backend.runners[-1].graphs.values())[-1]
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    captured.graph.replay()
                torch.cuda.synchronize()
        print(f"== {batch}x{seq}: kernels in one replay (us per replay)")
        rows = []
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t > 0:
                rows.append((t / 10, e.count / 10, e.key[:90]))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        print(f"   total {total:.1f} us in {sum(r[1] for r in rows):.0f} kernels")
        for t, n, k in rows[:14]:
            print(f"   {t:8.1f} us  x{n:4.0f}  {k}")


if __name__ == "__main__" and __import__("sys").argv[-1] == "kernels":
    kernels()
