"""RMSNorm as each family writes it -> transfuse.rms_norm / add_rms_norm, with outputs equal to eager;
look-alikes are left alone."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import eager_then_optimized, optimize_and_run, rel_err


class Norm(torch.nn.Module):
    def __init__(self, style: str, n: int = 40, eps: float = 1e-6):
        super().__init__()
        self.style, self.eps = style, eps
        self.weight = torch.nn.Parameter(torch.randn(n) * 0.3 + (0.0 if style == "gemma" else 1.0))
        self.proj = torch.nn.Linear(n, n)

    def norm(self, x):
        s = self.style
        if s == "llama":  # LlamaRMSNorm
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * h.to(x.dtype)
        if s == "gemma":  # GemmaRMSNorm: (1 + weight), product in fp32, cast last
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return (h * (1.0 + self.weight.float())).type_as(x)
        if s == "t5":  # T5LayerNorm: the input itself is scaled
            variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
            h = x * torch.rsqrt(variance + self.eps)
            if self.weight.dtype in (torch.float16, torch.bfloat16):
                h = h.to(self.weight.dtype)
            return self.weight * h
        if s == "square_by_mul":
            h = x.float()
            return self.weight * (h * torch.rsqrt((h * h).mean(dim=-1, keepdim=True) + self.eps)).to(x.dtype)
        if s == "functional":
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if s == "mean_over_rows":  # not an RMSNorm: statistics over dim 1
            h = x.float()
            return self.weight * (h * torch.rsqrt(h.pow(2).mean(1, keepdim=True) + self.eps)).to(x.dtype)
        if s == "no_keepdim":  # broadcasting a (B, S) rsqrt against (B, S, N): not a row norm
            h = x.float()
            return h * torch.rsqrt(h.pow(2).mean(-1) + self.eps)[..., None, None].mean(-1)
        raise ValueError(s)

    def forward(self, x):
        y = self.norm(x)                 # plain
        r = x + self.proj(y)             # pre-norm residual stream: the sum is read again below
        return self.norm(r) + r


MATCHING = ["llama", "gemma", "t5", "square_by_mul", "functional"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("style", MATCHING)
def test_rms_norm_styles(style, dtype):
    torch.manual_seed(0)
    model = Norm(style).eval().to(dtype)
    x = torch.randn(2, 7, 40).to(dtype)
    ref, out, rewrites, rejections = eager_then_optimized(model, x)
    assert rewrites["RMSNorm"] == 1 and rewrites["ResidualRMSNorm"] == 1
    assert out.dtype == ref.dtype
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("style", ["mean_over_rows"])
def test_look_alikes_left_alone(style):
    torch.manual_seed(0)
    model = Norm(style).eval()
    x = torch.randn(2, 7, 40)
    ref, out, rewrites, _ = eager_then_optimized(model, x)
    assert rewrites["RMSNorm"] == 0 and rewrites["ResidualRMSNorm"] == 0
    assert rel_err(out, ref) < 1e-6


class NormThenCopy(torch.nn.Module):
    """HrmText's norm (no weight) whose output is copied to another device right after."""

    def __init__(self, device: str):
        super().__init__()
        self.device = device

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x).to(self.device)


def test_copy_to_another_device_is_not_folded_into_the_norm():
    # The kernel returns its input's device: a `.to(device)` that moves the result must stay in the
    # graph (and a probe of the norm must not follow it there). "meta" stands for a second device.
    torch.manual_seed(0)
    x = torch.randn(2, 5, 40)
    out, rewrites, _ = optimize_and_run(NormThenCopy("meta"), x)
    assert out.device.type == "meta"
    assert rewrites["RMSNorm"] == 1


def test_probe_of_a_cast_that_names_the_graph_device_stays_on_the_host():
    # On a GPU, HrmText's graph ends its norm with `.to(device("cuda:0"))`, a no-op there; the
    # pass replays the region on host probes, which must not be sent to the GPU by it.
    import torch.fx as fx

    from transfuse.passes.graph import evaluate, kind

    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = torch.empty(2, 8, device="meta")
    up = graph.call_method("float", (x,))
    up.meta["example_value"] = torch.empty(2, 8, device="meta")
    moved = graph.call_method("to", (up, "meta"))
    moved.meta["example_value"] = torch.empty(2, 8, device="meta")
    graph.output(moved)
    assert kind(moved) == "to"
    probe = torch.randn(2, 8)
    got = evaluate([up, moved], moved, {x: probe})
    assert got.device.type == "cpu" and torch.equal(got, probe)
    # Recorded on another device than its input: a copy, not a cast.
    moved.meta["example_value"] = torch.empty(2, 8)
    up.meta["example_value"] = torch.empty(2, 8, device="meta")
    assert kind(moved) == "to_device"
