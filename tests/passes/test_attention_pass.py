"""The attention pass matches hand-written and SDPA attention by meaning, and leaves alone (with a
reason) what it cannot replace exactly."""

import math
import operator

import pytest
import torch
import torch.nn.functional as F

import transfuse

from tests.helpers import eager_then_optimized, rel_err


class HandWritten(torch.nn.Module):
    """Variants of `softmax(q k^T * scale + mask) v` as models write it."""

    def __init__(self, variant: str, heads: int = 2, dim: int = 16, seq: int = 16):
        super().__init__()
        self.variant, self.heads, self.dim = variant, heads, dim
        self.qkv = torch.nn.Linear(heads * dim, 3 * heads * dim)
        self.register_buffer("tril", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, x, mask=None):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(self.heads * self.dim, dim=-1)
        q, k, v = (z.view(b, t, self.heads, self.dim).transpose(1, 2) for z in (q, k, v))
        v_ = self.variant
        if v_ == "nanogpt":  # nanoGPT: masked_fill(bias == 0, -inf) on a tril buffer
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.tril[:, :, :t, :t] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        elif v_ in ("hf_eager", "hf_eager_bool_added"):  # HF eager_attention_forward: fp32 softmax, additive mask
            att = torch.matmul(q, k.transpose(2, 3)) * self.dim**-0.5
            att = att + mask
            att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
            att = F.dropout(att, p=0.0, training=False)
            y = torch.matmul(att, v)
        elif v_ == "scaled_q":  # scale applied to q before the product, division spelling
            att = (q / math.sqrt(self.dim)) @ k.transpose(-1, -2)
            y = att.softmax(-1) @ v
        elif v_ == "where":
            att = torch.where(mask, q @ k.transpose(-1, -2) / 3.0, float("-inf"))
            y = torch.softmax(att, dim=-1) @ v
        elif v_ == "bmm3d":  # (batch*heads, seq, dim) with torch.bmm
            q3, k3, v3 = (z.reshape(b * self.heads, t, self.dim) for z in (q, k, v))
            att = torch.bmm(q3, k3.transpose(1, 2)) * 0.3
            y = torch.bmm(torch.softmax(att, dim=-1), v3).view(b, self.heads, t, self.dim)
        elif v_ == "bmm_views_floor":  # XGLM/FSMT: 3-D bmm viewed to 4-D for the mask, floored at finfo.min
            q3, k3, v3 = (z.reshape(b * self.heads, t, self.dim) for z in (q, k, v))
            att = torch.bmm(q3 * self.dim**-0.5, k3.transpose(1, 2))
            att = att.view(b, self.heads, t, t) + mask
            att = torch.max(att, torch.full((), torch.finfo(att.dtype).min))
            att = torch.softmax(att.view(b * self.heads, t, t), dim=-1)
            att = att.view(b, self.heads, t, t).view(b * self.heads, t, t)
            y = torch.bmm(F.dropout(att, p=0.0, training=False), v3).view(b, self.heads, t, self.dim)
        elif v_ == "sdpa_gqa":
            y = F.scaled_dot_product_attention(q, k[:, :1], v[:, :1], attn_mask=mask, enable_gqa=True)
        elif v_ == "sdpa_causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2)
        elif v_ == "fill_zero":  # not an exclusion: must be left alone
            att = (q @ k.transpose(-2, -1)).masked_fill(mask, 0.0)
            y = att.softmax(-1) @ v
        elif v_ == "softmax_dim2":  # softmax over queries: not attention
            y = torch.softmax(q @ k.transpose(-2, -1), dim=2) @ v
        return y.transpose(1, 2).reshape(b, t, -1)


CASES = {
    # variant: (mask maker, expected pattern, matches)
    "nanogpt": (None, "ManualAttention", 1),
    "hf_eager": (lambda b, t: torch.where(torch.rand(b, 1, 1, t) > 0.3, 0.0, torch.finfo(torch.float32).min), "ManualAttention", 1),
    "scaled_q": (None, "ManualAttention", 1),
    "where": (lambda b, t: torch.rand(b, 1, t, t) > 0.2, "ManualAttention", 1),
    "bmm3d": (None, "ManualAttention", 1),
    # -inf and finfo.min entries, a fully masked row: the floor makes every masked key weigh the same
    "bmm_views_floor": (lambda b, t: torch.where(torch.rand(b, 1, t, t) > 0.3, 0.0, float("-inf")).index_fill_(
        2, torch.tensor([4]), float("-inf")).index_fill_(3, torch.tensor([1]), torch.finfo(torch.float32).min),
        "ManualAttention", 1),
    "sdpa_gqa": (lambda b, t: torch.rand(1, 1, t, t) > 0.4, "TorchSDPA", 1),
    "sdpa_causal": (None, "TorchSDPA", 1),
    "fill_zero": (lambda b, t: torch.rand(b, 1, t, t) > 0.5, "ManualAttention", 0),
    "softmax_dim2": (None, "ManualAttention", 0),
    # a boolean mask added to the scores is a bias of 0 / 1 in eager, not an exclusion: left alone
    "hf_eager_bool_added": (lambda b, t: torch.rand(b, 1, t, t) > 0.3, "ManualAttention", 0),
}


@pytest.mark.parametrize("variant", list(CASES))
def test_attention_variants(variant):
    make_mask, pattern, matches = CASES[variant]
    b, t = 2, 11
    model = HandWritten(variant).eval()
    x = torch.randn(b, t, 32)
    mask = make_mask(b, t) if make_mask else None
    if variant == "where":
        mask[..., 0] = True  # every query sees at least one key: no all-masked rows here
    ref, out, rewrites, rejections = eager_then_optimized(model, x, mask)
    assert rewrites.get(pattern, 0) == matches
    if matches == 0 and variant == "fill_zero":
        assert any("masked_fill" in r.reason for r in rejections)
    if variant == "hf_eager_bool_added":
        assert any("boolean tensor added" in r.reason for r in rejections)
    assert rel_err(out, ref) < 1e-5


def test_all_masked_rows_match_eager():
    """HF's finfo.min additive mask on a fully padded sequence: eager averages, not NaN."""
    model = HandWritten("hf_eager").eval()
    x = torch.randn(2, 7, 32)
    mask = torch.zeros(2, 1, 1, 7)
    mask[1] = torch.finfo(torch.float32).min
    ref, out, rewrites, _ = eager_then_optimized(model, x, mask)
    assert rewrites["ManualAttention"] == 1
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-5


def test_nan_input_gives_nan_like_eager():
    model = HandWritten("nanogpt").eval()
    x = torch.randn(2, 5, 32)
    x[0, 2, 3] = float("nan")
    ref, out, _, _ = eager_then_optimized(model, x)
    assert torch.equal(torch.isnan(out), torch.isnan(ref))


class GroupedQuery(torch.nn.Module):
    """Grouped-query attention written with Hugging Face's repeat_kv (expand + reshape of the KV
    heads), through SDPA or by hand (k transposed in the product)."""

    def __init__(self, sdpa: bool, heads: int = 4, kv_heads: int = 2, dim: int = 16):
        super().__init__()
        self.sdpa, self.heads, self.kv_heads, self.dim = sdpa, heads, kv_heads, dim
        self.q = torch.nn.Linear(heads * dim, heads * dim)
        self.kv = torch.nn.Linear(heads * dim, 2 * kv_heads * dim)

    @staticmethod
    def repeat_kv(x, n_rep):
        b, h, s, d = x.shape
        return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)

    def forward(self, x, mask):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k, v = (z.view(b, t, self.kv_heads, self.dim).transpose(1, 2) for z in self.kv(x).chunk(2, dim=-1))
        n_rep = self.heads // self.kv_heads
        k, v = self.repeat_kv(k, n_rep), self.repeat_kv(v, n_rep)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            att = torch.matmul(q, k.transpose(2, 3)) * self.dim**-0.5 + mask
            y = torch.matmul(F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype), v)
        return y.transpose(1, 2).reshape(b, t, -1)


@pytest.mark.parametrize("sdpa", [True, False])
def test_grouped_query_reads_kv_heads_without_repeating_them(sdpa):
    torch.manual_seed(0)
    model = GroupedQuery(sdpa).eval()
    x = torch.randn(2, 11, 64)
    mask = torch.randn(2, 1, 11, 11)
    ref, out, rewrites, _ = eager_then_optimized(model, x, mask)
    assert rewrites.get("GroupedKV") == 1, rewrites
    assert rel_err(out, ref) < 1e-5


class OneKVHead(torch.nn.Module):
    """Multi-query attention as Falcon writes it: one key/value head that SDPA broadcasts over the
    query heads (no enable_gqa, no repeat)."""

    def __init__(self, heads=4, dim=16):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.q = torch.nn.Linear(heads * dim, heads * dim)
        self.kv = torch.nn.Linear(heads * dim, 2 * dim)

    def forward(self, x, mask):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k, v = (z.view(b, t, 1, self.dim).transpose(1, 2) for z in self.kv(x).chunk(2, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return y.transpose(1, 2).reshape(b, t, -1)


def test_one_kv_head_broadcast_by_sdpa_is_multi_query_attention():
    torch.manual_seed(0)
    model = OneKVHead().eval()
    x = torch.randn(2, 11, 64)
    mask = torch.randn(2, 1, 11, 11)
    ref, out, rewrites, rejections = eager_then_optimized(model, x, mask)
    assert rewrites.get("TorchSDPA") == 1, (rewrites, rejections)
    assert rel_err(out, ref) < 1e-5


def test_head_dim_above_the_kernels_is_left_to_pytorch():
    """A head dim of 512 (past the 256 whose tiles fit an SM's shared memory; 1024 failed to launch
    on an H200): attention stays PyTorch's, with the reason, and the output is eager's."""
    model = HandWritten("sdpa_causal", heads=1, dim=512, seq=5).eval()
    ref, out, rewrites, rejections = eager_then_optimized(model, torch.randn(1, 5, 512))
    assert rewrites.get("TorchSDPA", 0) == 0
    assert any("head dim 512" in r.reason for r in rejections)
    assert rel_err(out, ref) < 1e-5


class WithSinks(torch.nn.Module):
    """Attention with one sink logit per head (GPT-OSS), in several spellings; GQA 4 -> 2 through
    repeat_kv. `per_query` sinks vary along the queries: not one value per head, left alone."""

    def __init__(self, variant: str, heads: int = 4, kv_heads: int = 2, dim: int = 16):
        super().__init__()
        self.variant, self.heads, self.kv_heads, self.dim = variant, heads, kv_heads, dim
        self.q = torch.nn.Linear(heads * dim, heads * dim)
        self.kv = torch.nn.Linear(heads * dim, 2 * kv_heads * dim)
        self.sinks = torch.nn.Parameter(torch.randn(heads) * 2)

    def forward(self, x, mask):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.dim).transpose(1, 2)
        k, v = (z.view(b, t, self.kv_heads, self.dim).transpose(1, 2) for z in self.kv(x).chunk(2, dim=-1))
        k, v = GroupedQuery.repeat_kv(k, 2), GroupedQuery.repeat_kv(v, 2)
        att = torch.matmul(q, k.transpose(2, 3)) * self.dim**-0.5 + mask
        if self.variant == "per_query":
            sinks = self.sinks[None, :, None, None] * torch.arange(t, dtype=x.dtype)[None, None, :, None]
            sinks = sinks.expand(b, -1, -1, -1)
        else:
            sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, t, -1)
        combined = torch.cat([att, sinks], dim=-1)
        if self.variant in ("hf", "per_query"):  # Hugging Face's GPT-OSS
            combined = combined - combined.max(dim=-1, keepdim=True).values
            probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        elif self.variant == "amax":
            combined = combined - torch.amax(combined, -1, keepdim=True)
            probs = combined.softmax(-1)[:, :, :, :-1]
        elif self.variant == "plain":  # no maximum subtracted
            probs = torch.softmax(combined, dim=-1)[..., :-1]
        y = torch.matmul(F.dropout(probs, p=0.0, training=False), v)
        return y.transpose(1, 2).reshape(b, t, -1)


@pytest.mark.parametrize("variant, matches", [("hf", 1), ("amax", 1), ("plain", 1), ("per_query", 0)])
def test_attention_with_sinks(variant, matches):
    """Rows that see no key (finfo.min padding of row 1) give 0 like eager, not an average."""
    torch.manual_seed(0)
    _sinks_like_eager(WithSinks(variant).eval(), matches)


def _sinks_like_eager(model, matches: int) -> None:
    """Causal attention over 11 tokens with row 1 padded on the left (finfo.min) and one of its
    rows seeing no key: `matches` rewrites, and the output as eager's."""
    x = torch.randn(2, 11, 64)
    mask = torch.zeros(2, 1, 11, 11).masked_fill(torch.ones(11, 11, dtype=torch.bool).triu(1), float("-inf"))
    mask[1, :, :, :4] = torch.finfo(torch.float32).min
    mask[1, :, 2] = torch.finfo(torch.float32).min
    ref, out, rewrites, rejections = eager_then_optimized(model, x, mask)
    assert rewrites.get("ManualAttention", 0) == matches, (rewrites, [r.reason for r in rejections])
    if not matches:
        assert any("ManualAttention" == r.pattern for r in rejections)
    assert rel_err(out, ref) < 1e-5


class WithLseSinks(torch.nn.Module):
    """Granite-SWA's sinks: the value product scaled by sigmoid(logsumexp(scores) - sink), one sink
    per head. `lse_of_raw`: the logsumexp taken before the mask (another meaning: left alone);
    `per_query`: sinks that vary along the queries (left alone); `fp32_product`: the scale left in
    fp32, so the product is not in the output's dtype (left alone)."""

    def __init__(self, variant: str, heads: int = 4, dim: int = 16):
        super().__init__()
        self.variant, self.heads, self.dim = variant, heads, dim
        self.qkv = torch.nn.Linear(heads * dim, 3 * heads * dim)
        self.sinks = torch.nn.Parameter(torch.randn(heads) * 2)

    def forward(self, x, mask):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, self.heads, self.dim).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        raw = torch.matmul(q, k.transpose(2, 3)) * self.dim**-0.5
        att = raw + mask
        lse = torch.logsumexp(raw if self.variant == "lse_of_raw" else att, dim=-1)
        sinks = self.sinks.view(1, -1, 1)
        if self.variant == "per_query":
            sinks = sinks * torch.arange(t, dtype=x.dtype)[None, None, :]
        scale = (lse - sinks).to(torch.float32).sigmoid()
        probs = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v)
        scale = scale.unsqueeze(-1)
        return out * (scale.double() if self.variant == "fp32_product" else scale.to(out.dtype))


@pytest.mark.parametrize("variant,matches", [("granite", 1), ("lse_of_raw", 0), ("per_query", 0),
                                             ("fp32_product", 0)])
def test_attention_with_sinks_after_the_value_product(variant, matches):
    """Rows that see no key (finfo.min padding of row 1) give 0 like eager."""
    torch.manual_seed(0)
    _sinks_like_eager(WithLseSinks(variant).eval(), matches)


def test_granite_swa_attention_with_sinks_matches_eager():
    """Hugging Face's Granite-SWA (eager attention, its sinks applied after the value product, a
    sliding and a full layer): every attention rewritten, logits as eager's."""
    import transformers

    config = transformers.GraniteSWAConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, max_position_embeddings=64, vocab_size=97, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    model = transformers.GraniteSWAForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2)
    _rewritten_like_eager(model, "ManualAttention", 2)
    # the logsumexp that only fed the scale is gone with it: no q @ k^T left outside the kernel
    report = transfuse.report(model)
    assert "FLOPs in transfuse kernels: 100.0%" in report and "logsumexp" not in report, report


def _rewritten_like_eager(model, pattern: str, matches: int) -> None:
    """A causal LM's logits through optimize() equal eager's on a left-padded batch of two, with
    `matches` rewrites of `pattern`."""
    ids = torch.randint(3, 97, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ref, out, rewrites, rejections = eager_then_optimized(model, input_ids=ids, attention_mask=mask)
    assert rewrites.get(pattern) == matches, (rewrites, [r.reason for r in rejections])
    assert rel_err(out.logits[mask.bool()], ref.logits[mask.bool()]) < 1e-5

def test_gpt_oss_attention_with_sinks_matches_eager():
    """Hugging Face's GPT-OSS (eager attention with sinks, a sliding and a full layer, MoE): every
    attention rewritten, logits as eager's."""
    import transformers

    config = transformers.GptOssConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64, vocab_size=97)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        model.model.layers[0].self_attn.sinks.normal_(0, 2)
        model.model.layers[1].self_attn.sinks.normal_(0, 2)
    _rewritten_like_eager(model, "ManualAttention", 2)


def test_deepseek_latent_attention_with_its_own_value_head_dim():
    """DeepSeek-V3's multi-head latent attention: q and k of head dim 24 (16 + 8 rotary), v of 16;
    both layers' SDPA rewritten, logits as eager's (left padding)."""
    import transformers

    config = transformers.DeepseekV3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
        moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64, vocab_size=97)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    _rewritten_like_eager(model, "TorchSDPA", 2)


def test_xglm_attention_viewed_to_heads_matches_eager():
    """Hugging Face's XGLM: 3-D bmm attention viewed to (batch, heads, ...) for its mask and floored
    at finfo.min; both layers rewritten, logits as eager's (left padding)."""
    import transformers

    config = transformers.XGLMConfig(d_model=64, num_layers=2, attention_heads=4, ffn_dim=96,
                                     max_position_embeddings=64, vocab_size=97)
    torch.manual_seed(0)
    model = transformers.XGLMForCausalLM(config).eval()
    _rewritten_like_eager(model, "ManualAttention", 2)


def test_a_router_softmax_is_no_attention_candidate():
    """An MoE router's softmax over 2-D rows (tokens x experts) is neither rewritten nor listed among
    the attention candidates left alone."""

    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(16, 4)

        def forward(self, x):
            return torch.softmax(self.gate(x.view(-1, 16)), dim=-1)

    torch.manual_seed(0)
    ref, out, rewrites, rejections = eager_then_optimized(Router().eval(), torch.randn(2, 5, 16))
    assert not any(r.pattern == "ManualAttention" for r in rejections), rejections
    assert rel_err(out, ref) < 1e-6


class PaddingMaskInside(torch.nn.Module):
    """SDPA with a bool mask built inside the forward from an attention_mask P (batch, seq), as Hugging
    Face's encoders build theirs: "rows" keeps the keys P keeps for every query (indexed with aranges,
    then `&` with an always-true query test and expanded, BERT's form); "window" also keeps only keys
    within 3 positions of the query (ModernBERT's local layers): not a row of kept keys."""

    def __init__(self, variant: str, heads: int = 2, dim: int = 16):
        super().__init__()
        self.variant, self.heads, self.dim = variant, heads, dim
        self.qkv = torch.nn.Linear(heads * dim, 3 * heads * dim)

    def forward(self, x, attention_mask):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, self.heads, self.dim).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        batch_idx = torch.arange(b)[:, None, None, None]
        q_idx = torch.arange(t)[None, None, :, None]
        kv_idx = torch.arange(t)[None, None, None, :]
        keep = attention_mask.bool()[batch_idx, kv_idx] & (q_idx >= 0)
        if self.variant == "window":
            keep = keep & ((q_idx - kv_idx).abs() <= 3)
        mask = keep.expand(b, 1, t, t)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return y.transpose(1, 2).reshape(b, t, -1)


def _padding(b: int, t: int) -> torch.Tensor:
    p = torch.ones(b, t, dtype=torch.long)
    p[0, t - 3:] = 0  # right padding
    p[-1, :2] = 0  # left padding
    return p


@pytest.mark.parametrize("batch", [1, 3])
def test_a_mask_that_keeps_a_row_of_keys_is_read_as_that_row(batch):
    """KeyPadding: the (batch, 1, 1, keys) row inside the mask's computation becomes the attention's
    mask (proven by the compile-time probe), the broadcast over the queries is dead code, and the
    output is eager's, padded rows and a row of no keys included. A batch of one is traced with a
    static batch (Dynamo keeps sizes of 1 static): the probe runs at that size."""
    torch.manual_seed(0)
    model = PaddingMaskInside("rows").eval()
    x = torch.randn(batch, 13, 32)
    p = _padding(batch, 13)
    if batch > 1:
        p[1] = 0  # a sequence that attends to nothing
    ref, out, rewrites, rejections = eager_then_optimized(model, x, p)
    assert rewrites.get("KeyPadding") == 1 and rewrites.get("TorchSDPA") == 1, (rewrites, rejections)
    assert rel_err(out, ref) < 1e-5
    (gm,) = model._transfuse_state.backend.graphs
    (attention,) = [n for n in gm.graph.nodes if "transfuse.attention." in str(n.target)]
    mask = attention.args[3]
    assert tuple(mask.meta["example_value"].shape[1:3]) == (1, 1)
    assert not [n for n in gm.graph.nodes if n.target is operator.and_]  # the broadcast is gone


def test_a_mask_that_depends_on_the_query_is_left_whole():
    """A padding mask combined with a window around each query (probed at lengths beyond the window's
    constant) is no row of kept keys: it stays as the model built it, and the output is eager's."""
    torch.manual_seed(0)
    model = PaddingMaskInside("window").eval()
    x = torch.randn(2, 11, 32)
    ref, out, rewrites, rejections = eager_then_optimized(model, x, _padding(2, 11))
    assert "KeyPadding" not in rewrites and rewrites.get("TorchSDPA") == 1, (rewrites, rejections)
    assert rel_err(out, ref) < 1e-5
