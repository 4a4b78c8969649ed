"""One call at a time per optimized model, whatever thread or CUDA stream it comes from.

An optimized model owns state that every call writes: the CUDA graphs' static input buffers (a
replay reads what the last copy-in wrote), the graphs' one memory pool (two graphs replaying at once
would share their intermediates), generate()'s static KV cache and decode-loop buffers. Two threads
calling one model at the same time would interleave those writes and read each other's inputs, a
wrong answer and no error, where the eager model gives each thread its own. So the model's forward
and generate() hold one re-entrant lock per model for the whole call: threads take turns, each gets
its own result.

A model on another GPU than the current device (`model.to("cuda:1")` while the caller's device is
cuda:0) runs each call with its own device made current: Triton launches, CUDA-graph capture and its
stream follow the current device, not the tensors' (on the wrong one a graph captured the kernels of
another device's stream, or none). The caller's device is current again when the call returns.

A lock orders the calls on the host only. A caller on another CUDA stream than the previous call's
would start writing the static buffers while the previous replay may still be reading them on the
GPU: its stream first waits for the previous call's stream (one event, only when the stream changes).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch


class CallLock:
    """`with lock:` around a model's call; re-entrant (generate() calls the forward). `device_of`
    gives the CUDA device index of the model's tensors (-1 for none), made current for the call."""

    def __init__(self, device_of: Callable[[], int] | None = None):
        self._lock = threading.RLock()
        self._depth = 0
        self._stream: torch.cuda.Stream | None = None  # the stream of the latest outermost call
        self._key = None  # its _current_stream_key()
        self._device_of = device_of
        self._caller_device = -1  # the device the outermost call found current, when it was another

    def __enter__(self):
        self._lock.acquire()
        self._depth += 1
        if self._depth == 1 and torch.cuda.is_initialized():
            index = self._device_of() if self._device_of is not None else -1
            if index >= 0 and index != _current_device():
                self._caller_device = torch.cuda._exchange_device(index)
            # The stream's identity as torch's C layer gives it (stream id, device, type): 0.9 us a
            # call against 8.2 us for torch.cuda.current_stream(), which builds a Stream object (H200
            # host, torch 2.11, 2026-12-01); a Stream is built only when the stream changes.
            key = _current_stream_key()
            if key != self._key:
                current = torch.cuda.current_stream()
                if self._stream is not None:
                    current.wait_stream(self._stream)
                self._stream, self._key = current, key
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0 and self._caller_device >= 0:
            torch.cuda._exchange_device(self._caller_device)
            self._caller_device = -1
        self._lock.release()


# torch's private CUDA bindings behind torch.cuda.current_stream(), looked up once (absent on a CPU build)
_GET_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)
_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)


def _current_device() -> int:
    return _GET_DEVICE() if _GET_DEVICE is not None else torch.cuda.current_device()


def _current_stream_key():
    """(stream id, device index, device type) of the current CUDA stream, without a Stream object."""
    if _GET_STREAM is None or _GET_DEVICE is None:  # private bindings renamed: the public, slower way
        stream = torch.cuda.current_stream()
        return stream.stream_id, stream.device_index, stream.device_type
    return _GET_STREAM(_GET_DEVICE())
