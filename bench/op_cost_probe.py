import time, torch, transfuse.ops
from transfuse.kernels import norm as K
x = torch.randn(64, 768, device="cuda"); w = torch.randn(768, device="cuda"); b = torch.randn(768, device="cuda")
xg = x.clone().requires_grad_(); wg = w.clone().requires_grad_(); bg = b.clone().requires_grad_()
def t(label, fn, n=2000):
    for _ in range(50): fn()
    torch.cuda.synchronize(); s = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); print(f"{label}: {(time.perf_counter() - s) / n * 1e6:.1f} us")
t("launcher", lambda: K.layer_norm_fwd(x, w, b, 1e-5))
t("custom op no grad", lambda: torch.ops.transfuse.layer_norm(x, w, b, 1e-5))
t("custom op grad", lambda: torch.ops.transfuse.layer_norm(xg, wg, bg, 1e-5))
t("F.layer_norm", lambda: torch.nn.functional.layer_norm(x, (768,), w, b, 1e-5))
import cProfile, pstats
with cProfile.Profile() as p:
    for _ in range(500): torch.ops.transfuse.layer_norm(x, w, b, 1e-5)
pstats.Stats(p).sort_stats("tottime").print_stats(8)
import inspect, torch._library.custom_ops as c
src = inspect.getsource(c); i = src.find("def backend_impl"); print(src[i:i+1800])
