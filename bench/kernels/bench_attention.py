"""Microbenchmark: transfuse attention forward vs torch.nn.functional.scaled_dot_product_attention.

    python bench/kernels/bench_attention.py              # ~1 min on an H100
    python bench/kernels/bench_attention.py --autotune   # also the autotuned launcher and its best config
    python bench/kernels/bench_attention.py --quick      # bert-base rows only

Times are medians of CUDA-event timings of a CUDA graph replay (triton.testing.do_bench_cudagraph), the
way transfuse runs a model; `launch` is the same op timed by plain launches (do_bench), which shows
the host cost of a launch for tiny shapes. TFLOP/s counts 4 * B * H * Sq * Sk * D (half of the
score matrix when causal), for the padding-mask rows the unpadded count (the work that SDPA does).
SDPA runs its default backend, and its flash backend where it applies (no mask). torch.compile is
not a separate column: Inductor lowers attention to the same SDPA kernels. Inputs are not rotated:
the bert-base shapes fit in L2 for both sides alike.
"""

import argparse
import datetime

import torch
import torch.nn.functional as F
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from transfuse.kernels.attention import (
    _attention_fwd_kernel_autotuned,
    _attention_fwd_heuristic,
    attention_fwd,
    attention_mask_summary_fwd,
)
from transfuse.kernels._config import next_power_of_2

# name, batch, nheads, nheads_kv, seqlen_q, seqlen_k, head_dim, causal, mask kinds
BERT = [("bert-base", b, 12, 12, s, s, 64, False, ("none", "pad")) for b in (1, 8, 32) for s in (16, 128, 512)]
LONG = [
    ("d64", 4, 16, 16, 2048, 2048, 64, False, ("none",)),
    ("d64 causal", 4, 16, 16, 2048, 2048, 64, True, ("none",)),
    ("d128", 4, 16, 16, 2048, 2048, 128, False, ("none", "pad")),
    ("d128 causal", 4, 16, 16, 2048, 2048, 128, True, ("none",)),
    ("llama gqa 32/8", 2, 32, 8, 4096, 4096, 128, True, ("none",)),
    ("d80", 4, 16, 16, 1024, 1024, 80, False, ("none",)),
    ("d256", 2, 8, 8, 2048, 2048, 256, False, ("none",)),
]


def _ms(fn, graph: bool) -> float:
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def _sdpa(q, k, v, mask, scale, causal, backend=None):
    group = q.shape[1] // k.shape[1]
    if group > 1:  # GQA: SDPA's enable_gqa is not on every backend; repeat outside the timed call
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

    def run():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)

    if backend is None:
        return run

    def run_backend():
        with sdpa_kernel(backend):
            return run()

    return run_backend


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--autotune", action="store_true", help="also time the autotuned launcher")
    parser.add_argument("--quick", action="store_true", help="bert-base shapes only")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, torch {torch.__version__}, triton {triton.__version__}, {args.dtype}, "
          f"{datetime.date.today().isoformat()}")
    header = (f"{'case':<15} {'B':>3} {'H/Hkv':>6} {'Sq':>5} {'Sk':>5} {'D':>4} {'mask':<5} | "
              f"{'ours ms':>8} {'TF/s':>6} {'launch':>7} | {'sdpa ms':>8} {'TF/s':>6} {'flash ms':>8} | "
              f"{'speedup':>7} | config")
    print(header)
    print("-" * len(header))
    for name, b, h, hkv, sq, sk, d, causal, mask_kinds in BERT + ([] if args.quick else LONG):
        q = torch.randn(b, h, sq, d, dtype=dtype, device="cuda")
        k = torch.randn(b, hkv, sk, d, dtype=dtype, device="cuda")
        v = torch.randn(b, hkv, sk, d, dtype=dtype, device="cuda")
        scale = d ** -0.5
        flops = 4 * b * h * sq * sk * d * (0.5 if causal else 1.0)
        for mask_kind in mask_kinds:
            mask = summary = None
            if mask_kind == "pad":
                lengths = torch.randint(sk // 2, sk + 1, (b,), device="cuda")
                mask = (torch.arange(sk, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
                summary = attention_mask_summary_fwd(mask, sq, sk)
            ours = lambda: attention_fwd(q, k, v, mask, summary, scale, causal, True)  # noqa: E731
            ours()
            t_ours = _ms(ours, graph=True)
            t_launch = _ms(ours, graph=False)
            t_sdpa = _ms(_sdpa(q, k, v, mask, scale, causal), graph=True)
            t_flash = float("nan")
            if mask is None:
                try:
                    t_flash = _ms(_sdpa(q, k, v, None, scale, causal, SDPBackend.FLASH_ATTENTION), graph=True)
                except RuntimeError:
                    pass
            block_d = max(16, next_power_of_2(d))
            config = _attention_fwd_heuristic(block_d, dtype, mask is not None, sq, sk, b * h, q.device)
            config_text = "BM{} BN{} w{} s{}".format(*config)
            if args.autotune:
                tuned = lambda: attention_fwd(q, k, v, mask, summary, scale, causal, True, autotune=True)  # noqa: E731
                tuned()
                t_tuned = _ms(tuned, graph=True)
                best = _attention_fwd_kernel_autotuned.best_config
                config_text += (f" | tuned {t_tuned:.4f} ms BM{best.kwargs['BLOCK_M']} BN{best.kwargs['BLOCK_N']}"
                                f" w{best.num_warps} s{best.num_stages}")
            print(f"{name:<15} {b:>3} {f'{h}/{hkv}':>6} {sq:>5} {sk:>5} {d:>4} {mask_kind:<5} | "
                  f"{t_ours:8.4f} {flops / t_ours * 1e-9:6.1f} {t_launch:7.4f} | "
                  f"{t_sdpa:8.4f} {flops / t_sdpa * 1e-9:6.1f} {t_flash:8.4f} | "
                  f"{min(t_sdpa, t_flash if t_flash == t_flash else t_sdpa) / t_ours:6.2f}x | {config_text}")
            if mask is not None and name == "bert-base" and sq == 512:
                t_summary = _ms(lambda: attention_mask_summary_fwd(mask, sq, sk), graph=True)  # noqa: B023
                t_nosummary = _ms(lambda: attention_fwd(q, k, v, mask, None, scale, causal, True), graph=True)  # noqa: B023
                print(f"{'':<15} {'':>3} {'':>6} {'':>5} {'':>5} {'':>4} {'':<5}   without summary "
                      f"{t_nosummary:.4f} ms; summary itself {t_summary:.4f} ms (once per forward)")


if __name__ == "__main__":
    main()
