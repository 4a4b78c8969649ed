"""add_layer_norm launch configs (rows per program x warps) at x768 fp16 for 16 to 16384 rows, against
norm_config's choice. Each is timed as 40 launches inside one CUDA graph, as the kernels run in a
model: at a few rows a kernel takes 1-3 us, which triton.testing.do_bench's per-launch overhead hides.

    PYTHONPATH=src python3 bench/kernels/bench_norm_small_rows.py"""
import itertools

import torch

from transfuse.kernels.norm import NormConfig, add_layer_norm_fwd, norm_config


def graph_time_us(fn, n=40, reps=30):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n): fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / n)
    ts.sort(); return ts[len(ts) // 2]


for rows in (16, 128, 1024, 4096, 16384):
    x = torch.randn(rows, 768, device="cuda", dtype=torch.float16)
    r = torch.randn_like(x); w = torch.randn(768, device="cuda", dtype=torch.float16); b = torch.randn_like(w)
    base = norm_config(rows, 768)
    res = {}
    for rpp, warps in itertools.product((1, 2, 4, 8), (1, 2, 4, 8)):
        if rpp > rows: continue
        cfg = NormConfig(BLOCK_N=1024, ROWS_PER_PROGRAM=rpp, num_warps=warps)
        res[(rpp, warps)] = graph_time_us(lambda: add_layer_norm_fwd(x, r, w, b, 1e-12, False, config=cfg))
    best = min(res, key=res.get)
    print(f"rows {rows:6d} heuristic {base.ROWS_PER_PROGRAM}x{base.num_warps}w {res[(base.ROWS_PER_PROGRAM, base.num_warps)]:6.2f} us"
          f"  best {best[0]}x{best[1]}w {res[best]:6.2f} us  | " + " ".join(f"{k[0]}x{k[1]}:{v:.2f}" for k, v in sorted(res.items())), flush=True)
