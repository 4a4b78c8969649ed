"""A/B timing of the training attention kernels (fwd + bwd): a base revision's kernel module against the
working tree's, loaded side by side in one process (autotuned each), timings alternated, chosen tiles
printed (autotuning picks differ between modules more than most kernel changes move the time).

    rm -rf scratch/base && mkdir -p scratch/base && git archive <rev> src | tar -x -C scratch/base
    python3 bench/kernels/ab_attention_train.py          # on the GPU, from the repository root
"""
import importlib.util, sys, torch
sys.path.insert(0, "src")
from transfuse.kernels import attention_train as new
spec = importlib.util.spec_from_file_location("base_at", "scratch/base/src/transfuse/kernels/attention_train.py")
base = importlib.util.module_from_spec(spec); spec.loader.exec_module(base)
torch.manual_seed(0)
dev = "cuda"
cases = [
    ("nanogpt 8x12x1024x64 causal", 8, 12, 12, 1024, 64, True, None, False),
    ("llama 4x32/8x1024x64 causal", 4, 32, 8, 1024, 64, True, None, False),
    ("pad B11S 8x12x1024x64", 8, 12, 12, 1024, 64, False, "B11S", False),
    ("t5 1HSS grad 8x12x512x64", 8, 12, 12, 512, 64, False, "1HSS", True),
    ("hf-min B1SS 8x12x1024x64", 8, 12, 12, 1024, 64, False, "B1SS", False),
]
def t(fn, n=20, reps=7):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(n): fn()
        b.record(); torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / n)
    return sorted(out)[reps // 2]
def cfg(m, name):
    k = getattr(m, name)
    c = getattr(k, "best_config", None)
    return f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']}w{c.num_warps}s{c.num_stages}" if c else "?"
for name, B, H, HK, S, D, causal, bias_kind, bias_grad in cases:
    q = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, HK, S, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, HK, S, D, device=dev, dtype=torch.bfloat16)
    bias = None
    if bias_kind == "B11S":
        bias = torch.zeros(B, 1, 1, S, device=dev, dtype=torch.bfloat16); bias[1::2, ..., : S // 4] = float("-inf")
    elif bias_kind == "1HSS":
        bias = torch.randn(1, H, S, S, device=dev, dtype=torch.bfloat16)
    elif bias_kind == "B1SS":
        m = torch.full((S, S), torch.finfo(torch.bfloat16).min, device=dev).triu(1)
        bias = m.to(torch.bfloat16).expand(B, 1, S, S).contiguous()
    scale = D ** -0.5
    do = torch.randn_like(q)
    fns = {}
    for label, m in (("base", base), ("new", new)):
        res = m.attention_train_fwd(q, k, v, bias, scale, causal)
        out, saved = res[0], res[-1]
        fns[label] = (lambda m=m: m.attention_train_fwd(q, k, v, bias, scale, causal),
                      lambda m=m, out=out, saved=saved: m.attention_train_bwd(do, q, k, v, bias, out, saved, scale, causal, bias_grad))
        fns[label][1]()
    # same results?
    gb = fns["base"][1](); gn = fns["new"][1]()
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(gb[:3], gn[:3]))
    for rnd in range(2):
        for label, m in (("base", base), ("new", new)):
            f, b = fns[label]
            print(f"{label:5s} {name:28s} fwd {t(f):7.1f} us  bwd {t(b):7.1f} us  "
                  f"[fwd {cfg(m, '_attention_train_fwd_kernel_autotuned')} dkdv {cfg(m, '_attention_train_bwd_dkdv_kernel_autotuned')}"
                  f" dq {cfg(m, '_attention_train_bwd_dq_kernel_autotuned')}]" + (f" grad diff {diff:.2e}" if rnd == 0 and label == "new" else ""))
