"""Calls of one optimized model from several threads take turns and each gets its own answer."""

import threading
import time

import torch
import transformers

import transfuse
from tests.helpers import tiny_bert_twins


def _in_threads(fn, count: int) -> list:
    results = [None] * count
    errors = []

    def run(i):
        try:
            results[i] = fn(i)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def test_forward_calls_from_threads_take_turns():
    model, eager, _ = tiny_bert_twins()
    transfuse.optimize(model)
    inputs = [torch.randint(3, 97, (b, s)) for b, s in ((2, 7), (3, 5), (1, 9), (2, 7))]
    with torch.no_grad():
        model(inputs[0])  # traced once, outside the threads
        state = model._transfuse_state
        compiled, spans = state.compiled, []

        def slow(*args, **kwargs):
            start = time.perf_counter()
            time.sleep(0.05)  # long enough for another thread to come in
            out = compiled(*args, **kwargs)
            spans.append((start, time.perf_counter()))
            return out

        state.compiled = slow
        outs = _in_threads(lambda i: model(inputs[i]).last_hidden_state, len(inputs))
        refs = [eager(x).last_hidden_state for x in inputs]
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # never two at once
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_generate_from_threads_gives_each_its_own_tokens():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, vocab_size=97, max_position_embeddings=64)
    eager = transformers.LlamaForCausalLM(config).eval()
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(eager.state_dict())
    transfuse.optimize(model)
    assert model._transfuse_state.static_cache is not None  # the shared cache the lock protects
    prompts = [torch.randint(3, 97, (b, s)) for b, s in ((1, 5), (2, 7), (1, 9))]
    # three tokens: the prompt step and two decode steps on the shared static cache; the lock is held
    # for the whole generate() (seconds here), so the threads' calls still overlap and must take turns
    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(prompts[0], **kwargs)  # traced outside the threads
        outs = _in_threads(lambda i: model.generate(prompts[i], **kwargs), len(prompts))
        refs = [eager.generate(p, **kwargs) for p in prompts]
    for out, ref in zip(outs, refs):
        assert torch.equal(out, ref)


def test_the_models_device_is_current_for_a_call_and_the_callers_after(monkeypatch):
    """A model on cuda:1 called while cuda:0 is current runs with cuda:1 current (Triton launches and
    CUDA-graph capture follow the current device, not the tensors'), and the caller finds cuda:0
    current again after the call, also when it raised; nested calls (generate() calling the forward)
    switch once. The CUDA calls are stand-ins: the development machine has no GPU."""
    from transfuse.runtime import call_lock

    current = [0]
    seen = []

    def exchange(index):
        before, current[0] = current[0], index
        seen.append(index)
        return before

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "_exchange_device", exchange)
    monkeypatch.setattr(call_lock, "_current_device", lambda: current[0])
    monkeypatch.setattr(call_lock, "_current_stream_key", lambda: ("stream", current[0]))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)
    lock = call_lock.CallLock(lambda: 1)
    with lock:
        assert current[0] == 1
        with lock:  # re-entered: no second switch
            assert current[0] == 1
        assert current[0] == 1
    assert current[0] == 0 and seen == [1, 0]
    try:
        with lock:
            raise ValueError("the model's own error")
    except ValueError:
        pass
    assert current[0] == 0 and seen == [1, 0, 1, 0]
    with call_lock.CallLock(lambda: 0):  # already current: nothing switched
        assert current[0] == 0
    with call_lock.CallLock(lambda: -1):  # not on a GPU
        assert current[0] == 0
    assert seen == [1, 0, 1, 0]
