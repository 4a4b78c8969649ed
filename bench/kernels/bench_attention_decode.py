"""Microbenchmark: decode-step attention, the decode kernel (kernels/attention_decode.py) against the
prefill kernel it replaced for few query rows and against PyTorch's SDPA.

    PYTHONPATH=src python3 bench/kernels/bench_attention_decode.py     # ~1 min on an H100

One query row per head over a KV cache, fp16, in the two forms transfuse meets: its own static cache
(key_len = the filled length, no mask) and Hugging Face's StaticCache (a (batch, 1, 1, cache) mask of
finfo.min over the unfilled tail, with the block summary transfuse computes once per step). Times are
medians of CUDA-graph replays (triton.testing.do_bench_cudagraph), as transfuse runs a step; inputs
fit in L2 for every provider alike at short caches. GB/s counts the K and V bytes of the filled keys
against the copy bandwidth measured in the same run. SDPA reads the filled keys only (sliced, GQA
repeated outside the timed call), its best case.
"""

import argparse
import datetime
import os

import torch
import torch.nn.functional as F
import triton
import triton.testing

from transfuse.kernels.attention import attention_fwd, attention_mask_summary_fwd
from transfuse.kernels.attention_decode import num_splits

# name, batch, nheads, nheads_kv, head_dim, cache length, filled keys
SHAPES = [
    ("llama-1.1b", 1, 32, 4, 64, 256, 161),
    ("llama-1.1b", 8, 32, 4, 64, 256, 161),
    ("llama-1.1b", 32, 32, 4, 64, 256, 161),
    ("llama-1.1b", 1, 32, 4, 64, 4096, 2080),
    ("llama-1.1b", 8, 32, 4, 64, 4096, 2080),
    ("llama-7b", 1, 32, 32, 128, 4096, 2080),
    ("llama-7b", 8, 32, 32, 128, 4096, 2080),
    ("gemma-2b", 1, 8, 1, 256, 8192, 8000),
    ("gpt2", 1, 12, 12, 64, 256, 161),
]


def _copy_gbs() -> float:
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), rep=50, return_mode="median")
    return 2 * x.numel() / ms / 1e6


def _ms(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")


def _with_decode(on: bool, fn):
    def run():
        os.environ["TRANSFUSE_DECODE_ATTENTION"] = "1" if on else "0"
        return fn()
    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.parse_args()
    copy = _copy_gbs()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.date.today()}; copy bandwidth {copy:.0f} GB/s")
    print(f"{'shape':34s} {'form':8s} {'splits':>6s} {'prefill us':>10s} {'decode us':>10s} {'sdpa us':>8s} "
          f"{'speedup':>8s} {'decode GB/s':>11s}")
    for name, batch, nheads, nheads_kv, head_dim, cache, filled in SHAPES:
        q = torch.randn(batch, nheads, 1, head_dim, dtype=torch.float16, device="cuda")
        k = torch.randn(batch, nheads_kv, cache, head_dim, dtype=torch.float16, device="cuda")
        v = torch.randn_like(k)
        scale = head_dim ** -0.5
        key_len = torch.tensor([filled], dtype=torch.int32, device="cuda")
        mask = torch.zeros(batch, 1, 1, cache, dtype=torch.float16, device="cuda")
        mask[..., filled:] = torch.finfo(torch.float16).min
        summary = attention_mask_summary_fwd(mask, 1, cache)
        group = nheads // nheads_kv
        kk = k[:, :, :filled].repeat_interleave(group, 1).contiguous()
        vv = v[:, :, :filled].repeat_interleave(group, 1).contiguous()
        sdpa = _ms(lambda: F.scaled_dot_product_attention(q, kk, vv, scale=scale))
        gbytes = 2 * batch * nheads_kv * filled * head_dim * 2 / 1e9
        for form, call in (("key_len", lambda: attention_fwd(q, k, v, None, None, scale, False, True, key_len=key_len)),
                           ("hf mask", lambda: attention_fwd(q, k, v, mask, summary, scale, False, False))):
            old = _ms(_with_decode(False, call))
            new = _ms(_with_decode(True, call))
            shape = f"{name} b{batch} {nheads}/{nheads_kv}x{head_dim} {filled}/{cache}"
            print(f"{shape:34s} {form:8s} {num_splits(batch * nheads_kv, cache, q.device):6d} {old * 1e3:10.1f} "
                  f"{new * 1e3:10.1f} {sdpa * 1e3:8.1f} {old / new:7.2f}x {gbytes / (new * 1e-3):11.0f}", flush=True)
    os.environ.pop("TRANSFUSE_DECODE_ATTENTION", None)


if __name__ == "__main__":
    main()
