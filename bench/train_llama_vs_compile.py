"""Dev tool: Hugging Face Llama (8 layers, 1.1B width) training step, batch 4 x 1024, bf16 autocast, fused
AdamW: torch.compile (default, sdpa) vs transfuse vs eager, one process, CUDA events, median of 10 after 3
warm-up steps. The model and step are bench/profile_train_llama.py's.

    PYTHONPATH=src python3 bench/train_llama_vs_compile.py eager,transfuse,compile [mask]

With `mask`, each step also passes an attention_mask of ones, as a data collator does."""
import copy
import statistics
import sys

import torch

import transfuse
from profile_train_llama import build, make_step  # a sibling script (bench/ is on sys.path)


def main() -> None:
    base, ids = build()
    for name in sys.argv[1].split(","):
        model = copy.deepcopy(base)
        run = torch.compile(model) if name == "compile" else transfuse.optimize(model) if name == "transfuse" else model
        step = make_step(model, run, ids, with_mask=len(sys.argv) > 2 and sys.argv[2] == "mask")
        for _ in range(3):
            loss = step()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        print(f"{name}: {statistics.median(times):.2f} ms/step, loss {loss.item():.4f}, "
              f"peak {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB reserved", flush=True)
        del model, run, step
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
