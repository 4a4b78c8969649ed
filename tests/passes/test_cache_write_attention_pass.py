"""The cache_write_attention pass on hand-built FX graphs of the form the kv_cache and qkv_rotary_cache
passes leave (rotary_kv_cache_write or kv_cache_write, then an attention over the written cache): fused into one op
with the same output and cache contents as the unfused graph; left alone, with the reason, when the
attention reads another cache, the rotated queries have another reader, or an in-place write in
between would move across the fused op."""

import torch
import torch.fx as fx

from transfuse.passes import cache_write_attention
from transfuse.passes.graph import remove_dead_code
from transfuse.passes.manager import PassContext

OPS = torch.ops.transfuse
B, n, HQ, HK, D, L = 3, 1, 4, 2, 16, 24


def _inputs():
    g = torch.Generator().manual_seed(0)
    angle = torch.randn(B, 1, n, D // 2, generator=g) * 10
    angle = torch.cat((angle, angle), dim=-1)
    return dict(q=torch.randn(B, HQ, n, D, generator=g), k=torch.randn(B, HK, n, D, generator=g),
                v=torch.randn(B, HK, n, D, generator=g), cos=angle.cos(), sin=angle.sin(),
                keys=torch.randn(B, HK, L, D, generator=g), values=torch.randn(B, HK, L, D, generator=g),
                other=torch.randn(B, HK, L, D, generator=g), start=torch.tensor(7),
                key_len=torch.tensor([8], dtype=torch.int32))


def _graph(read_keys="keys", extra_reader=False, bump_between=(), plain=False, size_read=False) -> fx.GraphModule:
    """`read_keys`: the placeholder the attention reads as keys; `extra_reader`: the graph also returns
    the rotated queries; `bump_between`: placeholders incremented in place between the two ops;
    `plain`: kv_cache_write (no rotary) and the attention on q as it is; `size_read`: the cache's
    length asked in between (BART's mask summary does)."""
    graph = fx.Graph()
    p = {name: graph.placeholder(name) for name in _inputs()}
    if plain:
        graph.call_function(OPS.kv_cache_write.default, tuple(p[a] for a in ("keys", "values", "k", "v", "start")))
        q_rot = p["q"]
    else:
        q_rot = graph.call_function(OPS.rotary_kv_cache_write.default, tuple(p[a] for a in (
            "keys", "values", "q", "k", "v", "cos", "sin", "start")))
    for name in bump_between:
        graph.call_method("add_", (p[name], 1))
    if size_read:
        graph.call_method("size", (p["values"], -2))
    out = graph.call_function(OPS.attention.default, (q_rot, p[read_keys], p["values"], None, None, 0.25, False, True),
                              {"key_len": p["key_len"]})
    graph.output((out, q_rot) if extra_reader else out)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    gm.graph.lint()
    return gm


def _run(gm):
    values = {k: v.clone() for k, v in _inputs().items()}
    result = gm(*values.values())
    out = result[0] if isinstance(result, tuple) else result
    return out, values["keys"], values["values"]


def _apply(gm):
    ctx = PassContext(gm=gm, example_inputs=[], options={})
    cache_write_attention.run(ctx)
    remove_dead_code(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return ctx


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_fused_with_the_same_output_and_cache():
    for plain, pattern, op in [(False, "RotaryCacheAttention", OPS.rotary_cache_attention.default),
                               (True, "KVCacheAttention", OPS.kv_cache_attention.default)]:
        gm = _graph(plain=plain)
        ref = _run(gm)
        ctx = _apply(gm)
        assert ctx.rewrites[pattern] == 1
        assert _targets(gm) == [op]
        out = _run(gm)
        for got, want in zip(out, ref):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_an_increment_in_between_decides_where_the_fused_op_goes():
    """HF bumps the cache length after its write: the fused op goes where the write was, before the
    bump (at the attention it would write one position too far); an increment of an attention input
    (key_len) puts it where the attention was (at the write it would read the old length)."""
    for bumped, first, plain in [("start", True, False), ("key_len", False, False), ("key_len", False, True)]:
        gm = _graph(bump_between=(bumped,), plain=plain, size_read=plain)  # a size query of the cache is no read
        ref = _run(gm)
        assert _apply(gm).rewrites["KVCacheAttention" if plain else "RotaryCacheAttention"] == 1
        nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
        op = OPS.kv_cache_attention.default if plain else OPS.rotary_cache_attention.default
        assert [n.target for n in nodes] == ([op, "add_"] if first else ["add_", op])
        for got, want in zip(_run(gm), ref):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_left_alone_with_the_reason():
    for kwargs, reason in [(dict(read_keys="other"), "other keys or values"),
                           (dict(extra_reader=True), "read by more than the attention"),
                           (dict(bump_between=("key_len", "start")), "writes or reads their inputs"),
                           (dict(plain=True, read_keys="other"), None),
                           (dict(plain=True, bump_between=("key_len", "start")), "writes or reads their inputs")]:
        gm = _graph(**kwargs)
        ctx = _apply(gm)
        assert "RotaryCacheAttention" not in ctx.rewrites and "KVCacheAttention" not in ctx.rewrites, kwargs
        assert reason is None or any(reason in r.reason for r in ctx.rejections), (kwargs, ctx.rejections)
        assert OPS.attention.default in _targets(gm)
