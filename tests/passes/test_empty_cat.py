"""EmptyCat: torch.cat of one tensor with empty 1-D tensors (Hugging Face's DynamicCache's first
append) becomes that tensor cast to the promoted dtype, and a cast back to its own dtype folds away."""

import torch

import transfuse


class _FirstAppend(torch.nn.Module):
    def forward(self, k, v):
        keys = torch.cat([torch.tensor([]), k], dim=-2)  # fp32 empty: promotes bf16 to fp32
        values = torch.cat([torch.tensor([]), v], dim=-2)
        return keys, values, keys.to(torch.bfloat16) * 3.0


def test_cat_with_an_empty_tensor_is_a_cast():
    k = torch.randn(2, 3, 5, 8).to(torch.bfloat16)
    v = torch.randn(2, 3, 5, 8)
    model = _FirstAppend().eval()
    ref = model(k, v)
    transfuse.optimize(model, dynamic=False)
    out = model(k, v)
    for a, b in zip(out, ref):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert model._transfuse_state.backend.records[0].rewrites["EmptyCat"] == 2
    graph = model._transfuse_state.backend.graphs[0].graph
    assert not [n for n in graph.nodes if n.target is torch.cat]


class _AppendThenWrite(torch.nn.Module):
    def forward(self, k):
        keys = torch.cat([torch.tensor([]), k], dim=-2)
        keys.mul_(2.0)  # an alias of k would change k too
        return keys, k + 0.0


def test_a_cat_result_written_in_place_stays_a_copy():
    k = torch.randn(2, 3, 5, 8)
    model = _AppendThenWrite().eval()
    ref = model(k.clone())
    transfuse.optimize(model, dynamic=False)
    out = model(k.clone())
    for a, b in zip(out, ref):
        assert torch.equal(a, b)
