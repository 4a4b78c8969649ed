"""Does pulling a decode GEMV's weight into L2 ahead of it pay? (No, as a launch of its own: see
bench/results/2026-11-26-*-l2-prefetch-session14.log; issued from the QKV kernel's programs it was
slower too: *-qkv-prefetch-o-ab-session14.log.) Llama-1.1B's linears at 1 row (fp16),
transfuse's GEMV, inside CUDA graphs.

    PYTHONPATH=src python3 bench/kernels/bench_l2_prefetch.py [--reps 50] [--sleep-us 3.5]

1. One linear at a time: per weight copy (enough copies that L2 never holds them), a graph of
   [prefetch?, spin(sleep_us), gemv]: the gemv's time is the replay's time less that of
   [prefetch?, spin]. "cold" without the prefetch, "prefetched" with one launched before the spin
   (standing for the attention kernel, during which the HBM is idle), "warm" after a full read.
2. 22 layers of a decode step: [qkv, spin (the attention), o + residual, gate_up + SiLU*mul,
   down + residual], with and without a prefetch of the o weight launched before the spin, or
   before the qkv GEMV.
"""

import argparse
import datetime

import torch
import triton
import triton.language as tl

# The prefetch: Hopper's cp.async.bulk.prefetch.L2, a hint that holds no registers; the issuing
# thread does not wait for it.
CHUNK = 4096  # bytes one thread asks for with one instruction (a multiple of 16)


@triton.jit
def prefetch_l2(base_ptr, start, nbytes, LANES: tl.constexpr, CHUNK_BYTES: tl.constexpr):
    """Asks L2 for bytes [start, start + nbytes) of base_ptr's buffer: LANES threads, CHUNK_BYTES
    each per instruction, in order, so the first bytes a reader needs are asked for first. start
    and the buffer must be 16-byte aligned; a last chunk shorter than 16 bytes is not asked for."""
    lane = tl.arange(0, LANES).to(tl.int64) * CHUNK_BYTES
    ptr = base_ptr.to(tl.pointer_type(tl.int8))
    for done in range(0, nbytes, LANES * CHUNK_BYTES):
        offs = done + lane
        size = tl.minimum(tl.maximum(nbytes - offs, 0), CHUNK_BYTES).to(tl.int32) // 16 * 16
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptr + start + offs, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(base_ptr, nbytes, per_program, LANES: tl.constexpr, CHUNK_BYTES: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * per_program
    prefetch_l2(base_ptr, start, tl.minimum(per_program, nbytes - start), LANES, CHUNK_BYTES)


def l2_prefetch(t: torch.Tensor, programs: int = 32) -> None:
    """Asks L2 for all of t's bytes (t contiguous) from `programs` one-warp programs; returns at once."""
    if t.numel() == 0:
        return
    if not t.is_contiguous() or t.data_ptr() % 16:
        raise ValueError("l2_prefetch takes a contiguous, 16-byte aligned tensor")
    nbytes = t.numel() * t.element_size()
    per_program = triton.cdiv(triton.cdiv(nbytes, programs), 16) * 16
    _l2_prefetch_kernel[(triton.cdiv(nbytes, per_program),)](t, nbytes, per_program, LANES=32,
                                                             CHUNK_BYTES=CHUNK, num_warps=1)


def main():
    from transfuse.bench.timing import graph_replay_us
    from transfuse.kernels.gemv import gemv_fwd

    def replay_us(calls, reps: int) -> float:  # one replay of a graph of calls(), median, us
        return graph_replay_us(calls, repeat=1, replays=reps)

    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--sleep-us", type=float, default=3.5)
    parser.add_argument("--programs", type=int, default=32)
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, {datetime.date.today()}")
    clock_khz = getattr(props, "clock_rate", 1_980_000) or 1_980_000
    cycles = int(args.sleep_us * 1e-6 * clock_khz * 1e3)

    def spin():
        torch.cuda._sleep(cycles)

    gen = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.float16
    L = 22

    def weight(rows, k):
        return (torch.randn(rows, k, device="cuda", generator=gen) * k**-0.5).to(dt)

    qkv = [weight(2560, 2048) for _ in range(L)]
    o = [weight(2048, 2048) for _ in range(L)]
    gu = [weight(2 * 5632, 2048) for _ in range(L)]
    down = [weight(2048, 5632) for _ in range(L)]
    x = torch.randn(1, 2048, device="cuda", dtype=dt)
    xi = torch.randn(1, 5632, device="cuda", dtype=dt)
    res = torch.randn(1, 2048, device="cuda", dtype=dt)
    pf = lambda w: l2_prefetch(w, args.programs)  # noqa: E731

    # correctness of the prefetch path: a hint only, the product is unchanged
    ref = gemv_fwd(x, o[0])
    pf(o[0])
    assert torch.equal(gemv_fwd(x, o[0]), ref)

    print("\n1. one linear (us per call), spin %.1f us between prefetch and GEMV" % args.sleep_us)
    print(f"{'linear':<10} {'MB':>6} {'cold':>7} {'prefetched':>11} {'warm':>7}")
    for name, ws, xin, act, r in [("qkv", qkv, x, "none", None), ("o+res", o, x, "none", res),
                                  ("gate_up", gu, x, "silu_mul", None), ("down+res", down, xi, "none", res)]:
        base = replay_us(lambda: [spin() for _ in ws], args.reps)
        base_pf = replay_us(lambda: [(pf(w), spin()) for w in ws], args.reps)
        cold = replay_us(lambda: [(spin(), gemv_fwd(xin, w, None, act, r)) for w in ws], args.reps)
        pref = replay_us(lambda: [(pf(w), spin(), gemv_fwd(xin, w, None, act, r)) for w in ws], args.reps)
        warm = replay_us(lambda: [(w.sum(), spin(), gemv_fwd(xin, w, None, act, r)) for w in ws], args.reps)
        base_warm = replay_us(lambda: [(w.sum(), spin()) for w in ws], args.reps)
        mb = ws[0].numel() * 2 / 1e6
        print(f"{name:<10} {mb:6.1f} {(cold - base) / L:7.2f} {(pref - base_pf) / L:11.2f} {(warm - base_warm) / L:7.2f}")

    print("\n2. 22 decode layers (us per layer)")

    def layers(where):
        for i in range(L):
            if where == "before_qkv":
                pf(o[i])
            q = gemv_fwd(x, qkv[i])
            if where == "before_attention":
                pf(o[i])
            spin()
            h = gemv_fwd(x, o[i], None, "none", res)
            g = gemv_fwd(h, gu[i], None, "silu_mul", None)
            gemv_fwd(g, down[i], None, "none", res)
            del q

    rows = {}
    for where in ["none", "before_attention", "before_qkv", "none"]:
        rows.setdefault(where, []).append(replay_us(lambda: layers(where), args.reps) / L)
    for where, ts in rows.items():
        print(f"{where:<18} " + " ".join(f"{t:7.2f}" for t in ts))


if __name__ == "__main__":
    main()
