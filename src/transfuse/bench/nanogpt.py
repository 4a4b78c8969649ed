"""A GPT-2 written the way nanoGPT users write theirs, for `transfuse bench --train`.

Nothing here is tuned for speed on purpose: the point of the training benchmark is what transfuse
makes of the model people actually have. So attention is the hand-written one (Q @ K^T, scale,
masked_fill against a causal-mask buffer registered on the module, softmax, dropout, @ V), the
vocabulary is GPT-2's 50257 (not padded to a multiple of 64), lm_head shares the token embedding,
and forward(idx, targets) returns (logits, loss) with the loss computed over every position.

`flash` (per attention module, set from GPTConfig.flash) switches to F.scaled_dot_product_attention,
the edit users make by hand; set_attention() flips it on an existing model and pad_vocab() makes the
other common edit, the vocabulary padded to a multiple of 64. The benchmark applies both edits to a
copy of the same weights, so every provider starts from the same model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024  # longest sequence: the position table and the causal mask have this many rows
    vocab_size: int = 50257  # GPT-2's tokenizer
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in the Linear layers and LayerNorms, as GPT-2 has them
    flash: bool = False  # True: F.scaled_dot_product_attention; False: the hand-written attention


def tiny_config(**overrides) -> GPTConfig:
    """A model small enough for CPU tests: 2 layers, 4 heads of 16, a 97-token vocabulary."""
    values = dict(block_size=128, vocab_size=97, n_layer=2, n_head=4, n_embd=64)
    values.update(overrides)
    return GPTConfig(**values)


def causal_mask(size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Ones on and below the diagonal, shaped (1, 1, size, size) to broadcast over batch and heads."""
    return torch.tril(torch.ones(size, size, device=device)).view(1, 1, size, size)


class LayerNorm(nn.Module):
    """LayerNorm whose bias can be left out (GPTConfig.bias=False); nn.LayerNorm only learned to do
    that in torch 2.1, and nanoGPT-style code keeps its own."""

    def __init__(self, width: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd {config.n_embd} is not a multiple of n_head {config.n_head}")
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.block_size = config.block_size
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # Q, K and V in one GEMM
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.flash = config.flash
        if not self.flash:  # only the hand-written path reads the mask; SDPA builds causality itself
            self.register_buffer("bias", causal_mask(config.block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.size()
        head_dim = width // self.n_head
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (batch, seq, width) -> (batch, heads, seq, head_dim): heads become a batch dimension of the matmuls
        q = q.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                               dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
            scores = scores.masked_fill(self.bias[:, :, :seq, :seq] == 0, float("-inf"))
            probs = F.softmax(scores, dim=-1)
            probs = self.attn_dropout(probs)
            y = probs @ v
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # One matrix embeds tokens and scores them (GPT-2's weight tying): 38.6M fewer parameters.
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init: each residual branch ends in a c_proj, and 2 per layer add up in the
        # residual stream, so their std shrinks with sqrt(2 * n_layer) to keep its variance flat.
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        batch, seq = idx.size()
        if seq > self.config.block_size:
            raise ValueError(f"sequence of {seq} tokens, but the model has {self.config.block_size} positions")
        pos = torch.arange(seq, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:  # generation needs the last position's scores only
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def set_attention(model: nn.Module, sdpa: bool) -> nn.Module:
    """Switch every CausalSelfAttention of `model` to SDPA (True) or the hand-written path (False).
    The mask buffer goes with the hand-written path: SDPA does not read it, and 12 layers of a
    1024 x 1024 fp32 mask are 48 MiB that an SDPA model would not have."""
    for module in model.modules():
        if not isinstance(module, CausalSelfAttention):
            continue
        module.flash = sdpa
        if sdpa and "bias" in module._buffers:
            del module.bias
        elif not sdpa and "bias" not in module._buffers:
            module.register_buffer("bias", causal_mask(module.block_size, device=module.c_attn.weight.device))
    return model


def pad_vocab(model: GPT, multiple: int = 64, seed: int = 0) -> GPT:
    """Grow the tied embedding / lm_head to the next multiple of `multiple` rows (50257 -> 50304 for
    64), the edit users make for faster GEMMs. The first rows keep their values; the new rows get the
    model's N(0, 0.02) init from a seeded CPU generator (no target ever names them, but they take
    part in the softmax, as they do in a model trained padded from the start)."""
    old = model.lm_head.weight
    rows, width = old.shape
    padded = -(-rows // multiple) * multiple
    if padded == rows:
        return model
    extra = torch.randn(padded - rows, width, generator=torch.Generator().manual_seed(seed)) * 0.02
    weight = torch.cat([old.detach(), extra.to(device=old.device, dtype=old.dtype)])
    model.lm_head = nn.Linear(width, padded, bias=False, device=old.device, dtype=old.dtype)
    model.lm_head.weight = nn.Parameter(weight)
    model.transformer.wte = nn.Embedding(padded, width, device=old.device, dtype=old.dtype)
    model.transformer.wte.weight = model.lm_head.weight
    model.config.vocab_size = padded
    return model
