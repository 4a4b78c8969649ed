"""What transfuse did to a model: rewrites with counts, candidates left alone with the reason, graphs
and graph breaks, and the share of the graph's matrix work now in transfuse kernels."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import torch
import torch.fx as fx

from transfuse.passes.graph import arg, hint, kind, tensor_meta


@dataclasses.dataclass
class GraphRecord:
    rewrites: dict
    rejections: list
    flops_total: float
    flops_transfuse: float
    cuda_graphs: bool
    nodes: int
    training: bool = False  # traced with gradients: the forward of a training step
    training_runtime: str = "eager autograd through the graph's ops"  # see runtime/training_graphs.py
    instance: bool = False  # a traced graph compiled again for another module instance (runtime/instances.py)

    def summary(self) -> str:
        share = self.flops_transfuse / self.flops_total if self.flops_total else 0.0
        done = ", ".join(f"{k} x{v}" for k, v in sorted(self.rewrites.items())) or "nothing"
        return f"rewrote {done}; {len(self.rejections)} left alone; {share:.0%} of matmul FLOPs in transfuse kernels"


def _numel(t) -> int:
    return math.prod(_dims(t)) if t is not None else 0


def _dims(t) -> list[int]:
    # Dynamic dimensions count at the traced example's sizes.
    return [hint(s) for s in t.shape]


def node_flops(node: fx.Node) -> float:
    """Multiply-add FLOPs of the matrix operations; element-wise work is not counted."""
    target = str(node.target)
    if node.op != "call_function" and node.op != "call_method":
        return 0.0
    if kind(node) == "linear" or target.startswith(("transfuse.linear", "transfuse.rms_norm_linear",
                                                     "transfuse.layer_norm_linear")):
        # rms_norm_linear(x, residual, norm_weight, eps, offset, cast, weight, ...): its GEMM's weight is
        # arg 6; layer_norm_linear(x, residual, norm_weight, norm_bias, eps, weight, ...): arg 5
        w_index = {"transfuse.rms_norm_linear": 6, "transfuse.layer_norm_linear": 5}.get(target.split(".default")[0], 1)
        # F.linear's operands may be keywords (I-BERT: F.linear(x, weight=..., bias=...))
        x, w = tensor_meta(arg(node, 0, "input")), tensor_meta(arg(node, w_index, "weight"))
        if x is None or w is None:
            return 0.0
        return 2.0 * _numel(x) / _dims(x)[-1] * w.shape[0] * w.shape[1]
    if node.target is torch.addmm and len(node.args) == 3:  # bias + a @ b (GPT-2's Conv1D)
        out, a = tensor_meta(node), tensor_meta(node.args[1])
        if out is None or a is None:
            return 0.0
        return 2.0 * _numel(out) * _dims(a)[-1]
    if kind(node) == "matmul":
        out, a = tensor_meta(node), tensor_meta(node.args[0])
        if out is None or a is None:
            return 0.0
        return 2.0 * _numel(out) * _dims(a)[-1]
    if kind(node) == "sdpa" or target.startswith(("transfuse.attention.default", "transfuse.attention_train.default")):
        q, k, v = (tensor_meta(arg(node, i, name)) for i, name in enumerate(("query", "key", "value")))
        if q is None or k is None or v is None:
            return 0.0
        # q @ k^T over q's head dim, then probs @ v over the keys into v's (DeepSeek: 192 and 128)
        return 2.0 * _numel(q) / _dims(q)[-1] * _dims(k)[-2] * (_dims(q)[-1] + _dims(v)[-1])
    return 0.0


def compute_flops(gm: fx.GraphModule, transfuse_only: bool = False) -> float:
    total = 0.0
    for node in gm.graph.nodes:
        if transfuse_only and not str(node.target).startswith("transfuse."):
            continue
        total += node_flops(node)
    return total


# Rewrites of a training graph -> the op family whose backward runs in transfuse kernels.
_BACKWARD_FAMILIES = {
    "ManualAttention": "attention (FlashAttention-2 forward, dK/dV and dQ kernels)",
    "TorchSDPA": "attention (FlashAttention-2 forward, dK/dV and dQ kernels)",
    "LayerNorm": "layer norm", "ResidualLayerNorm": "layer norm", "WrittenLayerNorm": "layer norm",
    "ResidualWrittenLayerNorm": "layer norm",
    "RMSNorm": "RMSNorm", "ResidualRMSNorm": "RMSNorm",
    "RotaryEmbedding": "rotary", "RotaryPair": "rotary",
    "LinearEpilogue": "GEMM epilogues (activation and its gradient)", "SwiGLU": "GEMM epilogues (activation and its gradient)",
    "GeGLU": "GEMM epilogues (activation and its gradient)", "ReGLU": "GEMM epilogues (activation and its gradient)",
    "CrossEntropy": "cross-entropy", "LinearCrossEntropy": "LM head + cross-entropy (chunked)",
    "BiasGradInNormBackward": "output projections' bias gradients (in the norm backward)",
    "ColumnSum": "other bias gradients (column sums)",
    "PackedQKVGrad": "fused QKV gradients (written in place by the attention backward)",
    "Fp32Gradients": "weight and bias gradients written in fp32 (no rounding to 16 bits on the way)",
}


def format_report(records: list[GraphRecord], pool=None, graph_breaks: int | None = None, runners=()) -> str:
    if not records:
        return "transfuse: nothing compiled yet (call the model once)"
    rewrites: Counter = Counter()
    for r in records:
        rewrites.update(r.rewrites)
    instances = sum(r.instance for r in records)
    traces = len(records) - instances
    lines = [f"transfuse report: {len(records)} graph(s) compiled (Dynamo traces; {traces - 1} after the first)"
             + (f", {instances} of them for other instances of a traced module" if instances else "")]
    if graph_breaks is not None:
        lines.append(f"  graph breaks: {graph_breaks}")
    lines.append("  rewrites:")
    for name, count in sorted(rewrites.items()):
        lines.append(f"    {name:<26} x{count}")
    reasons: Counter = Counter((rej.pattern, rej.reason) for r in records for rej in r.rejections)
    if reasons:
        lines.append("  left as they were:")
        for (pattern, reason), count in sorted(reasons.items()):
            lines.append(f"    {pattern:<26} x{count}: {reason}")
    total = sum(r.flops_total for r in records)
    ours = sum(r.flops_transfuse for r in records)
    if total:
        lines.append(f"  matmul/attention FLOPs in transfuse kernels: {ours / total:.1%}")
    trained = sum(r.training for r in records)
    if trained:
        lines.append(f"  training graphs: {trained} (no padding)")
        lines.extend(f"    run as {how}: {n}" for how, n in sorted(Counter(r.training_runtime for r in records if r.training).items()))
        in_training: Counter = Counter()
        for r in records:
            if r.training:
                in_training.update(r.rewrites)
        families = sorted({family for pattern, family in _BACKWARD_FAMILIES.items() if in_training[pattern]})
        lines.append("    forward and backward in transfuse kernels: " + (", ".join(families) or "nothing"))
        sdpa = " (attention with dropout: F.scaled_dot_product_attention)" if in_training["AttentionDropoutToSDPA"] else ""
        lines.append(f"    in PyTorch: GEMMs (cuBLAS), other element-wise ops, dropout{sdpa}, anything listed as left alone")
    on_gpu = any(r.cuda_graphs for r in records)
    lines.append(f"  CUDA graphs: {'on' if on_gpu else 'off (CPU or disabled)'}")
    if pool is not None and pool.graphs_captured:
        lines.append(
            f"    captured {pool.graphs_captured}, pool ~{pool.bytes_reserved / 2**20:.1f} MiB, "
            f"capture time {pool.capture_seconds:.2f} s"
        )
    for runner in runners:
        if hasattr(runner, "uncaptured_calls") and (runner.uncaptured_calls or runner.evicted):
            lines.append(f"  exact-shape graphs: {len(runner.graphs)} kept, {runner.evicted} evicted, "
                         f"{runner.uncaptured_calls} call(s) ran without a graph ({_uncaptured_why(runner)})")
        if hasattr(runner, "bucket_report"):
            kept = f", {len(runner.graphs)} kept" if runner.use_graphs else ""
            lines.append(f"  buckets ({len(runner.stats)} used{kept}, {runner.evicted} evicted):")
            lines.extend(f"    {line}" for line in runner.bucket_report())
            if runner.uncaptured_calls:
                which = "" if getattr(runner, "capture_failed", None) else " with exact (unpadded) sizes"
                lines.append(f"    {runner.uncaptured_calls} call(s){which} ran without a graph "
                             f"({_uncaptured_why(runner)})")
            if runner.exact_calls:
                lines.append(f"    {runner.exact_calls} call(s) beyond the largest bucket ran at their exact size without a graph")
            first = getattr(runner, "precompiled_first", None)
            if first:
                lines.append(f"    precompile of the first bucket: {_precompile_line(first)}")
            done = getattr(runner, "precompiled", None)
            if done:
                lines.append(f"    precompile at the second bucket: {_precompile_line(done)}")
    return "\n".join(lines)


def _precompile_line(done: dict) -> str:
    if done["skipped"]:
        return f"none ({done['skipped']})"
    failed = f", {done['failed']} failed (compiled again at their first launch)" if done["failed"] else ""
    if done.get("failed_buckets"):
        failed += f", {done['failed_buckets']} dry runs failed (first: {done.get('error', '')})"
    return (f"{done['buckets']} buckets dry-run in {done.get('dry_run_seconds', 0.0):.1f} s, {done['compiles']} Triton "
            f"compiles in {done.get('how') or 'parallel'}, {done['seconds']:.1f} s in all{failed}")


def _uncaptured_why(runner) -> str:
    if getattr(runner, "capture_failed", None):
        return f"CUDA graph capture was refused, so this graph runs without one: {runner.capture_failed}"
    if runner.too_many:
        return (f"{runner.wasted} graphs were evicted before a replay: more distinct exact shapes come round than "
                f"max_graphs={runner.max_graphs} holds, e.g. a dynamic KV cache that grows every token; no more captures")
    return "a shape is captured the second time it comes"
