"""Threads calling one optimized model on the GPU, on one stream or on streams of their own, each
get their own answer (runtime/call_lock.py): the CUDA graphs' static buffers and memory pool are the
model's."""

import copy
import random
import threading

import pytest
import torch

import transfuse
from tests.helpers import rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("own_streams", [False, True])
def test_threads_get_their_own_outputs(own_streams):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model32 = BertModel(BertConfig(num_hidden_layers=2)).cuda().eval()
    model16 = copy.deepcopy(model32).half()
    opt = transfuse.optimize(copy.deepcopy(model16))
    rng = random.Random(1)
    work = [[(rng.choice((1, 2, 4)), rng.choice((16, 48, 100))) for _ in range(12)] for _ in range(4)]
    results, errors = {}, []

    def run(t):
        try:
            stream = torch.cuda.Stream() if own_streams else torch.cuda.current_stream()
            gen = torch.Generator(device="cuda").manual_seed(t)
            with torch.cuda.stream(stream), torch.no_grad():
                for i, (b, s) in enumerate(work[t]):
                    ids = torch.randint(0, 30522, (b, s), device="cuda", generator=gen)
                    results[t, i] = (ids, opt(input_ids=ids).last_hidden_state)
            stream.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with torch.no_grad():  # every bucket captured before the threads start
        for b, s in {x for w in work for x in w}:
            for _ in range(2):
                opt(input_ids=torch.randint(0, 30522, (b, s), device="cuda"))
    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    torch.cuda.synchronize()
    with torch.no_grad():
        for ids, out in results.values():
            ref = model32(input_ids=ids).last_hidden_state
            eager = model16(input_ids=ids).last_hidden_state
            assert rel_err(out, ref) <= 2 * rel_err(eager, ref) + 1e-4
