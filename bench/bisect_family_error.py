"""Where a family-sweep unit's bf16 forward error comes from: the sweep's model (same seed, same
inputs at 13 tokens), its logits against the fp32 model for eager bf16, transfuse, and transfuse with
each pass turned off in turn, with the three worst tokens (flattened batch x position; padded
positions included, so eager shows large errors there too). For mixture-of-experts models, the
fp32 router's smallest top-k margins (softmax probability of the k-th expert minus the (k+1)-th, with
the balancing biases), by (layer, token): a token whose margin is below the dtype's resolution can
pick another expert under any change of rounding.

Dev tool: PYTHONPATH=src python3 bench/bisect_family_error.py zaya"""
import copy, sys, torch
sys.path.insert(0, "bench")
import family_sweep as fs
import transfuse
from transfuse.passes.manager import registry

fam = sys.argv[1] if len(sys.argv) > 1 else "zaya"
u = fs.Unit(fam, "bf16", "cuda", lambda r: None)
ref, eager, ours0, saved, attn = u.build()
kw = u.inputs(13)
# router margins in fp32 (hooks on the reference)
margins = []
def hook(mod, inp, out):
    logits = out[0].float()
    probs = logits.softmax(-1) + mod.balancing_biases
    top = probs.topk(mod.top_k + 1, dim=-1).values
    margins.append((top[:, mod.top_k - 1] - top[:, mod.top_k]))
hs = [m.register_forward_hook(hook) for m in ref.modules() if type(m).__name__.endswith("Router")]
with torch.no_grad():
    want = ref(**u.cast(kw, ref)).logits.float()
    base = eager(**u.cast(kw, eager)).logits.float()
for h in hs: h.remove()
if margins:
    m = torch.stack(margins)  # layers x tokens
    print("smallest fp32 router margins (layer, token, margin):",
          [(int(i // m.shape[1]), int(i % m.shape[1]), round(float(m.flatten()[i]), 5)) for i in m.flatten().argsort()[:6]])
def report(name, got):
    tok = ((got - want).norm(dim=-1) / want.norm(dim=-1)).flatten()
    print(f"{name:28s} rel {float((got-want).norm()/want.norm()):.2e}  worst tokens",
          [(int(i), round(float(tok[i]), 4)) for i in tok.argsort(descending=True)[:3]])
report("eager bf16", base)
names = [None] + [p.name for p in registry()]
for name in names:
    m = copy.deepcopy(eager)
    transfuse.optimize(m, **({"disable": [name]} if name else {}))
    with torch.no_grad():
        got = m(**u.cast(kw, m)).logits.float()
    report(f"transfuse -{name}" if name else "transfuse", got)
    torch._dynamo.reset()
