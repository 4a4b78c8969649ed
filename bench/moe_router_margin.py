"""Is a mixture-of-experts family's sweep FAIL a router near-tie? (bench/family_sweep.py's models)

    OMP_NUM_THREADS=1 TRITON_INTERPRET=1 PYTHONPATH=src python3 bench/moe_router_margin.py mixtral bf16 37

Builds the sweep's unit (fp32 reference, eager and transfuse in the dtype, the sweep's padded inputs
of that length), finds the token whose logits transfuse gets furthest from fp32, and prints, at that
token, each router's expert probabilities in fp32 (modules named "*.gate" or "*.router", or whose
class name ends in "Router"). A routed expert whose probability is within the dtype's rounding of the
next one (bf16: 2^-8 relative) may be swapped by any change of rounding upstream: the token then
takes another expert, and its logits move far while every other token stays within the dtype's noise.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import family_sweep  # noqa: E402

import transfuse  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("family")
    parser.add_argument("dtype", choices=("fp16", "bf16"))
    parser.add_argument("seq", type=int)
    args = parser.parse_args()
    unit = family_sweep.Unit(args.family, args.dtype, "cpu", lambda record: None)
    ref, eager, ours, _, _ = unit.build()
    inputs = unit.inputs(args.seq)
    routers: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, inputs_, output):
            logits = output[0] if isinstance(output, tuple) else output
            routers.setdefault(f"{name} ({type(module).__name__})", logits.detach().float())
        return hook

    for name, module in ref.named_modules():
        if name.endswith((".gate", ".router")) or type(module).__name__.endswith("Router"):
            module.register_forward_hook(keep(name))
    optimized = transfuse.optimize(ours)
    with torch.no_grad():
        fp32 = ref(**inputs).logits.float()
        errors = {"eager": (eager(**inputs).logits.float() - fp32).abs().amax(-1),
                  "transfuse": (optimized(**inputs).logits.float() - fp32).abs().amax(-1)}
    real = inputs["attention_mask"].bool()
    for name, err in errors.items():
        err[~real] = 0
        worst = torch.topk(err.flatten(), 4)
        print(f"{name}: largest max-abs logit errors {[round(v, 4) for v in worst.values.tolist()]} "
              f"at (row, position) {[divmod(i, args.seq) for i in worst.indices.tolist()]}")
    row, pos = divmod(int(errors["transfuse"].flatten().argmax()), args.seq)
    print(f"routers at transfuse's worst token (row {row}, position {pos}), fp32 probabilities, sorted:")
    for name, logits in routers.items():
        probs = torch.softmax(logits.reshape(*real.shape, -1)[row, pos], -1).sort(descending=True).values
        gaps = (probs[:-1] - probs[1:]) / probs[:-1]
        print(f"  {name}: {[round(p, 4) for p in probs.tolist()]}; smallest relative gap between neighbours "
              f"{gaps.min().item():.2e}")


if __name__ == "__main__":
    main()
