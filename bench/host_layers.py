"""Where the host time of one optimized bert-base call goes, layer by layer (issue 2 at small shapes,
where the GPU waits for the host): the whole call, the Dynamo-compiled forward without optimize()'s
wrapper, the bucket runner alone with the arguments Dynamo gives it, the CUDA graph's replay alone,
and a cProfile of the whole call. Each figure is the median of many calls, each started on an idle
GPU (synchronize, then time the enqueue).

    PYTHONPATH=src python3 bench/host_layers.py [--shapes 1x16,1x128] [--iters 300]
"""

import argparse
import cProfile
import io
import pstats

import torch
from transformers import BertConfig, BertModel

import transfuse
from profile_compare import host_ms  # bench/, the script's own folder
from transfuse.capture import _STATE


def synthetic_replay_ms(kernels: int, iters: int) -> float:
    """Host time of replaying a graph of `kernels` tiny element-wise kernels: the launch's own cost."""
    x = torch.randn(256, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1.0)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(kernels):
            x.mul_(1.0)
    graph.replay()
    return host_ms(graph.replay, iters)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="1x16,1x128")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--profile", action="store_true")
    cli = parser.parse_args()
    torch.manual_seed(0)
    model = BertModel(BertConfig(attn_implementation="sdpa")).cuda().half().eval()
    model = transfuse.optimize(model)
    state = getattr(model, _STATE)
    rows = []
    with torch.inference_mode():
        for shape in cli.shapes.split(","):
            b, s = map(int, shape.split("x"))
            ids = torch.randint(0, 30000, (b, s), device="cuda")
            mask = torch.ones_like(ids)
            for _ in range(5):
                model(input_ids=ids, attention_mask=mask)
            runner = state.backend.runners[-1]
            seen = {}
            call = type(runner).__call__

            def spy(self, *args):
                seen["args"] = args
                return call(self, *args)

            type(runner).__call__ = spy
            model(input_ids=ids, attention_mask=mask)
            type(runner).__call__ = call
            args = seen["args"]
            captured = next(reversed(runner.graphs.values()))
            full = host_ms(lambda: model(input_ids=ids, attention_mask=mask), cli.iters)
            compiled = host_ms(lambda: state.compiled(input_ids=ids, attention_mask=mask), cli.iters)
            direct = host_ms(lambda: runner(*args), cli.iters)
            replay = host_ms(captured.graph.replay, cli.iters)
            rows.append((shape, full, compiled, direct, replay))
            if cli.profile:
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(cli.iters):
                    model(input_ids=ids, attention_mask=mask)
                torch.cuda.synchronize()
                pr.disable()
                out = io.StringIO()
                pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(30)
                print(f"== {shape} cProfile of {cli.iters} calls, by own time\n{out.getvalue()}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for n in (1, 32, 128):
        print(f"graph of {n:3} tiny kernels: replay {synthetic_replay_ms(n, cli.iters):.3f} ms of host")
    print("shape   full call   Dynamo-compiled forward   bucket runner   graph replay   (host ms, medians)")
    for shape, full, compiled, direct, replay in rows:
        print(f"{shape:7} {full:9.3f}   {compiled:23.3f}   {direct:13.3f}   {replay:12.3f}")


if __name__ == "__main__":
    main()
