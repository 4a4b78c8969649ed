"""A layer whose forward breaks the graph is a frame of its own, and Dynamo reuses that frame's
trace for every layer. Each layer must get its own compile (runtime/instances.py): the merged QKV
buffers and the parameters that view them are per layer. Before, the second call copied layer 1's
weights into layer 0's buffer (the user's weights changed; bart-base fp16 on an H100: logits 1.5e-1
from fp32's after the first call)."""

import torch

import transfuse
from tests.helpers import rel_err


class Layer(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, h):
        b, s, d = h.shape
        q, k, v = (p(h).view(b, s, 2, d // 2).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, d)
        if not torch.isfinite(a).all():  # Python control flow on a tensor's value: a graph break
            a = a.clamp(-1e4, 1e4)
        return h + self.out(a)


class Stack(torch.nn.Module):
    def __init__(self, dim=32, layers=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(dim) for _ in range(layers))

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return h


def test_each_layer_instance_gets_its_own_compile():
    torch.manual_seed(0)
    model = Stack().eval()
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        ref = model(x)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        transfuse.optimize(model, disable=("BranchlessGuard",))  # keep the graph break
        outs = [model(x) for _ in range(3)]
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, weights[k])]
    assert not changed, f"optimize() changed the user's parameters: {changed}"
    for out in outs:
        assert rel_err(out, ref) < 1e-5
    records = model._transfuse_state.backend.records
    assert sum(r.rewrites.get("SiblingLinears", 0) for r in records) >= 3  # every layer's QKV merged
    assert sum(r.instance for r in records) >= 2  # layers 1 and 2 compiled for themselves
    assert "for other instances of a traced module" in transfuse.report(model)


def test_training_through_per_instance_compiles_matches_eager():
    """The same stack trained three SGD steps: losses and parameters as eager's (gradients reach
    every layer's own parameters through its own compile)."""
    import copy

    torch.manual_seed(0)
    model = Stack().train()
    ref = copy.deepcopy(model)
    x, y = torch.randn(2, 9, 32), torch.randn(2, 9, 32)
    transfuse.optimize(model, disable=("BranchlessGuard",))  # keep the graph break
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    for _ in range(3):
        losses = []
        for m, opt in zip((model, ref), opts):
            opt.zero_grad()
            loss = ((m(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1])
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=1e-5)
