"""torch.ops.transfuse.linear: schema, opcheck, fake implementation, tracing through torch.compile,
the torch/cuBLAS implementation and the dispatcher's decision rule (on CPU, with stand-in timings)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import transfuse.ops.gemm as gemm_ops
from transfuse.kernels.gemm import ACTIVATIONS, is_gated
from transfuse.ops.gemm import GemmKey, gemm_backend, gemm_choices, linear_torch, set_gemm_backend
from transfuse.reference.gemm import linear_ref

ops = torch.ops.transfuse

SCHEMA = "transfuse::linear(Tensor x, Tensor weight, Tensor? bias, str activation, Tensor? residual) -> Tensor"


@pytest.fixture(autouse=True)
def _auto_backend(monkeypatch):
    """Every test starts from the default backend choice, whatever the environment says."""
    monkeypatch.delenv(gemm_ops.BACKEND_ENV, raising=False)
    previous = set_gemm_backend(None)
    yield
    set_gemm_backend(previous)


def test_schema():
    assert str(ops.linear.default._schema) == SCHEMA


def _cases():
    """(x, weight, bias, activation, residual) covering every optional, 3-D and strided inputs."""
    x = torch.randn(2, 5, 40)
    w, b, r = torch.randn(24, 40) / 6, torch.randn(24), torch.randn(2, 5, 24)
    w2, b2 = torch.randn(48, 40) / 6, torch.randn(48)
    qkv = torch.randn(7, 120)
    strided_r = torch.randn(24, 7).t()
    return [
        (x, w, None, "none", None),
        (x, w, b, "gelu", r),
        (x, w2, b2, "silu_mul", r),
        (qkv[:, 40:80], w, b, "relu", strided_r),
        (x.half(), w.half(), b.half(), "gelu_tanh", None),
        (x[0], w, None, "tanh", r[1]),
    ]


CASE_IDS = [f"{case[3]}-{i}" for i, case in enumerate(_cases())]


@pytest.mark.parametrize("case", range(len(CASE_IDS)), ids=CASE_IDS)
def test_opcheck(case):
    torch.library.opcheck(ops.linear.default, _cases()[case])


@pytest.mark.parametrize("case", range(len(CASE_IDS)), ids=CASE_IDS)
def test_op_matches_reference(case):
    x, w, b, act, r = _cases()[case]
    out = ops.linear(x, w, b, act, r)
    gold = linear_ref(x, w, b, act, r, upcast=True)
    torch.testing.assert_close(out.float(), gold, **({} if x.dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)))


@pytest.mark.parametrize("case", range(len(CASE_IDS)), ids=CASE_IDS)
def test_fake_matches_real(case):
    args = _cases()[case]
    real = ops.linear(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = ops.linear(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
    assert real.is_contiguous()


def test_fake_rejects_bad_shapes():
    with FakeTensorMode() as mode:
        x, w = mode.from_tensor(torch.randn(5, 40)), mode.from_tensor(torch.randn(24, 16))
        with pytest.raises(ValueError):
            ops.linear(x, w, None, "none", None)


def test_traces_through_torch_compile():
    x, w, b, _, r = _cases()[1]

    def f(x, w, b, r):
        return ops.linear(x, w, b, "gelu", r) * 2

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, w, b, r), f(x, w, b, r))


# ---------------------------------------------------------------------------------------------
# The torch/cuBLAS implementation


@pytest.mark.parametrize("cublaslt_epilogue", [False, True])
@pytest.mark.parametrize("has_bias,has_residual", [(False, False), (True, True)])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_torch(activation, has_bias, has_residual, cublaslt_epilogue):
    rows = 48 if is_gated(activation) else 24
    x = torch.randn(3, 7, 40)
    w = torch.randn(rows, 40) / 6
    b = torch.randn(rows) if has_bias else None
    r = torch.randn(3, 7, 24) if has_residual else None
    out = linear_torch(x, w, b, activation, r, cublaslt_epilogue=cublaslt_epilogue)
    assert out.shape == (3, 7, 24) and out.is_contiguous()
    torch.testing.assert_close(out, linear_ref(x, w, b, activation, r))


def test_cublaslt_epilogue_only_where_exact():
    x, b = torch.randn(2, 4), torch.randn(3)
    assert gemm_ops.cublaslt_epilogue_applies(x, b, "relu")
    # on CPU torch._addmm_activation's GELU is the erf one: not the tanh approximation asked for
    assert not gemm_ops.cublaslt_epilogue_applies(x, b, "gelu_tanh")
    assert not gemm_ops.cublaslt_epilogue_applies(x, b, "gelu")
    assert not gemm_ops.cublaslt_epilogue_applies(x, None, "relu")


# ---------------------------------------------------------------------------------------------
# Backend override and dispatch rule


def test_backend_override(monkeypatch):
    assert gemm_backend() == "auto"
    monkeypatch.setenv(gemm_ops.BACKEND_ENV, "torch")
    assert gemm_backend() == "torch"
    set_gemm_backend("triton")  # the programmatic setting wins over the environment
    assert gemm_backend() == "triton"
    with pytest.raises(ValueError):
        set_gemm_backend("cutlass")
    set_gemm_backend(None)
    monkeypatch.setenv(gemm_ops.BACKEND_ENV, "cublas")
    with pytest.raises(ValueError, match=gemm_ops.BACKEND_ENV):
        gemm_backend()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_forced_backend_runs_that_path(backend, monkeypatch):
    calls = []
    monkeypatch.setattr(gemm_ops.kernels, "linear_fwd", lambda *a, **k: calls.append("triton") or linear_torch(*a[:5]))
    monkeypatch.setattr(gemm_ops, "linear_torch", lambda *a, **k: calls.append("torch") or linear_ref(*a[:5]))
    monkeypatch.setenv(gemm_ops.BACKEND_ENV, backend)
    x, w, b, act, r = _cases()[1]
    ops.linear(x, w, b, act, r)
    assert calls == [backend]


@pytest.mark.parametrize("times,expected", [
    ({"torch": 1.0, "triton/split_k=1": 0.9, "triton/split_k=2": 0.8}, ("triton", 2)),
    ({"torch": 1.0, "triton/split_k=1": 0.7, "triton/split_k=2": 0.8}, ("triton", 1)),
    ({"torch": 1.0, "triton/split_k=1": 0.99, "triton/split_k=2": 1.5}, ("torch", 1)),  # within MARGIN
    ({"torch": 1.0, "torch_lt": 0.8, "triton/split_k=1": 0.9, "triton/split_k=2": 2.0}, ("torch_lt", 1)),
])
def test_measured_choice(times, expected, monkeypatch):
    """The decision rule on CPU tensors: every candidate is warmed up (so really run), the timings
    are stand-ins, and Triton must beat the best torch candidate by MARGIN."""
    monkeypatch.setattr(gemm_ops.kernels, "default_split_k", lambda *a: 2)
    seen = {}

    def fake_times(candidates, device):
        seen.update(candidates)
        return {name: times[name] for name in candidates}

    monkeypatch.setattr(gemm_ops, "_gpu_times_ms", fake_times)
    monkeypatch.setattr(gemm_ops, "cublaslt_epilogue_applies", lambda *a: "torch_lt" in times)
    x, w, b, _, r = _cases()[1]
    x2 = x.reshape(-1, 40)
    key = GemmKey(16, 24, 40, "float32", "relu", True, True)
    choice = gemm_ops._measure(key, x2, w, b, "relu", r.reshape(-1, 24))
    assert set(seen) == set(times)
    assert (choice.backend, choice.split_k) == expected and choice.measured
    assert choice.times_ms == times


@pytest.mark.parametrize("measure_all", [False, True])
def test_triton_timed_only_for_few_rows(measure_all, monkeypatch):
    """Above TRITON_MAX_ROWS only cuBLAS is timed (no Triton compile while a new shape waits),
    unless TRANSFUSE_GEMM_MEASURE_ALL asks for every candidate."""
    if measure_all:
        monkeypatch.setenv(gemm_ops.MEASURE_ALL_ENV, "1")
    else:
        monkeypatch.delenv(gemm_ops.MEASURE_ALL_ENV, raising=False)
    seen = {}
    monkeypatch.setattr(gemm_ops, "_gpu_times_ms", lambda c, d: seen.update(c) or {n: 1.0 for n in c})
    x, w, b, _, r = _cases()[1]
    for m_bucket in (gemm_ops.TRITON_MAX_ROWS, 2 * gemm_ops.TRITON_MAX_ROWS):
        seen.clear()
        key = GemmKey(m_bucket, 24, 40, "float32", "gelu", True, True)
        gemm_ops._measure(key, x, w, b, "gelu", r)
        timed_triton = any(n.startswith("triton") for n in seen)
        assert timed_triton == (m_bucket <= gemm_ops.TRITON_MAX_ROWS or measure_all), (m_bucket, seen)


def test_gated_units_timed_against_triton_at_every_size(monkeypatch):
    """A gated unit (SwiGLU) is timed against Triton above TRITON_MAX_ROWS too: cuBLAS runs it as a GEMM
    and two elementwise kernels, and Triton's one kernel can win there (Llama's gate_up at 2,048 rows)."""
    monkeypatch.delenv(gemm_ops.MEASURE_ALL_ENV, raising=False)
    seen = {}
    monkeypatch.setattr(gemm_ops, "_gpu_times_ms", lambda c, d: seen.update(c) or {n: 1.0 for n in c})
    x = torch.randn(5, 40)
    w = torch.randn(48, 40) * 40**-0.5
    key = GemmKey(4 * gemm_ops.TRITON_MAX_ROWS, 24, 40, "float32", "silu_mul", False, False)
    choice = gemm_ops._measure(key, x, w, None, "silu_mul", None)
    assert any(n.startswith("triton") for n in seen) and "torch" in seen, seen
    assert choice.backend == "torch"  # a tie goes to cuBLAS (MARGIN)


@pytest.mark.parametrize("rows,expected", [(1, "gemv"), (2, "gemv"), (3, "few_rows"), (16, "few_rows"),
                                           (32, "few_rows"), (33, None)])
def test_decode_kernels_timed_by_row_count(rows, expected, monkeypatch):
    """The GEMV is a candidate at 1-2 rows, the few-rows tensor-core GEMM at 3-32 (16-bit), neither
    above; when one of them is fastest by the margin it is the choice, and the op runs it."""
    times = {}

    def fake_times(candidates, device):
        times.update({name: (0.5 if name in ("gemv", "few_rows") else 1.0) for name in candidates})
        return dict(times)

    monkeypatch.setattr(gemm_ops, "_gpu_times_ms", fake_times)
    x = torch.randn(rows, 40).half()
    w = (torch.randn(24, 40) * 40**-0.5).half()
    key = GemmKey(gemm_ops._rows_key(rows), 24, 40, "float16", "none", False, False)
    choice = gemm_ops._measure(key, x, w, None, "none", None)
    ours = {n for n in times if n in ("gemv", "few_rows")}
    assert ours == ({expected} if expected else set())
    assert choice.backend == (expected or "torch")


def test_few_rows_split_is_timed_and_run(monkeypatch):
    """A split of the few-rows kernel is a candidate of its own; when it wins, the choice keeps its
    split and the op launches with it."""
    from transfuse.kernels import gemm_few_rows

    monkeypatch.setattr(gemm_few_rows, "split_candidates", lambda *a: [1, 3])
    monkeypatch.setattr(gemm_ops, "_gpu_times_ms",
                        lambda c, d: {n: (0.4 if n == "few_rows/split_k=3" else 1.0) for n in c})
    x = torch.randn(8, 40).half()
    w = (torch.randn(24, 40) * 40**-0.5).half()
    key = GemmKey(gemm_ops._rows_key(8), 24, 40, "float16", "none", False, False)
    choice = gemm_ops._measure(key, x, w, None, "none", None)
    assert (choice.backend, choice.split_k, choice.tile) == ("few_rows", 3, None)
    assert {"few_rows", "few_rows/split_k=3"} <= set(choice.times_ms)
    calls = []
    monkeypatch.setattr(gemm_few_rows, "few_rows_fwd", lambda *a, **k: calls.append(k) or linear_ref(*a[:5]))
    monkeypatch.setattr(gemm_ops, "_choose", lambda *a: choice)
    ops.linear(x, w, None, "none", None)
    assert calls == [{"split_k": 3}]


def test_measure_falls_back_when_triton_fails(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for you")

    monkeypatch.setattr(gemm_ops.kernels, "linear_fwd", broken)
    monkeypatch.setattr(gemm_ops, "_gpu_times_ms", lambda candidates, device: {n: 1.0 for n in candidates})
    x, w, b, _, r = _cases()[1]
    key = GemmKey(16, 24, 40, "float32", "gelu", True, True)
    with pytest.warns(UserWarning, match="no kernel for you"):
        choice = gemm_ops._measure(key, x, w, b, "gelu", r)
    assert choice.backend == "torch" and "RuntimeError" in choice.note


def test_heuristic_choice_is_deterministic():
    bare = GemmKey(4096, 2304, 768, "float16", "none", True, False)
    ffn1 = GemmKey(4096, 3072, 768, "float16", "gelu", True, False)
    ffn2_small = GemmKey(16, 768, 3072, "float16", "none", True, True)
    assert gemm_ops._heuristic_choice(bare, triton_loaded=True).backend == "torch"
    assert gemm_ops._heuristic_choice(ffn1, triton_loaded=True).backend == "triton"
    # a kernel never launched must not be launched inside a capture
    assert gemm_ops._heuristic_choice(ffn1, triton_loaded=False).backend == "torch"
    assert gemm_ops._heuristic_choice(ffn2_small, triton_loaded=True).backend == "torch"
    assert not gemm_ops._heuristic_choice(ffn1, triton_loaded=True).measured


def test_gemm_choices_is_a_copy():
    choices = gemm_choices()
    choices[GemmKey(1, 1, 1, "float32", "none", False, False)] = None
    assert GemmKey(1, 1, 1, "float32", "none", False, False) not in gemm_choices()


def test_dispatch_reuses_cublas_between_measured_neighbours():
    """A row bucket between two where cuBLAS won is not timed (no Triton autotuning for a new shape);
    next to one where Triton won it is."""
    from transfuse.ops import gemm as dispatch

    saved = dict(dispatch._CHOICES)
    try:
        dispatch._CHOICES.clear()
        key = dispatch.GemmKey(256, 768, 768, "float16", "gelu", True, False)
        dispatch._CHOICES[key._replace(m_bucket=128)] = dispatch.GemmChoice("torch", measured=True, times_ms={"torch": 1.0})
        assert dispatch._settled_by_neighbours(key) is None  # one side only, mid regime: measure
        dispatch._CHOICES[key._replace(m_bucket=512)] = dispatch.GemmChoice("torch", measured=True, times_ms={"torch": 2.0})
        assert dispatch._settled_by_neighbours(key).backend == "torch"
        dispatch._CHOICES[key._replace(m_bucket=512)] = dispatch.GemmChoice("triton", measured=True)
        assert dispatch._settled_by_neighbours(key) is None
        # a neighbour won by the few-rows kernel (32 rows) is not cuBLAS winning, and that kernel
        # takes at most 32 rows: 64 rows are measured, never handed its choice
        small = key._replace(m_bucket=64)
        dispatch._CHOICES[small._replace(m_bucket=32)] = dispatch.GemmChoice("few_rows", measured=True,
                                                                              times_ms={"few_rows": 1.0})
        dispatch._CHOICES[small._replace(m_bucket=128)] = dispatch.GemmChoice("torch", measured=True,
                                                                              times_ms={"torch": 2.0})
        assert dispatch._settled_by_neighbours(small) is None
        large = key._replace(m_bucket=8192)
        dispatch._CHOICES[large._replace(m_bucket=4096)] = dispatch.GemmChoice("torch", measured=True, times_ms={"torch": 3.0})
        assert dispatch._settled_by_neighbours(large).backend == "torch"  # large rows: one side suffices
    finally:
        dispatch._CHOICES.clear()
        dispatch._CHOICES.update(saved)


def test_dry_run_queues_each_distinct_launch_once(monkeypatch):
    """In a precompile dry run the dispatcher queues a launch's candidate compiles the first time it
    meets it; the same GEMM in a later layer (or bucket of the same rows) queues nothing again, while
    other rows, another operand layout or misalignment, and a new dry run queue again."""
    from transfuse.kernels._config import dry_run_launches

    queued = []
    monkeypatch.setattr(gemm_ops, "_queue_compiles", lambda key, x, *rest: queued.append((key, tuple(x.shape))))
    key = GemmKey(16, 24, 32, "float16", "none", True, False)
    weight, bias = torch.randn(24, 32), torch.randn(24)
    x16, x8 = torch.randn(16, 32), torch.randn(8, 32)
    wide = torch.randn(16, 64)
    with dry_run_launches():
        for _ in range(3):  # three layers
            gemm_ops._queue_once(key, x16, weight, bias, "none", None)
        gemm_ops._queue_once(key, x8, weight, bias, "none", None)  # other rows, same bucket key
        gemm_ops._queue_once(key, wide[:, :32], weight, bias, "none", None)  # a strided view
        gemm_ops._queue_once(key, torch.randn(16 * 32 + 1)[1:].view(16, 32), weight, bias, "none", None)  # misaligned
    assert [shape for _, shape in queued] == [(16, 32), (8, 32), (16, 32), (16, 32)]
    with dry_run_launches():
        gemm_ops._queue_once(key, x16, weight, bias, "none", None)
    assert len(queued) == 5, "a new dry run must queue again"
    gemm_ops._queue_once(key, x16, weight, bias, "none", None)  # outside any dry run: never skipped
    assert len(queued) == 6


def test_a_lone_candidate_is_not_timed(monkeypatch):
    """Above TRITON_MAX_ROWS with an epilogue cuBLASLt cannot fuse, cuBLAS is the only candidate:
    it is chosen without timing (each timing costs GPU sleeps and synchronisations while a new
    bucket's capture waits)."""
    monkeypatch.delenv(gemm_ops.MEASURE_ALL_ENV, raising=False)
    monkeypatch.setattr(gemm_ops, "cublaslt_epilogue_applies", lambda *a: False)
    monkeypatch.setattr(gemm_ops, "_gpu_times_ms", lambda c, d: pytest.fail(f"timed {sorted(c)}"))
    x, w, b, _, r = _cases()[1]
    key = GemmKey(2 * gemm_ops.TRITON_MAX_ROWS, 24, 40, "float32", "gelu", True, True)
    choice = gemm_ops._measure(key, x, w, b, "gelu", r)
    assert (choice.backend, choice.measured) == ("torch", True)
