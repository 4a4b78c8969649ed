"""Is a generate() decode step bound by the GPU or by the host? For each model, over one
generate() of 64 tokens: its time per step, the GPU time of each step's CUDA-graph replay (CUDA
events recorded around every replay), and the host time of the replay call itself.

    PYTHONPATH=src python3 bench/profile_step_replay.py [--models t5-base,llama-1.1b,gpt2] [--batch 1] [--disable PASS,...]

Random weights, fp16, greedy; a 32-token prompt (128-token encoder input for T5/BART), 64 new tokens.
"""

import argparse
import statistics
import time

import torch

import transfuse


def build(name):
    """(model on the GPU in fp16, prompt length)."""
    if name in ("t5-base", "bart-base"):
        from transfuse.bench.seq2seq import make_model

        return make_model(name).cuda().half().eval(), 128
    from transfuse.bench.decoder import make_model

    return make_model(name).cuda().half().eval(), 32


def optimized_generate_setup(name: str = "llama-1.1b", batch: int = 1):
    """(optimized model, prompt ids, greedy generate() kwargs) with seed 0: the dev tools' common start."""
    torch.manual_seed(0)
    model, prompt = build(name)
    transfuse.optimize(model)
    ids = torch.randint(3, model.config.vocab_size, (batch, prompt), device="cuda")
    return model, ids, dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="t5-base,llama-1.1b,gpt2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--disable", default="", help="passes to leave out (optimize's disable=), comma-separated")
    args = parser.parse_args()
    disable = [p for p in args.disable.split(",") if p]
    print(f"{'model':<12} {'gen ms/step':>11} {'replay GPU ms':>13} {'replay host ms':>14}")
    for name in args.models.split(","):
        torch.manual_seed(0)
        model, prompt = build(name)
        transfuse.optimize(model, disable=disable)
        ids = torch.randint(3, model.config.vocab_size, (args.batch, prompt), device="cuda")
        gen = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
        with torch.inference_mode():
            for n in (2, 64):  # both calls' shapes warmed (a new max_new_tokens may trace or capture anew)
                for _ in range(2):
                    model.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen)
            times = {}
            for n in (2, 64):
                torch.cuda.synchronize()
                start = time.perf_counter()
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, **gen)
                torch.cuda.synchronize()
                times[n] = time.perf_counter() - start
            per_step = (times[64] - times[2]) / 62 * 1e3
            entry = list(model._transfuse_state.decode_loop.entries.values())[-1]
            graph = entry.graph
            events, host = [], []

            class Timed:  # the loop calls entry.graph.replay(): record around each call
                def replay(self):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    t0 = time.perf_counter()
                    graph.replay()
                    host.append((time.perf_counter() - t0) * 1e3)
                    end.record()
                    events.append((start, end))

            entry.graph = Timed()
            try:
                model.generate(ids, max_new_tokens=64, min_new_tokens=64, **gen)
                torch.cuda.synchronize()
            finally:
                entry.graph = graph
            gpu = [s.elapsed_time(e) for s, e in events]
            walls = host
        print(f"{name:<12} {per_step:>11.3f} {statistics.median(gpu):>13.3f} {statistics.median(walls):>14.3f}", flush=True)
        del model, graph, entry
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
