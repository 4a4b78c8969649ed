"""Decode speed of llama-1.1B (random weights, fp16, batch 1, 32-token prompt) with the RMSNorm-fused
GEMV (kernels/gemv.norm_gemv_fwd) at other column-block widths than the heuristic's 2: each program
normalises x itself, so wider blocks do that work fewer times (1,280 and 2,816 programs at 2).

    PYTHONPATH=src python3 bench/profile_norm_gemv_width.py 4x4 8x4 8x8     # BLOCK_N x num_warps

Each variant optimizes a fresh copy of the model (new graphs), warms generate() up, then times
generate() of 129 and of 1 new tokens between CUDA events, five times: us per step is the median of
(t129 - t1) / 128. The heuristic runs first and last (drift check); the last 4 tokens of a
33-token generate() are printed so that the variants can be seen to agree."""
import copy, statistics, sys, torch, transfuse
import transfuse.kernels.gemv as gemv
from transfuse.bench.decoder import make_model
base = make_model("llama-1.1b").cuda().half().eval()
ids = torch.randint(3, 32000, (1, 32), device="cuda")
original = gemv.norm_gemv_fwd
variants = [None] + [tuple(int(v) for v in a.split("x")) for a in sys.argv[1:]] + [None]
for variant in variants:
    def patched(x, norm, weight, bias=None, activation="none", config=None, _v=variant):
        return original(x, norm, weight, bias, activation, config=_v if config is None else config)
    gemv.norm_gemv_fwd = patched if variant is not None else original
    torch.manual_seed(0)
    opt = transfuse.optimize(copy.deepcopy(base))
    def gen(n):
        return opt.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    with torch.no_grad():
        for _ in range(2):
            gen(65); gen(1)
        steps = []
        for _ in range(5):
            t = []
            for n in (1, 129):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(); a.record(); out = gen(n); b.record(); torch.cuda.synchronize()
                t.append(a.elapsed_time(b))
            steps.append((t[1] - t[0]) / 128)
        ref = gen(33)
    ms = statistics.median(steps)
    print(f"norm-GEMV config {variant or 'heuristic'}: {ms * 1000:.1f} us/step ({1000 / ms:.0f} tok/s), "
          f"steps {[round(s * 1000, 1) for s in steps]}, tokens {ref[0, -4:].tolist()}", flush=True)
    del opt
    torch.cuda.empty_cache()
print(torch.cuda.get_device_name(), torch.__version__)
