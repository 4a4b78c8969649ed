"""Does programmatic dependent launch (PDL, Hopper's griddepcontrol) shorten the gaps between the
small kernels of a CUDA graph? Times chains of small Triton kernels captured in one graph, launched
plainly and with launch_pdl=True (each kernel waiting on its predecessor at its top, and optionally
letting its own dependents launch at once). Dev probe:
PYTHONPATH=src python3 bench/kernels/pdl_probe.py"""


import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from transfuse.bench.timing import graph_replay_us


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, PDL: tl.constexpr, TRIGGER: tl.constexpr, BLOCK: tl.constexpr):
    if PDL:
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, x * 1.0001 + 1.0, mask=offs < n)


@triton.jit
def _rowsum_kernel(w_ptr, x_ptr, y_ptr, K, PDL: tl.constexpr, TRIGGER: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """y[n] = sum_k w[n, k] * x[k] + y_in: a GEMV streaming w (not produced by the chain), reading x."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    if PDL:
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()
    for k in range(0, K, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :]).to(tl.float32)
        x = tl.load(x_ptr + cols).to(tl.float32)
        acc += w * x[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty))


def _graph_us_per_kernel(launch, n_kernels: int) -> float:
    """us per kernel of launch() (n_kernels launches), median of 30 replays of one CUDA graph."""
    return graph_replay_us(launch, repeat=1, replays=30) / n_kernels


def main():
    n_chain = 200
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"chains of {n_chain} kernels in one CUDA graph, us per kernel (median of 30 replays)")
    print(f"{'kernel':<28}{'plain':>8}{'pdl':>8}{'pdl+trigger':>13}")
    for n in (4096, 1 << 20):
        bufs = [torch.randn(n, device="cuda", dtype=torch.float16) for _ in range(2)]
        row = []
        for pdl, trig in ((False, False), (True, False), (True, True)):
            def launch(pdl=pdl, trig=trig):
                for i in range(n_chain):
                    kw = {"launch_pdl": True} if pdl else {}
                    _scale_kernel[(triton.cdiv(n, 1024),)](bufs[i % 2], bufs[(i + 1) % 2], n, PDL=pdl,
                                                          TRIGGER=trig, BLOCK=1024, **kw)
            row.append(_graph_us_per_kernel(launch, n_chain))
        print(f"{'elementwise n=' + str(n):<28}" + "".join(f"{t:8.2f}" if i < 2 else f"{t:13.2f}"
                                                         for i, t in enumerate(row)))
    for (N, K) in ((2048, 2048), (2560, 2048), (768, 768)):
        ws = [torch.randn(N, K, device="cuda", dtype=torch.float16) for _ in range(8)]  # > L2 in total
        xs = [torch.randn(max(N, K), device="cuda", dtype=torch.float16) for _ in range(2)]
        row = []
        for pdl, trig in ((False, False), (True, False), (True, True)):
            def launch(pdl=pdl, trig=trig):
                for i in range(n_chain):
                    kw = {"launch_pdl": True} if pdl else {}
                    _rowsum_kernel[(N // 16,)](ws[i % 8], xs[i % 2], xs[(i + 1) % 2], K, PDL=pdl, TRIGGER=trig,
                                               BLOCK_N=16, BLOCK_K=256, num_warps=4, **kw)
            row.append(_graph_us_per_kernel(launch, n_chain))
        floor = N * K * 2 / 3.0e12 * 1e6
        print(f"{f'gemv {N}x{K} (floor {floor:.1f})':<28}" + "".join(f"{t:8.2f}" if i < 2 else f"{t:13.2f}"
                                                                    for i, t in enumerate(row)))


if __name__ == "__main__":
    main()
