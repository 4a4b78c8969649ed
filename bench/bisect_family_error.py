"""Where a family-sweep unit's forward error comes from: the sweep's model (same seed, same inputs),
its logits against the fp32 model for eager in the dtype, transfuse, and transfuse with each pass
turned off in turn, with the three worst tokens (flattened batch x position; padded positions
included, so eager shows large errors there too). For mixture-of-experts models whose router
modules (class name ending in "Router", with a `top_k`) return their logits first, also the fp32
router's smallest top-k margins by (layer, token): the softmax probability of the k-th expert minus
the (k+1)-th (plus the router's `balancing_biases`, if it has them). A token whose margin is below
the dtype's resolution can pick another expert under any change of rounding.

Dev tool: PYTHONPATH=src python3 bench/bisect_family_error.py zaya [--dtype bf16] [--seq 13]"""

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import family_sweep  # noqa: E402

import transfuse  # noqa: E402
from transfuse.passes.manager import registry  # noqa: E402


def router_margins(ref, run) -> list[tuple[int, int, float]]:
    """(layer, token, margin) for the six smallest fp32 router margins seen while `run()` runs."""
    margins = []

    def hook(module, _inputs, out):
        logits = (out[0] if isinstance(out, tuple) else out).float()
        probs = logits.softmax(-1) + getattr(module, "balancing_biases", 0.0)
        top = probs.topk(module.top_k + 1, dim=-1).values
        margins.append(top[:, module.top_k - 1] - top[:, module.top_k])

    handles = [m.register_forward_hook(hook) for m in ref.modules()
               if type(m).__name__.endswith("Router") and isinstance(getattr(m, "top_k", None), int)]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    if not margins:
        return []
    table = torch.stack(margins)  # (layers, tokens)
    order = table.flatten().argsort()[:6]
    return [(int(i // table.shape[1]), int(i % table.shape[1]), round(float(table.flatten()[i]), 5)) for i in order]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("family")
    parser.add_argument("--dtype", default="bf16", choices=("fp16", "bf16", "fp32"))
    parser.add_argument("--seq", type=int, default=13)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    unit = family_sweep.Unit(args.family, args.dtype, args.device, lambda record: None)
    ref, eager, _, _, _ = unit.build()
    inputs = unit.inputs(args.seq)
    with torch.no_grad():
        want = []
        margins = router_margins(ref, lambda: want.append(ref(**unit.cast(inputs, ref)).logits.float()))
        want = want[0]
        base = eager(**unit.cast(inputs, eager)).logits.float()
    if margins:
        print("smallest fp32 router margins (layer, token, margin):", margins)

    def report(name: str, got: torch.Tensor) -> None:
        per_token = ((got - want).norm(dim=-1) / want.norm(dim=-1)).flatten()
        worst = [(int(i), round(float(per_token[i]), 4)) for i in per_token.argsort(descending=True)[:3]]
        print(f"{name:28s} rel {float((got - want).norm() / want.norm()):.2e}  worst tokens {worst}")

    report(f"eager {args.dtype}", base)
    for name in [None] + [p.name for p in registry()]:
        model = copy.deepcopy(eager)
        transfuse.optimize(model, **({"disable": [name]} if name else {}))
        with torch.no_grad():
            report(f"transfuse -{name}" if name else "transfuse", model(**unit.cast(inputs, model)).logits.float())
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
