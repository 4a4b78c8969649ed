"""Is a mixture-of-experts family's sweep FAIL a router near-tie? (bench/family_sweep.py's models)

    OMP_NUM_THREADS=1 TRITON_INTERPRET=1 PYTHONPATH=src python3 bench/moe_router_margin.py mixtral bf16 37
    ... bench/moe_router_margin.py qwen3_moe fp16 37 --generate 2     # the sweep's gen_b2 check

Builds the sweep's unit (fp32 reference, eager and transfuse in the dtype, the sweep's padded inputs
of that length), finds the token whose logits transfuse gets furthest from fp32, and prints, at that
token, each router's expert probabilities in fp32 (modules named "*.gate", "*.router" or
"*.router.classifier", or whose class name ends in "Router"). For an encoder-decoder the token is a
decoder position and the decoder's routers are shown. A routed expert whose probability is within the dtype's rounding of the
next one (bf16: 2^-8 relative) may be swapped by any change of rounding upstream: the token then
takes another expert, and its logits move far while every other token stays within the dtype's noise.

bench/bisect_family_error.py is the other half: it turns transfuse's passes off one at a time (which
rewrite's rounding moves the token) and lists the smallest router margins over all tokens; this script
looks at the worst token itself, and at generate().

--generate BATCH repeats the sweep's greedy generate check (its seed-1 prompts, 8 new tokens) and, at
the first step where transfuse's token differs from eager's, prints how far each step's logits were
apart and the routers' probabilities at the token that step read (fp32 model, eager's prefix).
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
    parser.add_argument("--generate", type=int, default=0, metavar="BATCH")
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
        if hasattr(module, "classifier") and (name.endswith(".router") or type(module).__name__.endswith("Router")):
            continue  # Switch Transformers: its router returns the chosen experts; the classifier the logits
        if name.endswith((".gate", ".router", "router.classifier")) or type(module).__name__.endswith("Router"):
            module.register_forward_hook(keep(name))
    optimized = transfuse.optimize(ours)
    if args.generate:
        return _generate(unit, ref, eager, optimized, args, routers)
    _forward(ref, eager, optimized, inputs, routers)


def _forward(ref, eager, optimized, inputs: dict, routers: dict) -> None:
    """Each model's worst tokens against fp32, and the routers at transfuse's worst."""
    routers.clear()
    with torch.no_grad():
        fp32 = ref(**inputs).logits.float()
        errors = {"eager": (eager(**inputs).logits.float() - fp32).abs().amax(-1),
                  "transfuse": (optimized(**inputs).logits.float() - fp32).abs().amax(-1)}
    # An encoder-decoder's logits are the decoder's: every decoder position is real.
    real = inputs["attention_mask"].bool() if fp32.shape[1] == inputs["attention_mask"].shape[1] else \
        torch.ones(fp32.shape[:2], dtype=torch.bool)
    for name, err in errors.items():
        err[~real] = 0
        worst = torch.topk(err.flatten(), 4)
        print(f"{name}: largest max-abs logit errors {[round(v, 4) for v in worst.values.tolist()]} "
              f"at (row, position) {[divmod(i, real.shape[1]) for i in worst.indices.tolist()]}")
    row, pos = divmod(int(errors["transfuse"].flatten().argmax()), real.shape[1])
    print(f"routers at transfuse's worst token (row {row}, position {pos}), fp32 probabilities, sorted:")
    _print_routers(routers, real.shape, row, pos)

def _print_routers(routers: dict, shape, row: int, pos: int) -> None:
    for name, logits in routers.items():
        if logits.shape[:-1].numel() != shape.numel():
            continue  # another token axis (an encoder-decoder's encoder routers at a decoder position)
        probs = torch.softmax(logits.reshape(*shape, -1)[row, pos], -1).sort(descending=True).values
        gaps = (probs[:-1] - probs[1:]) / probs[:-1]
        print(f"  {name}: {[round(p, 4) for p in probs.tolist()]}; smallest relative gap between neighbours "
              f"{gaps.min().item():.2e}")


def _generate(unit, ref, eager, optimized, args, routers: dict) -> None:
    inputs = unit.inputs(args.seq, batch=args.generate, seed=1)
    gen = dict(max_new_tokens=family_sweep.NEW_TOKENS, do_sample=False, num_beams=1,
               pad_token_id=unit.spec[4].get("pad_token_id", family_sweep.PAD), output_scores=True,
               return_dict_in_generate=True)
    with torch.no_grad():
        want = eager.generate(**inputs, **gen)
        got = optimized.generate(**inputs, **gen)
    prompt = inputs["input_ids"].shape[1]
    differs = (want.sequences[:, prompt:] != got.sequences[:, prompt:]).nonzero().tolist()
    if not differs:
        print("transfuse's tokens equal eager's")
        return
    row, step = differs[0]
    apart = [round((w[row].float() - g[row].float()).abs().max().item(), 4) for w, g in zip(want.scores, got.scores)]
    print(f"row {row} differs first at new token {step}; max-abs logit difference transfuse - eager per step "
          f"(same prefix up to step {step}): {apart[:step + 1]}")
    print("the prompt's forward (a router flip there moves every later step):")
    _forward(ref, eager, optimized, inputs, routers)
    prefix = want.sequences[row:row + 1, :prompt + step]
    mask = torch.cat([inputs["attention_mask"][row:row + 1], prefix.new_ones(1, step)], dim=1)
    routers.clear()
    with torch.no_grad():
        ref(input_ids=prefix, attention_mask=mask)
    print(f"routers at the token step {step} read (position {prefix.shape[1] - 1}), fp32 probabilities, sorted:")
    _print_routers(routers, prefix.shape, 0, prefix.shape[1] - 1)


if __name__ == "__main__":
    main()
