"""transfuse.qkv_rotary_cache_write (kernels/qkv_rotary_cache.py): the norm, merged Q/K/V GEMV,
rotary and cache write of a decode step in one launch, against the two ops it replaces
(rms_norm_linear or layer_norm_linear, then rotary_kv_cache_write) run on the same inputs. On the
CPU through the interpreter: bit for bit (the same per-column sums and roundings). On the GPU
(marked gpu, real attention sizes): against fp32, within the unfused pair's own error. Odd sizes:
K not a power of two, head dims 16, 24 (a half of 12), 64, 80 and 128, GQA, bias (Qwen2), starts
that run past the cache's end."""

import pytest
import torch

from transfuse.kernels import qkv_rotary_cache

OPS = torch.ops.transfuse


def _case(device, dtype, B, n, K, HQ, HK, D, L, start, residual, bias, layer_norm, batch_cos, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    N = (HQ + 2 * HK) * D
    x = randn(B, n, K)
    args = dict(
        x=x, residual=randn(B, n, K) if residual else None,
        norm_weight=(torch.rand(K, generator=g) + 0.5).to(device=device, dtype=dtype),
        norm_bias=randn(K) if layer_norm else None, eps=1e-5, weight_offset=0.0,
        cast_before_weight=not layer_norm, layer_norm=layer_norm,
        weight=randn(N, K, scale=K ** -0.5), bias=randn(N) if bias else None,
        keys=randn(B, HK, L, D), values=randn(B, HK, L, D),
    )
    angle = torch.randn(B if batch_cos else 1, 1, n, D // 2, generator=g) * 40  # positions of a long prompt
    angle = torch.cat((angle, angle), dim=-1)
    args.update(cos=angle.cos().to(device=device, dtype=dtype), sin=angle.sin().to(device=device, dtype=dtype),
                start=torch.tensor(start, device=device), q_heads=HQ)
    return args


def _unfused(a):
    if a["layer_norm"]:
        qkv, summed, _ = OPS.layer_norm_linear(a["x"], a["residual"], a["norm_weight"], a["norm_bias"], a["eps"],
                                               a["weight"], a["bias"], "none")
    else:
        qkv, summed, _ = OPS.rms_norm_linear(a["x"], a["residual"], a["norm_weight"], a["eps"], a["weight_offset"],
                                             a["cast_before_weight"], a["weight"], a["bias"], "none")
    q, k, v = qkv_rotary_cache.split_heads(qkv, a["q_heads"], a["keys"].shape[1], a["keys"].shape[3])
    q_rot = OPS.rotary_kv_cache_write(a["keys"], a["values"], q, k, v, a["cos"], a["sin"], a["start"])
    return q_rot, summed


def _check_equal(args):
    ref = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    ref_q, ref_sum = _unfused(ref)
    q, summed = OPS.qkv_rotary_cache_write(**args)
    assert q.shape == ref_q.shape and q.is_contiguous()
    assert torch.equal(q, ref_q)
    assert torch.equal(summed, ref_sum)
    assert torch.equal(args["keys"], ref["keys"]) and torch.equal(args["values"], ref["values"])


CASES = [  # B, n, K, HQ, HK, D, L, start, residual, bias, layer_norm, batch_cos
    (1, 1, 40, 4, 2, 16, 9, 5, True, False, False, True),    # Llama: add + RMSNorm, GQA
    (2, 1, 40, 4, 2, 24, 9, 8, False, True, False, False),   # Qwen2's bias, the cache's last position, half of 12
    (1, 2, 36, 3, 1, 16, 9, 8, True, False, False, True),    # two new tokens: the second is past the cache
    (1, 1, 40, 2, 2, 16, 9, 0, True, True, True, True),      # LayerNorm (Falcon, GPT-NeoX style), MHA
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_fused_equals_norm_linear_then_rotary_cache_write(dtype, case):
    args = _case("cpu", dtype, *case)
    assert qkv_rotary_cache.qkv_rotary_cache_applies(
        args["x"], qkv_rotary_cache.NormPrologue(args["residual"], args["norm_weight"], 1e-5, 0.0, True),
        args["weight"], args["bias"], args["keys"], args["values"], args["cos"], args["sin"], args["q_heads"])
    _check_equal(args)


def test_other_inputs_run_the_two_kernels():
    """Prefill-size x, and cos/sin read with a stride along D: the op runs the unfused pair (same results)."""
    _check_equal(_case("cpu", torch.float16, 2, 3, 40, 4, 2, 16, 12, 2, True, False, False, True))
    args = _case("cpu", torch.float16, 1, 1, 40, 4, 2, 16, 9, 3, True, False, False, True)
    args["cos"] = torch.stack((args["cos"], -args["cos"]), dim=-1)[..., 0]
    args["sin"] = torch.stack((args["sin"], -args["sin"]), dim=-1)[..., 0]
    prologue = qkv_rotary_cache.NormPrologue(args["residual"], args["norm_weight"], 1e-5, 0.0, True)
    assert args["cos"].stride(-1) == 2 and not qkv_rotary_cache.qkv_rotary_cache_applies(
        args["x"], prologue, args["weight"], None, args["keys"], args["values"], args["cos"], args["sin"], 4)
    _check_equal(args)


def test_bad_input_is_named_and_opcheck():
    args = _case("cpu", torch.float32, 1, 1, 40, 4, 2, 16, 9, 3, True, False, False, True)
    with pytest.raises(ValueError, match="columns"):
        OPS.qkv_rotary_cache_write(**{**args, "q_heads": 3})
    torch.library.opcheck(OPS.qkv_rotary_cache_write.default, tuple(args.values()))


def _copy(args, dtype=None):
    out = {}
    for key, v in args.items():
        if isinstance(v, torch.Tensor):
            v = v.to(dtype) if dtype is not None and v.is_floating_point() else v.clone()
        out[key] = v
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,HQ,HK,D,bias", [(1, 32, 4, 64, False), (2, 28, 4, 128, True), (1, 16, 16, 80, False)])
def test_fused_is_as_close_to_fp32_as_unfused_on_gpu(dtype, B, HQ, HK, D, bias):
    """On the GPU the compiler may contract the rotary's multiply-adds differently in the two kernels,
    so the comparison is with the fp32 result of the unfused ops: the fused op's error is within
    that of the unfused pair in the same dtype (Llama-1.1B's, Qwen2-7B's and an MHA head dim 80's
    attention sizes; the cache ends past the last position written)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    args = _case("cuda", dtype, B, 1, HQ * D, HQ, HK, D, 300, 257, True, bias, False, True)
    ref = _copy(args, torch.float32)
    unfused = _copy(args)
    ref_q, ref_sum = _unfused(ref)
    unfused_q, unfused_sum = _unfused(unfused)
    q, summed = OPS.qkv_rotary_cache_write(**args)
    assert torch.equal(summed, unfused_sum)
    for name, ours, theirs, exact in (("q", q, unfused_q, ref_q), ("keys", args["keys"], unfused["keys"], ref["keys"]),
                                      ("values", args["values"], unfused["values"], ref["values"])):
        err = (ours.float() - exact).abs().max().item()
        err_unfused = (theirs.float() - exact).abs().max().item()
        assert err <= 2 * err_unfused + 1e-6, (name, err, err_unfused)
