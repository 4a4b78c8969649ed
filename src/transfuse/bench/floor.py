"""The physical floor: how fast a forward pass could possibly run on this GPU.

A forward pass needs at least its arithmetic done at the best matmul rate the GPU reaches, and at
least its unavoidable bytes moved at the best copy rate it reaches; it cannot beat the larger of the
two (a roofline with measured, not datasheet, ceilings):

    floor_s = max(flops / matmul_peak, min_bytes / copy_bandwidth)

Both ceilings are measured at the start of the same run, on random data (power and clocks depend
on the bit patterns; zeros flatter the hardware):

- matmul peak: one large square GEMM (8192^3 by default) in the benchmark's dtype, 2*M*N*K flops;
- copy bandwidth: one large device-to-device copy, counting bytes read plus bytes written.

Analytic FLOPs of a BERT encoder forward at (batch B, seq S), T = B*S tokens, hidden H, heads n,
head dim D = H/n, ffn F, L layers:

    linear   2 * T * L * (4*H*H + 2*H*F)       Q, K, V, output projection; FFN up and down
    attention 4 * B * n * S^2 * D * L          Q@K^T and P@V, each 2*B*n*S*S*D
    pooler   2 * B * H*H                       dense on the first token (BertModel's default)

Biases, norms, softmax, GELU and the embedding sum are left out: they are O(T*H) against O(T*H*H)
and no tensor core runs them.

Minimum bytes (each input read once, each output written once, every intermediate kept on chip):

    weights     every encoder and pooler parameter (incl. biases and norm scales), read once
    embeddings  the T gathered word rows, S position rows (shared by the batch), one token-type row
                (token_type_ids are all zero here) and the embedding norm's scale and shift
    inputs      input_ids and attention_mask, int64, T each
    outputs     last_hidden_state (T*H) and pooler_output (B*H), in the model dtype

The unused rows of the word-embedding table are not read and do not count. No implementation keeps
a 32x512 batch's activations on chip, so at large shapes the floor is the FLOP term and at small
shapes the weight bytes: bert-base in fp16 reads 170 MB of weights per call however short the input.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from transfuse.bench import timing

INDEX_BYTES = 8  # input_ids and attention_mask are int64 as HF tokenizers return them


def _geometry(config: Any) -> tuple[int, int, int, int, int, int, int]:
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    if hidden % heads:
        raise ValueError(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    return (
        hidden,
        int(config.num_hidden_layers),
        heads,
        int(config.intermediate_size),
        int(config.vocab_size),
        int(config.max_position_embeddings),
        int(getattr(config, "type_vocab_size", 2)),
    )


def encoder_layer_params(config: Any) -> int:
    """Parameters of one BERT layer: Q, K, V, O (weight + bias), FFN up and down, two LayerNorms."""
    h, _, _, f, _, _, _ = _geometry(config)
    return 4 * (h * h + h) + (h * f + f) + (f * h + h) + 2 * (2 * h)


def encoder_param_count(config: Any, with_pooler: bool = True) -> dict[str, int]:
    """Parameter counts of a BertModel split the way the byte floor reads them."""
    h, layers, _, _, vocab, positions, types = _geometry(config)
    return {
        "word_embeddings": vocab * h,
        "position_embeddings": positions * h,
        "token_type_embeddings": types * h,
        "embedding_norm": 2 * h,
        "layers": layers * encoder_layer_params(config),
        "pooler": (h * h + h) if with_pooler else 0,
    }


def encoder_flops(config: Any, batch: int, seq: int, with_pooler: bool = True) -> int:
    """Matmul FLOPs of one BertModel forward at (batch, seq); see the module docstring."""
    h, layers, heads, f, _, _, _ = _geometry(config)
    tokens = batch * seq
    head_dim = h // heads
    linear = 2 * tokens * layers * (4 * h * h + 2 * h * f)
    attention = 4 * batch * heads * seq * seq * head_dim * layers
    pooler = 2 * batch * h * h if with_pooler else 0
    return linear + attention + pooler


def encoder_min_bytes(
    config: Any,
    batch: int,
    seq: int,
    dtype_bytes: int,
    with_mask: bool = True,
    with_pooler: bool = True,
) -> int:
    """Bytes a BertModel forward at (batch, seq) cannot avoid moving; see the module docstring."""
    h = _geometry(config)[0]
    tokens = batch * seq
    counts = encoder_param_count(config, with_pooler)
    weights = counts["layers"] + counts["pooler"] + counts["embedding_norm"]
    gathered = tokens * h + seq * h + h
    inputs = tokens * INDEX_BYTES * (2 if with_mask else 1)
    outputs = tokens * h + (batch * h if with_pooler else 0)
    return (weights + gathered + outputs) * dtype_bytes + inputs


def floor_ms(flops: float, nbytes: float, matmul_tflops: float, copy_gbps: float) -> float:
    """max(compute time, memory time) in ms at the measured ceilings."""
    compute_s = flops / (matmul_tflops * 1e12)
    memory_s = nbytes / (copy_gbps * 1e9)
    return max(compute_s, memory_s) * 1e3


@dataclass
class Ceilings:
    matmul_tflops: float
    copy_gbps: float
    matmul_size: int
    copy_bytes: int
    dtype: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_matmul_tflops(
    dtype: torch.dtype, size: int = 8192, device: str | torch.device = "cuda", iters: int = 20, reps: int = 5
) -> float:
    """Best sustained GEMM rate: median time of `reps` back-to-back size^3 matmuls, in TFLOP/s."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    out = torch.empty(size, size, device=device, dtype=dtype)

    def run() -> None:
        for _ in range(reps):  # back to back, so the per-sample synchronize is amortised
            torch.matmul(a, b, out=out)

    t = timing.measure(run, [()], warmup=3, iters=iters)
    return 2 * size**3 * reps / (t.median_ms * 1e-3) / 1e12


def measure_copy_gbps(
    nbytes: int = 1 << 30, device: str | torch.device = "cuda", iters: int = 20, reps: int = 5
) -> float:
    """Device-to-device copy rate counting bytes read plus bytes written, in GB/s (1e9)."""
    gen = torch.Generator(device=device).manual_seed(0)
    src = torch.randn(nbytes // 4, device=device, dtype=torch.float32, generator=gen)
    dst = torch.empty_like(src)

    def run() -> None:
        for _ in range(reps):
            dst.copy_(src)

    t = timing.measure(run, [()], warmup=3, iters=iters)
    return 2 * src.numel() * 4 * reps / (t.median_ms * 1e-3) / 1e9


def measure_ceilings(dtype: torch.dtype, device: str | torch.device = "cuda", matmul_size: int = 8192,
                     copy_bytes: int = 1 << 30) -> Ceilings:
    tflops = measure_matmul_tflops(dtype, matmul_size, device)
    gbps = measure_copy_gbps(copy_bytes, device)
    torch.cuda.empty_cache()
    return Ceilings(tflops, gbps, matmul_size, copy_bytes, str(dtype).removeprefix("torch."))
