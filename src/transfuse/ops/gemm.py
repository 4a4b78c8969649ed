"""torch.ops.transfuse.linear: F.linear with its elementwise tail fused, act(x @ W.T + b) + residual.

    linear(Tensor x, Tensor weight, Tensor? bias, str activation, Tensor? residual) -> Tensor

x: (..., K), any leading dims and row strides; weight: (N, K) as F.linear takes it, or (2N, K) =
[W_gate; W_up] for a gated activation "<act>_mul" (SwiGLU, GeGLU, ReGLU); bias: (N,) or (2N,); residual: (..., N), any
strides. Returns (..., N), contiguous, dtype of x. Activations: transfuse.kernels.gemm.ACTIVATIONS.
Forward only for now (no autograd formula is registered).

On a GPU the op runs one of these implementations, whichever is faster for the shape:

- "triton": transfuse.kernels.gemm, one GEMM whose epilogue applies bias, activation and
  residual on the fp32 accumulator (plus a split-K variant for few rows);
- "gemv": transfuse.kernels.gemv, weight streaming on the CUDA cores for 1-2 rows (decode), the
  same epilogue;
- "few_rows": transfuse.kernels.gemm_few_rows, 3-32 rows (batched decode, short prompts) on the
  tensor cores with the weight as the MMA's tall side, the same epilogue; unsplit or split along K
  (timed per shape: the splits of gemm_few_rows.split_candidates);
- "torch": cuBLAS through torch.addmm / torch.mm, then the epilogue as PyTorch ops, which is what
  the unfused model runs; "torch_lt" is the same with cuBLASLt's fused epilogue
  (torch._addmm_activation) where that computes exactly what is asked: relu, and gelu_tanh (its
  GELU is the tanh approximation on CUDA; on CPU it is the erf GELU, so it is never used there).

The choice is keyed by GemmKey (M: 1, 2, then rounded up to a power of two from 16; N, K, dtype, activation, has_bias,
has_residual) and made the first time a key is seen, by timing every candidate on the call's own
inputs (Triton with its row regime's fixed tile, so that a new shape compiles and tunes nothing) (GPU time from CUDA events, L2 flushed, launch overhead excluded because the op runs under
CUDA graphs); Triton must beat the best torch candidate by MARGIN to be chosen, so a tie goes to
cuBLAS. Inside CUDA-graph capture nothing is timed and no Triton kernel may be launched for the
first time: an unseen key gets a fixed rule (_heuristic_choice: cuBLAS unless our kernel for that
key is already loaded), recorded as not measured and measured at its next call outside capture.
So warm up (one eager forward) before capturing, as CUDA graphs want anyway.

Override: TRANSFUSE_GEMM_BACKEND=triton|torch|auto (environment, read at every call) or
set_gemm_backend(...), which takes precedence. On CPU the op runs the Triton kernel under
TRITON_INTERPRET=1 (what the CPU tests check) and the torch path otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import warnings
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from transfuse.kernels import gemm as kernels
from transfuse.kernels import gemm_few_rows, gemv
from transfuse.kernels._config import INTERPRET, compiling_only, first_in_dry_run
from transfuse.reference.gemm import ACTIVATION_FUNCTIONS

BACKEND_ENV = "TRANSFUSE_GEMM_BACKEND"
BACKENDS = ("auto", "triton", "torch")

# Triton is chosen only when faster than the best torch candidate by this fraction: timing noise
# must not pick a kernel that is in truth slower than cuBLAS.
MARGIN = 0.02
_TIMING_REPS = 5  # per round; two rounds in alternating order
_L2_FLUSH_BYTES = 64 << 20  # more than H100's 50 MB L2
_SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU spin so the host queues every timed launch before they run


class GemmKey(NamedTuple):
    m_bucket: int
    n: int
    k: int
    dtype: str
    activation: str
    has_bias: bool
    has_residual: bool
    # W read through a transposed view (GPT-2's Conv1D): another memory layout, another choice.
    weight_transposed: bool = False


@dataclass
class GemmChoice:
    backend: str  # "triton", "gemv", "few_rows", "torch" or "torch_lt"
    split_k: int = 1  # Triton and few_rows
    tile: Optional[tuple] = None  # Triton only: a fixed tile (None: autotuned per key)
    measured: bool = False
    times_ms: dict[str, float] = field(default_factory=dict)
    note: str = ""


# What a dry run's GEMMs run with (cuBLAS): its outputs are never read, nothing is timed or recorded.
_DRY_RUN_CHOICE = GemmChoice("torch", note="precompile dry run")


# Row buckets above this are not timed against Triton: on the H100 and H200 (2026-11-21/22,
# bench/results/*profile-compare*, *encoder*) cuBLAS won every bert-base GEMM from 128 rows up, with or
# without an epilogue to fuse, and each Triton candidate costs a compile per row regime and epilogue
# (0.6-0.8 s with an empty cache) while a new input shape waits. Gated units (SwiGLU, GeGLU) are the
# exception, timed at every size: cuBLAS runs them as a GEMM and two elementwise kernels over the
# (M, 2N) intermediate, and Triton's one kernel won Llama-1.1B's gate_up at 2,048 rows (176.9 against
# 199.6 us) and tied at 512 (H200, bench/results/*gemm-tma-sweep2-session40.log). TRANSFUSE_GEMM_MEASURE_ALL=1 times
# Triton at every size (another GPU may differ); TRANSFUSE_GEMM_BACKEND=triton forces it.
TRITON_MAX_ROWS = kernels.SMALL_M_MAX
MEASURE_ALL_ENV = "TRANSFUSE_GEMM_MEASURE_ALL"

_CHOICES: dict[GemmKey, GemmChoice] = {}
_forced: Optional[str] = None
_DISK: dict = {}  # device index -> cache file path, once its choices are loaded


def _disk_path(device: torch.device):
    """Loads the measured choices of earlier processes on this GPU (once); returns the file."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DISK:
        from transfuse.runtime import tuning_cache

        path = tuning_cache.cache_file("gemm-dispatch", device, [kernels.__file__, gemv.__file__, gemm_few_rows.__file__, __file__])
        for key, value in tuning_cache.load(path).items():
            if value.get("tile") is not None:
                value["tile"] = tuple(value["tile"])
            _CHOICES.setdefault(GemmKey(*json.loads(key)), GemmChoice(**value))
        _DISK[index] = path
    return _DISK[index]


def _save_choices(device: torch.device) -> None:
    from transfuse.runtime import tuning_cache

    measured = {json.dumps(list(k)): dataclasses.asdict(c) for k, c in _CHOICES.items() if c.measured}
    tuning_cache.save(_disk_path(device), measured)


def set_gemm_backend(backend: Optional[str]) -> Optional[str]:
    """Forces "triton" or "torch" for every transfuse.linear call ("auto" or None: measure per
    shape, unless TRANSFUSE_GEMM_BACKEND says otherwise). Returns the previous setting."""
    global _forced
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    previous, _forced = _forced, backend
    return previous


def gemm_backend() -> str:
    """The backend in force: set_gemm_backend's, else TRANSFUSE_GEMM_BACKEND's, else "auto"."""
    backend = _forced or os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV} must be one of {BACKENDS}, got {backend!r}")
    return backend


def gemm_choices() -> dict[GemmKey, GemmChoice]:
    """What the dispatcher chose for each key so far (a copy), with the measured times in ms."""
    return dict(_CHOICES)


def clear_gemm_choices() -> None:
    _CHOICES.clear()


# -------------------------------------------------------------------------------------------------
# The torch/cuBLAS implementation
# -------------------------------------------------------------------------------------------------

_INPLACE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda h: h,
    "gelu": lambda h: torch.ops.aten.gelu_(h),
    "gelu_tanh": lambda h: torch.ops.aten.gelu_(h, approximate="tanh"),
    "relu": torch.relu_,
    "tanh": torch.tanh_,
    "silu": lambda h: F.silu(h, inplace=True),
}
# A gated unit's activation, on the gate's half (a strided view): out of place, so that the product
# with the up half is a new contiguous tensor.
_GATES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    gated: ACTIVATION_FUNCTIONS[gated.removesuffix("_mul")] for gated in kernels.GATED_ACTIVATIONS}


def cublaslt_epilogue_applies(x: torch.Tensor, bias: Optional[torch.Tensor], activation: str) -> bool:
    """torch._addmm_activation computes exactly this activation here (relu anywhere; gelu_tanh only
    on CUDA, where its GELU is the tanh approximation)."""
    return bias is not None and (activation == "relu" or (activation == "gelu_tanh" and x.is_cuda))


def linear_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: str,
    residual: Optional[torch.Tensor],
    cublaslt_epilogue: bool = False,
) -> torch.Tensor:
    """The same result through cuBLAS and PyTorch ops: addmm (bias fused by cuBLASLt), then the
    activation and residual in place on the GEMM's own output. cublaslt_epilogue=True also fuses
    the activation where cublaslt_epilogue_applies."""
    N = kernels.check_linear_args(x, weight, bias, activation, residual)
    K = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if cublaslt_epilogue and cublaslt_epilogue_applies(x, bias, activation):
        h = torch._addmm_activation(bias, x2, weight.t(), use_gelu=activation == "gelu_tanh")
    else:
        h = torch.addmm(bias, x2, weight.t()) if bias is not None else torch.mm(x2, weight.t())
        if kernels.is_gated(activation):
            h = _GATES[activation](h[:, :N]).mul_(h[:, N:])
        else:
            h = _INPLACE_ACTIVATIONS[activation](h)
    if residual is not None:
        h.add_(residual.reshape(-1, N))
    return h.view(*lead, N)


# -------------------------------------------------------------------------------------------------
# Dispatch
# -------------------------------------------------------------------------------------------------


def _gpu_times_ms(candidates: dict[str, Callable[[], object]], device: torch.device) -> dict[str, float]:
    """Median GPU time per call of each candidate. A ~1 ms spin kernel is queued first so the host
    enqueues every timed launch before the GPU reaches them: the events then measure the kernels
    back to back, as under CUDA-graph replay, not Python launch overhead. L2 is flushed before each
    call because a layer's weights are not L2-resident in a real forward pass."""
    flush = torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    with torch.cuda.device(device):
        for round_ in range(2):  # alternate the order to cancel clock and thermal drift
            items = list(candidates.items())
            for name, fn in items if round_ == 0 else reversed(items):
                starts = [torch.cuda.Event(enable_timing=True) for _ in range(_TIMING_REPS)]
                ends = [torch.cuda.Event(enable_timing=True) for _ in range(_TIMING_REPS)]
                torch.cuda.synchronize()
                if hasattr(torch.cuda, "_sleep"):
                    torch.cuda._sleep(_SLEEP_CYCLES)
                for start, end in zip(starts, ends):
                    flush.zero_()
                    start.record()
                    fn()
                    end.record()
                torch.cuda.synchronize()
                samples[name] += [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return {name: statistics.median(ts) for name, ts in samples.items()}


def _heuristic_choice(key: GemmKey, triton_loaded: bool) -> GemmChoice:
    """For a key first seen inside CUDA-graph capture, where nothing may be timed, and where a
    Triton kernel may only run if it has been launched before (its first launch loads a module,
    which aborts the capture): `triton_loaded` says whether the autotuned kernel for this exact key
    has been. Then: cuBLAS for a bare GEMM (its tiles beat ours; bias is fused by cuBLASLt anyway)
    and for few rows (weight-streaming, where cuBLAS has split-K and GEMV kernels); Triton when
    there is an epilogue to fuse on enough rows that the saved round trip of the output matters."""
    fusable = key.activation != "none" or key.has_residual
    use_triton = (triton_loaded and fusable and key.m_bucket > kernels.SMALL_M_MAX
                  and key.dtype in ("float16", "bfloat16"))
    return GemmChoice("triton" if use_triton else "torch", split_k=1, measured=False, note="heuristic (capture)")


def _candidates(key: GemmKey, x, weight, bias, activation, residual) -> tuple[dict[str, Callable[[], object]], tuple]:
    """Each implementation to time for this key, as a call; and the Triton tile they use."""
    M = math.prod(x.shape[:-1])
    candidates: dict[str, Callable[[], object]] = {
        "torch": lambda: linear_torch(x, weight, bias, activation, residual),
    }
    if cublaslt_epilogue_applies(x, bias, activation):
        candidates["torch_lt"] = lambda: linear_torch(x, weight, bias, activation, residual, cublaslt_epilogue=True)
    # Triton runs its regime's fixed tile here, not an autotuned one: autotuning compiles and times a
    # dozen configs per row bucket, seconds that a new input shape would wait for (issue: warm-up of
    # seconds). The fixed tile is compiled once per regime and epilogue.
    tile = kernels.fixed_tile(M, kernels.is_gated(activation), x.element_size())
    splits = sorted({1, kernels.default_split_k(M, key.n, key.k, x.device)})
    if key.m_bucket > TRITON_MAX_ROWS and not os.environ.get(MEASURE_ALL_ENV) and not kernels.is_gated(activation):
        splits = []  # cuBLAS only, see TRITON_MAX_ROWS
    for split in splits:
        candidates[f"triton/split_k={split}"] = (
            lambda split=split: kernels.linear_fwd(x, weight, bias, activation, residual, split_k=split, tile=tile))

    if M <= gemv.GEMV_FAST_M_MAX and gemv.gemv_applies(x, weight, max_rows=gemv.GEMV_FAST_M_MAX):
        decode = "gemv"
    elif gemm_few_rows.few_rows_applies(x, weight):
        decode = "few_rows"
    else:
        return candidates, tile
    candidates[decode] = lambda: _DECODE_KERNELS[decode](x, weight, bias, activation, residual)
    if decode == "few_rows":
        # splits along K finish in their last program (no reduce kernel): more programs on a weight
        # with fewer column blocks than SMs
        for split in gemm_few_rows.split_candidates(key.n, key.k, x.device, kernels.is_gated(activation))[1:]:
            candidates[f"few_rows/split_k={split}"] = (
                lambda split=split: gemm_few_rows.few_rows_fwd(x, weight, bias, activation, residual, split_k=split))
    return candidates, tile


def _queue_compiles(key: GemmKey, x, weight, bias, activation, residual) -> GemmChoice:
    """In a precompile dry run (runtime/precompile.py): our candidates' launches only queue their
    compiles; nothing is timed or recorded, and the dry run goes on with cuBLAS."""
    candidates, _ = _candidates(key, x, weight, bias, activation, residual)
    for name, fn in candidates.items():
        if _ours(name):
            try:
                fn()
            except Exception:  # noqa: BLE001 - the real call measures it again and reports a failure
                pass
    return _DRY_RUN_CHOICE


def _queue_once(key: GemmKey, x, weight, bias, activation, residual) -> GemmChoice:
    """_queue_compiles, once per distinct launch in a dry run. Every layer of every bucket meets the
    same few GEMMs: bert-base's stream dry run called the dispatcher 2,672 times for a few dozen
    distinct launches, each call running every candidate's launcher (cProfile, H200, 2026-11-29).
    The launch key holds what the candidates' compiles depend on: the dispatch key, the exact rows
    (the fixed tile and the splits follow them), each operand's strides and 16-byte alignment."""
    layout = tuple(None if t is None else (tuple(t.stride()), t.data_ptr() % 16) for t in (x, weight, bias, residual))
    if first_in_dry_run(("linear", key, math.prod(x.shape[:-1]), layout)):
        return _queue_compiles(key, x, weight, bias, activation, residual)
    return _DRY_RUN_CHOICE


def _measure(key: GemmKey, x, weight, bias, activation, residual) -> GemmChoice:
    candidates, tile = _candidates(key, x, weight, bias, activation, residual)
    note = ""
    for name, fn in list(candidates.items()):
        try:
            fn()  # compiles and autotunes Triton, warms cuBLAS's heuristics cache
        except Exception as e:  # noqa: BLE001 - a Triton failure must degrade to cuBLAS, not crash the model
            if not _ours(name):
                raise
            note = f"{name} failed: {type(e).__name__}: {e}"
            warnings.warn(f"transfuse.linear {key}: {note}; using torch", stacklevel=3)
            del candidates[name]
    if len(candidates) == 1:  # nothing to choose between (cuBLAS alone above TRITON_MAX_ROWS): no timing
        (only,) = candidates
        return GemmChoice(only, measured=True, note=note or "the only candidate")
    times = _gpu_times_ms(candidates, x.device)

    best_torch = min((n for n in times if not _ours(n)), key=times.get)
    best_triton = min((n for n in times if _ours(n)), key=times.get, default=None)
    if best_triton is not None and times[best_triton] < (1.0 - MARGIN) * times[best_torch]:
        if best_triton in _DECODE_KERNELS:
            return GemmChoice(best_triton, measured=True, times_ms=times, note=note)
        backend, split = best_triton.split("/split_k=")
        return GemmChoice(backend, split_k=int(split), tile=tile if backend == "triton" else None,
                          measured=True, times_ms=times, note=note)
    return GemmChoice(best_torch, measured=True, times_ms=times, note=note)


# Our decode-size kernels, each a backend and a candidate of its own (no split or tile to choose).
_DECODE_KERNELS = {"gemv": gemv.gemv_fwd, "few_rows": gemm_few_rows.few_rows_fwd}


def _ours(candidate: str) -> bool:
    backend = candidate.split("/")[0]  # "few_rows/split_k=2" is few_rows's
    return backend == "triton" or backend in _DECODE_KERNELS


def _choose(x, weight, bias, activation, residual, n_out: int) -> GemmChoice:
    backend = gemm_backend()
    if x.device.type != "cuda":
        use_triton = INTERPRET and backend != "torch"
        return GemmChoice("triton" if use_triton else "torch", split_k=1)
    if backend == "triton":
        return GemmChoice("triton", split_k=None)  # launcher's own split-K rule
    if backend == "torch":
        return GemmChoice("torch")
    M = math.prod(x.shape[:-1])
    if M == 0:
        return GemmChoice("torch")
    key = GemmKey(_rows_key(M), n_out, x.shape[-1], str(x.dtype).removeprefix("torch."),
                  activation, bias is not None, residual is not None, weight.stride(-1) != 1)
    capturing = torch.cuda.is_current_stream_capturing()
    if not capturing:
        _disk_path(x.device)
    choice = _CHOICES.get(key)
    if choice is not None and (choice.measured or capturing):
        return choice
    if compiling_only():
        return _queue_once(key, x, weight, bias, activation, residual)
    if capturing:
        loaded = kernels.is_tuned(M, n_out, x.shape[-1], 1, activation, bias is not None, residual is not None,
                                  x.dtype)
        choice = _heuristic_choice(key, loaded)
        _CHOICES[key] = choice
    else:
        choice = _settled_by_neighbours(key) or _measure(key, x, weight, bias, activation, residual)
        _CHOICES[key] = choice
        _save_choices(x.device)
    return choice


def _rows_key(m: int) -> int:
    """The row bucket a choice is keyed on: 1 and 2 rows apart (decode, where the GEMV kernel can
    win), then powers of two from 16 (kernels.m_bucket)."""
    return gemv.gemv_bucket(m) if m <= gemv.GEMV_FAST_M_MAX else kernels.m_bucket(m)


def _settled_by_neighbours(key: GemmKey) -> GemmChoice | None:
    """cuBLAS, without timing, when both neighbouring row buckets (M/2 and 2M) of the same GEMM were
    measured and cuBLAS won both: Triton lost on either side, and timing it here would autotune a
    new key (seconds of compilation while a new input shape waits). Any other case is measured."""
    below = _CHOICES.get(key._replace(m_bucket=key.m_bucket // 2))
    above = _CHOICES.get(key._replace(m_bucket=key.m_bucket * 2))
    sides = [c for c in (below, above) if c is not None and c.measured]
    # cuBLAS's own backends only: a neighbour that chose one of ours ("few_rows" at 16 rows, say) says
    # nothing about cuBLAS winning, and its kernel may not take this bucket's rows at all.
    if sides and all(not _ours(c.backend) for c in sides) and (len(sides) == 2 or key.m_bucket > kernels.MID_M_MAX):
        best = min(sides, key=lambda c: c.times_ms.get(c.backend, 0.0))
        return GemmChoice(best.backend, measured=True, note="cuBLAS won on both neighbouring row buckets")
    return None


# -------------------------------------------------------------------------------------------------
# The op
# -------------------------------------------------------------------------------------------------


@torch.library.custom_op("transfuse::linear", mutates_args=())
def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    activation: str,
    residual: Optional[torch.Tensor],
) -> torch.Tensor:
    """act(x @ weight.T + bias) + residual; see the module docstring for shapes and dispatch."""
    return linear_dispatch(x, weight, bias, activation, residual)


def linear_dispatch(x, weight, bias, activation: str, residual) -> torch.Tensor:
    """The op's body, for ops that end in a linear (transfuse.rms_norm_linear) to call without a
    second trip through the dispatcher."""
    n_out = kernels.check_linear_args(x, weight, bias, activation, residual)
    choice = _choose(x, weight, bias, activation, residual, n_out)
    if choice.backend == "triton":
        return kernels.linear_fwd(x, weight, bias, activation, residual, split_k=choice.split_k, tile=choice.tile)
    if choice.backend == "few_rows":
        return gemm_few_rows.few_rows_fwd(x, weight, bias, activation, residual, split_k=choice.split_k)
    if choice.backend in _DECODE_KERNELS:
        return _DECODE_KERNELS[choice.backend](x, weight, bias, activation, residual)
    return linear_torch(x, weight, bias, activation, residual, cublaslt_epilogue=choice.backend == "torch_lt")


@linear.register_fake
def _(x, weight, bias, activation, residual):
    n_out = kernels.check_linear_args(x, weight, bias, activation, residual)
    return x.new_empty((*x.shape[:-1], n_out))
