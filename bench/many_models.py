"""Optimize many models of one class in one process, each called once: does every one compile?

    OMP_NUM_THREADS=1 TRITON_INTERPRET=1 PYTHONPATH=src python3 bench/many_models.py [N]

A tiny BERT (random weights, CPU, Triton's interpreter) is built, optimized and called N times (300 by
default), each model dropped before the next. Prints the first model that Dynamo did not compile
(it then runs as written), or that all compiled, and the seconds taken. Before capture._own_code the
257th did not: Dynamo's accumulated_recompile_limit (256 entries per code object) on the one code
object of Hugging Face's forward decorator that every model shares.
"""

import gc
import sys
import time

import torch
import transformers

import transfuse


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    config = transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, vocab_size=50)
    ids = torch.randint(0, 50, (1, 5))
    start = time.time()
    for i in range(count):
        model = transfuse.optimize(transformers.BertModel(config).eval())
        with torch.no_grad():
            model(ids)
        if not model._transfuse_state.backend.records:
            print(f"model {i} was not compiled: it ran as written; {transfuse.report(model).splitlines()[0]}")
            break
        del model
        gc.collect()
    else:
        print(f"all {count} compiled")
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
