"""Which calls of a shape sequence make Dynamo trace an optimized encoder again, and why (issue 3's
"no recompile inside the buckets").

    PYTHONPATH=src python3 bench/recompile_probe.py [--device cuda] [--config tiny] [--layers N] [--shapes 8x128,1x64,...]

bert-base geometry (random weights) in fp16 on CUDA (fp32 on the CPU), optimized once, then called
at each (batch, seq) in turn with a random padding mask. Prints, per call, the traces so far and the
guard that failed for each new one (Dynamo's own record). Compare TRANSFUSE_TRACE_SDPA=as-is
(torch's SDPA kernel choice traced as it is) with the default (tracing_sdpa.py).
"""

import argparse
import os

import torch
from torch._dynamo.utils import guard_failures

from transfuse.bench import dynamic, encoder

DEFAULT_SHAPES = "8x128,4x64,16x32,1x64,1x16,2x8,3x200,1x512,32x512,1x7"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", default="bert-base", choices=["bert-base", "tiny"])
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    cli = parser.parse_args()
    import transfuse

    device = torch.device(cli.device)
    args = argparse.Namespace(config=cli.config, dtype="fp16" if device.type == "cuda" else "fp32", attn=cli.attn)
    config = encoder.make_config(args)
    config.num_hidden_layers = cli.layers or config.num_hidden_layers
    model = encoder.make_model(config, 0).to(device=device, dtype=encoder.DTYPES[args.dtype])
    model = transfuse.optimize(model)
    print(f"TRANSFUSE_TRACE_SDPA={os.environ.get('TRANSFUSE_TRACE_SDPA', '(default)')} device={device} "
          f"torch {torch.__version__}")
    seen = 0
    with torch.inference_mode():
        for shape in cli.shapes.split(","):
            batch, seq = map(int, shape.split("x"))
            inputs = encoder.make_inputs(batch, seq, config.vocab_size, 0.25, batch * 1000 + seq, device)
            model(**inputs)
            traces = dynamic._dynamo_frames()
            line = f"{shape:>7}: traces {traces}"
            if traces > seen:
                reasons = [r.strip().splitlines()[0] for fails in guard_failures.values() for r in fails if r.strip()]
                line += "  <- " + (reasons[-1][:300] if reasons and seen else "first trace")
            print(line, flush=True)
            seen = traces
    print(f"total traces: {seen}")


if __name__ == "__main__":
    main()
