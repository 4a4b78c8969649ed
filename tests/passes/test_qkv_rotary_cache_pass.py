"""The QKVRotaryCache pass on hand-built FX graphs of the form the norm_linear and kv_cache passes
leave (a norm + merged Q/K/V linear, views into heads, rotary_kv_cache_write): fused when q, k and v
are the [q | k | v] head-major blocks of the output and nothing else reads it, with the same cache
contents and rotated queries as the unfused graph; left alone, with the reason, otherwise."""

import operator

import pytest
import torch
import torch.fx as fx

from transfuse.passes import qkv_rotary_cache
from transfuse.passes.manager import PassContext
from transfuse.passes.graph import remove_dead_code

OPS = torch.ops.transfuse
B, n, K, HQ, HK, D, L = 1, 1, 40, 4, 2, 16, 9


def _inputs():
    g = torch.Generator().manual_seed(0)
    N = (HQ + 2 * HK) * D
    angle = torch.randn(1, 1, n, D // 2, generator=g) * 10
    angle = torch.cat((angle, angle), dim=-1)
    return dict(x=torch.randn(B, n, K, generator=g), norm_weight=torch.rand(K, generator=g) + 0.5,
                norm_bias=torch.randn(K, generator=g),
                weight=torch.randn(N, K, generator=g) / K ** 0.5, keys=torch.randn(B, HK, L, D, generator=g),
                values=torch.randn(B, HK, L, D, generator=g), cos=angle.cos(), sin=angle.sin(),
                start=torch.tensor(3))


def _graph(order=("q", "k", "v"), extra_reader=False, layer_norm=False) -> fx.GraphModule:
    """The heads taken from the output's column blocks in `order`; `extra_reader`: the graph also
    returns the linear's output; `layer_norm`: a LayerNorm (with bias) feeds the linear."""
    graph = fx.Graph()
    p = {name: graph.placeholder(name) for name in _inputs()}
    if layer_norm:
        nl = graph.call_function(OPS.layer_norm_linear.default, (p["x"], None, p["norm_weight"], p["norm_bias"], 1e-5,
                                                                  p["weight"], None, "none"))
    else:
        nl = graph.call_function(OPS.rms_norm_linear.default, (p["x"], None, p["norm_weight"], 1e-6, 0.0, True,
                                                                p["weight"], None, "none"))
    out = graph.call_function(operator.getitem, (nl, 0))
    heads = {"q": HQ, "k": HK, "v": HK}
    views, start = {}, 0
    for name in order:
        piece = graph.call_method("narrow", (out, -1, start, heads[name] * D))
        views[name] = graph.call_method("transpose", (graph.call_method("view", (piece, B, n, heads[name], D)), 1, 2))
        start += heads[name] * D
    write = graph.call_function(OPS.rotary_kv_cache_write.default, (p["keys"], p["values"], views["q"], views["k"],
                                                                    views["v"], p["cos"], p["sin"], p["start"]))
    graph.output((write, out) if extra_reader else write)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    _record_examples(gm)
    return gm


def _record_examples(gm):
    """meta["example_value"] of every node, as Dynamo records it (here real CPU tensors)."""
    env = {}
    values = _inputs()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = values[node.name].clone()
        elif node.op in ("call_function", "call_method"):
            args = fx.node.map_arg(node.args, env.__getitem__)
            env[node] = getattr(args[0], node.target)(*args[1:]) if node.op == "call_method" else node.target(*args)
        else:
            continue
        node.meta["example_value"] = env[node]


def _run(gm):
    values = {k: v.clone() for k, v in _inputs().items()}
    result = gm(*values.values())
    q = result[0] if isinstance(result, tuple) else result
    return q, values["keys"], values["values"]


def _apply(gm):
    ctx = PassContext(gm=gm, example_inputs=list(_inputs().values()), options={})
    qkv_rotary_cache.run(ctx)
    remove_dead_code(gm.graph)
    gm.recompile()
    return ctx


@pytest.mark.parametrize("layer_norm", [False, True], ids=["rms_norm", "layer_norm"])
def test_fused_graph_gives_the_unfused_results(layer_norm):
    gm = _graph(layer_norm=layer_norm)
    before = _run(gm)
    ctx = _apply(gm)
    assert ctx.rewrites[qkv_rotary_cache.PATTERN] == 1 and not ctx.rejections
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert OPS.qkv_rotary_cache_write.default in targets and OPS.rotary_kv_cache_write.default not in targets
    for a, b in zip(_run(gm), before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs,reason", [
    (dict(order=("k", "q", "v")), "head-major column blocks"),
    (dict(extra_reader=True), "read by more than"),
])
def test_other_layouts_and_readers_are_left_alone(kwargs, reason):
    gm = _graph(**kwargs)
    ctx = _apply(gm)
    assert not ctx.rewrites
    assert [r.pattern for r in ctx.rejections] == [qkv_rotary_cache.PATTERN] and reason in ctx.rejections[0].reason
    assert OPS.rotary_kv_cache_write.default in [n.target for n in gm.graph.nodes]
