"""Where an optimized encoder-decoder's error comes from: the logits of one teacher-forced forward
(random encoder input and decoder ids, the bench's geometry, fp16) against the same weights in fp32,
for transfuse as is and with one thing turned off at a time: CUDA graphs, bucket padding, each pass,
Triton GEMMs (TRANSFUSE_GEMM_BACKEND=torch), programmatic dependent launch. Prints the relative error,
the argmax agreement, and where the error sits (worst decoder positions, last vocabulary columns).

Dev tool: PYTHONPATH=src python3 bench/bisect_error.py --model bart-base [--batch 8] [--variants ...]"""

import argparse
import copy
import os

import torch

import transfuse
from transfuse.bench.seq2seq import make_model
from transfuse.passes.manager import registry


def stats(got: torch.Tensor, ref: torch.Tensor) -> str:
    got, ref = got.float(), ref.float()
    diff = (got - ref).norm(dim=-1) / ref.norm(dim=-1)  # (B, T): per position
    worst = diff.flatten().topk(min(4, diff.numel()))
    positions = [divmod(int(i), diff.shape[1]) for i in worst.indices]
    cols = ((got - ref)[..., -64:].norm() / ref[..., -64:].norm()).item()
    return (f"rel err {((got - ref).norm() / ref.norm()).item():.2e}  argmax=fp32 "
            f"{(got.argmax(-1) == ref.argmax(-1)).float().mean().item():.1%}  worst (batch, pos): "
            + ", ".join(f"{p}={v:.1e}" for p, v in zip(positions, worst.values.tolist()))
            + f"  last 64 columns {cols:.1e}  nan {int(got.isnan().sum())}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="bart-base")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--input", type=int, default=128)
    parser.add_argument("--decoder", type=int, default=64)
    parser.add_argument("--variants", default="all")
    args = parser.parse_args()
    device = torch.device("cuda")
    master = make_model(args.model)
    fp32 = copy.deepcopy(master).to(device)
    gen = torch.Generator().manual_seed(0)
    vocab = master.config.vocab_size
    ids = torch.randint(3, vocab, (args.batch, args.input), generator=gen).to(device)
    dec = torch.randint(3, vocab, (args.batch, args.decoder), generator=gen).to(device)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=dec)
    with torch.inference_mode():
        ref = fp32(**kwargs).logits
        half = copy.deepcopy(master).to(device, torch.float16)
        print(f"{'HF fp16':28s}", stats(half(**kwargs).logits, ref), flush=True)
    variants = {"transfuse": {}, "no CUDA graphs": dict(cuda_graphs=False), "no buckets": dict(buckets=False),
                "GEMMs on torch": "env", "no PDL": "pdl"}
    variants.update({f"without {p.name}": dict(disable=[p.name]) for p in registry()})
    if args.variants != "all":
        variants = {k: v for k, v in variants.items() if any(w in k for w in args.variants.split(","))}
    for name, options in variants.items():
        env = {}
        if options == "env":
            env, options = {"TRANSFUSE_GEMM_BACKEND": "torch"}, {}
        elif options == "pdl":
            env, options = {"TRANSFUSE_PDL": "0"}, {}
        os.environ.update(env)
        try:
            model = transfuse.optimize(copy.deepcopy(master).to(device, torch.float16), **options)
            with torch.inference_mode():
                outs = [model(**kwargs).logits.clone() for _ in range(3)]  # traced, captured, replayed
            print(f"{name:28s}", stats(outs[-1], ref), f"(first call {stats(outs[0], ref).split('  ')[0]})",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - a variant that fails is reported, the others still run
            print(f"{name:28s} {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)
        finally:
            for k in env:
                os.environ.pop(k)
            torch._dynamo.reset()


if __name__ == "__main__":
    main()
