"""The ordered registry of rewrite passes and the record of what each did.

Order matters and is stated once, here: in-place arithmetic on temporaries is written out of place
first and dropout is removed next, so that attention and epilogue chains are contiguous; attention before the GEMM passes (it consumes matmuls, not linears); sibling linears are
merged before epilogues are fused; residual adds go to the norm kernel before the GEMM epilogue
gets a chance at them (the norm kernel can also store the sum when something else reads it); the
embedding pass then folds an input layer's lookups and their sum into the norm those passes made.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Callable

import torch
import torch.fx as fx

from transfuse.passes.constants import hoist_index_lists, hoist_literal_tensors
from transfuse.passes.host_tensors import move_host_tensors
from transfuse.passes.graph import remove_dead_code


@dataclasses.dataclass
class Rejection:
    pattern: str
    node: str
    reason: str


@dataclasses.dataclass
class PassContext:
    """What a pass may read (the real example inputs) and where it records what it did."""

    gm: fx.GraphModule
    example_inputs: list
    options: dict
    training: bool = False  # a training graph: only passes whose ops have a backward run
    rewrites: Counter = dataclasses.field(default_factory=Counter)
    rejections: list[Rejection] = dataclasses.field(default_factory=list)
    # Weight groups merged into one buffer: the runtime keeps them current (see runtime/weights.py).
    merged_weights: list = dataclasses.field(default_factory=list)
    # LM heads whose returned logits get their gradient outside the graph: (logits output position,
    # x output position, weight input position, bias input position or None), for
    # ops.cross_entropy.attach_returned_logits; the x outputs come after the graph's own.
    returned_logits: list = dataclasses.field(default_factory=list)
    _placeholders: dict | None = None  # placeholder node -> input position (placeholders never move)

    def matched(self, pattern: str, count: int = 1) -> None:
        self.rewrites[pattern] += count

    def reject(self, pattern: str, node: fx.Node, reason: str) -> None:
        self.rejections.append(Rejection(pattern, node.name, reason))

    def placeholder_index(self, node: fx.Node) -> int | None:
        """The input position of a placeholder (None for any other node)."""
        if node.op != "placeholder":
            return None
        if self._placeholders is None:
            self._placeholders = {n: i for i, n in enumerate(n for n in self.gm.graph.nodes if n.op == "placeholder")}
        return self._placeholders[node]

    def placeholder_value(self, node: fx.Node) -> torch.Tensor | None:
        """The real tensor a placeholder stands for at compile time (parameters, buffers)."""
        index = self.placeholder_index(node)
        value = self.example_inputs[index] if index is not None else None
        return value if isinstance(value, torch.Tensor) else None


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[PassContext], None]
    doc: str
    trains: bool = False  # its ops have backward formulas (it may run on a training graph)


def registry() -> list[Pass]:
    # Imported here so that each pass module stays importable on its own.
    from transfuse.passes import (attention, cache_length, cache_write_attention, clamp, conv1d, cross_entropy, dropout, embedding, empty_cat, inplace, kv_cache,
                                  linear, merge_linears, norm, norm_linear, qkv_rotary_cache, rms_norm, rotary,
                                  rotary_table, written_layer_norm)

    return [
        Pass("inplace", inplace.run, "in-place arithmetic on a temporary nothing else reads -> out of place", trains=True),
        Pass("dropout", dropout.run, "remove dropout that is the identity (eval mode or p=0)", trains=True),
        Pass("empty_cat", empty_cat.run, "torch.cat of one tensor and empty 1-D ones (DynamicCache's first append) -> a cast", trains=True),
        Pass("clamp", clamp.run, "fp16 guards: T5's clamp by where(isinf(x).any()) -> transfuse.clamp_if_inf, the "
             "BART family's (made a select by branchless.py) -> transfuse.clamp_if_nonfinite"),
        Pass("attention", attention.run, "SDPA and hand-written attention -> transfuse.attention", trains=True),
        Pass("rotary_table", rotary_table.run, "HF's cos/sin table (inv_freq @ positions, cat, cos, sin, scale, cast) -> transfuse.rotary_table"),
        Pass("rotary", rotary.run, "x * cos + rotate_half(x) * sin -> transfuse.rotary", trains=True),
        Pass("kv_cache", kv_cache.run, "a static KV cache's arange + index_copy_ pair -> transfuse.kv_cache_write"),
        Pass("conv1d", conv1d.run, "Hugging Face Conv1D's addmm(bias, x, W) -> F.linear(x, W.t(), bias)", trains=True),
        Pass("merge_linears", merge_linears.run, "linears reading one input -> one GEMM (QKV)"),
        Pass("norm", norm.run, "layer norm, with the residual add feeding it -> transfuse norm ops", trains=True),
        Pass("written_layer_norm", written_layer_norm.run, "layer norm written out by hand, with its residual add -> transfuse norm ops", trains=True),
        Pass("embedding", embedding.run, "embedding lookups summed into a layer norm -> transfuse.embedding_layer_norm"),
        Pass("rms_norm", rms_norm.run, "RMSNorm (hand-written or F.rms_norm), with its residual add -> transfuse norm ops", trains=True),
        Pass("cross_entropy", cross_entropy.run, "the LM loss (and its head when nothing else reads the logits) -> transfuse.cross_entropy", trains=True),
        Pass("linear", linear.run, "linear + activation + residual add -> transfuse.linear (linear_train in training)", trains=True),
        Pass("norm_linear", norm_linear.run, "an RMSNorm or LayerNorm and the (first) linear reading it -> transfuse.rms_norm_linear / layer_norm_linear"),
        Pass("qkv_rotary_cache", qkv_rotary_cache.run, "a norm + Q/K/V linear and its rotary + cache write -> transfuse.qkv_rotary_cache_write"),
        Pass("cache_length", cache_length.run, "every layer's cache-length add_ -> one _foreach_add_ at the end"),
        Pass("cache_write_attention", cache_write_attention.run, "a (rotary +) KV-cache write and the attention reading "
             "the cache -> transfuse.kv_cache_attention / rotary_cache_attention (one decode attention launch)"),
    ]


@dataclasses.dataclass(frozen=True)
class BackwardPass:
    name: str
    pattern: str  # what the report counts it as
    run: Callable[[fx.GraphModule], int]  # rewrites AOTAutograd's backward graph, returns how many nodes
    doc: str


def backward_registry() -> list[BackwardPass]:
    """Passes over AOTAutograd's backward graph of a training graph (runtime/training_graphs.py), in
    order; `disable` names them as it names forward passes."""
    from transfuse.passes import (backward_bias_grad, backward_column_sum, backward_fp32_grads, backward_packed_qkv,
                                  backward_views)

    return [
        BackwardPass("backward_bias_grad", backward_bias_grad.PATTERN, backward_bias_grad.run,
                     "a column sum of a norm backward's dx -> that kernel's own sum (projection bias gradients)"),
        BackwardPass("backward_packed_qkv", backward_packed_qkv.PATTERN, backward_packed_qkv.run,
                     "the cat of an attention backward's dq, dk, dv (a fused QKV linear) -> written in place"),
        BackwardPass("backward_column_sum", backward_column_sum.PATTERN, backward_column_sum.run,
                     "any other sum over all dims but the last -> transfuse.bias_grad"),
        BackwardPass("backward_fp32_grads", backward_fp32_grads.PATTERN, backward_fp32_grads.run,
                     "a 16-bit weight or bias gradient widened to fp32 -> written in fp32 by its GEMM or sum"),
        BackwardPass("backward_views", backward_views.PATTERN, backward_views.run,
                     "every view -> a reshape (last: torch's backward kernels may return other strides than traced)"),
    ]


def run_passes(ctx: PassContext, disabled: frozenset[str] = frozenset()) -> None:
    for p in registry():
        if p.name in disabled:
            continue
        if ctx.training and not p.trains:
            ctx.rejections.append(Rejection(p.name, "-", "training graph: this pass has no backward yet; left to PyTorch"))
            continue
        p.run(ctx)
        remove_dead_code(ctx.gm.graph)
        ctx.gm.graph.lint()
    if not ctx.training:
        # Not a rewrite: what CUDA graph capture needs of an inference graph. (A training graph's
        # literals become AOTAutograd's own constants; a buffer added here would stop its trace.)
        hoist_literal_tensors(ctx.gm)
        hoist_index_lists(ctx.gm)
        move_host_tensors(ctx.gm)
    ctx.gm.recompile()
