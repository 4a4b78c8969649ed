"""Backward graphs: a parameter's gradient written in fp32 by the op that computes it (`Fp32Gradients`).

Under autocast an fp32 parameter is cast to bf16 (or fp16) for its GEMM, so AOTAutograd's backward
computes the weight gradient as a 16-bit GEMM and then widens it for the fp32 parameter:

    _to_copy(mm(a, b), dtype=float32)            (through t / view nodes, for F.linear's layout)
    _to_copy(transfuse.bias_grad(dy), dtype=float32)
    _to_copy(getitem(transfuse.layer_norm_backward(...), 3), dtype=float32)   (its dx column sum)
    _to_copy(getitem(transfuse.activation_bias_backward(...), 1), dtype=float32)   (its bias sum)

The GEMM accumulates in fp32, rounds to 16 bits, and a second kernel reads that back to write fp32:
one launch and a round trip through memory per parameter (GPT-2 124M at batch 8 x 1024 on an
H200: 3-7 us each, 48 weights and 50 biases a step; bench/kernels/sweep_train_memory_bound.py,
2026-11-26). Here the GEMM writes fp32 itself (aten.mm.dtype, cuBLAS's fp32 output, CUDA only) and
the column sums (bias_grad, the norm and activation backwards') round their fp32 accumulators straight to fp32.

This changes the numbers, towards fp32: the gradient is no longer rounded to 16 bits on the way
(relative error against an fp32 GEMM 9e-6 instead of 1.7e-3 in that measurement). The report
lists the rewrite; `optimize(model, disable=("backward_fp32_grads",))` keeps eager's rounding.

Runs on the aten graphs AOTAutograd hands runtime/training_graphs.py, after
passes/backward_column_sum.py (whose bias_grad nodes it widens).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

PATTERN = "Fp32Gradients"

_HALF = (torch.float16, torch.bfloat16)
# Nodes between the GEMM and the cast that only reinterpret its result (F.linear's dW = (dy^T x)
# reaches the cast as t(t(mm)) in AOTAutograd's graphs).
_NORM_DX_SUM, _NORM_DX_SUM_DTYPE = 3, 12  # transfuse::layer_norm_backward's output and argument
_LAYOUT = (torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
           torch.ops.aten.transpose.int, torch.ops.aten.permute.default)


def run(gm: fx.GraphModule) -> int:
    """Rewrites every widening cast of a 16-bit mm or column-sum result (see _widened_chain); returns how many."""
    count = 0
    for node in list(gm.graph.nodes):
        chain = _widened_chain(node)
        if chain is None:
            continue
        source = chain[0]
        if source.target is torch.ops.aten.mm.default:
            source.target = torch.ops.aten.mm.dtype
            source.args = (*source.args[:2], torch.float32)
        elif _is_norm_dx_sum(source):  # the norm backward's dx sum, in the dtype it is told
            _widen_output(source.args[0], _NORM_DX_SUM, _NORM_DX_SUM_DTYPE)
        elif _is_activation_dbias(source):  # activation_bias_backward's dbias, likewise
            _widen_output(source.args[0], 1, 3)
        elif source.target is torch.ops.transfuse.bias_grad.default:  # (dy[, out_dtype])
            source.args = (source.args[0], torch.float32)
        for link in chain:  # the fake values, for passes and checks after this one
            val = link.meta.get("val")
            if isinstance(val, torch.Tensor):
                link.meta["val"] = val.to(torch.float32)
        node.replace_all_uses_with(chain[-1])
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _widen_output(op_node: fx.Node, output: int, dtype_arg: int) -> None:
    """Tells op_node (a transfuse op whose argument dtype_arg is an output's dtype) to write that
    output in fp32, and updates its fake value."""
    op_node.args = (*op_node.args[:dtype_arg], torch.float32)
    old = op_node.meta.get("val")
    if isinstance(old, (tuple, list)) and isinstance(old[output], torch.Tensor):
        op_node.meta["val"] = (*old[:output], old[output].to(torch.float32), *old[output + 1:])


def _widened_chain(node: fx.Node) -> list[fx.Node] | None:
    """[source, layout nodes...] when node casts a 16-bit mm (on CUDA), bias_grad, norm backward dx
    sum or activation backward dbias to fp32 through nodes used by nothing else, else None."""
    if node.op != "call_function" or node.target is not torch.ops.aten._to_copy.default:
        return None
    if set(node.kwargs) - {"dtype", "layout", "device"} or node.kwargs.get("dtype") != torch.float32:
        return None
    if node.kwargs.get("layout", torch.strided) != torch.strided or len(node.args) != 1:
        return None
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
        return None
    chain = []
    link = node.args[0]
    while isinstance(link, fx.Node) and link.op == "call_function" and link.target in _LAYOUT:
        if len(link.users) != 1:
            return None
        chain.append(link)
        link = link.args[0]
    if not isinstance(link, fx.Node) or link.op != "call_function" or len(link.users) != 1:
        return None
    if _is_norm_dx_sum(link) or _is_activation_dbias(link):
        return [link, *reversed(chain)]
    val = link.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype not in _HALF or val.device != out.device:
        return None
    if link.target is torch.ops.aten.mm.default:
        if val.device.type != "cuda" or link.kwargs:
            return None  # aten.mm.dtype has a CUDA kernel only
    elif link.target is not torch.ops.transfuse.bias_grad.default:
        return None
    return [link, *reversed(chain)]


def _is_norm_dx_sum(node: fx.Node) -> bool:
    """getitem(layer_norm_backward, 3) summed in 16 bits, read by nothing else (its getitem may have no
    fake value: torch 2.11's AOTAutograd leaves them without)."""
    if node.target is not operator.getitem or node.args[1] != _NORM_DX_SUM:
        return False
    norm_bwd = node.args[0]
    if not isinstance(norm_bwd, fx.Node) or norm_bwd.target is not torch.ops.transfuse.layer_norm_backward.default:
        return False
    if norm_bwd.kwargs or len(norm_bwd.args) <= _NORM_DX_SUM_DTYPE:
        return False
    others = [u for u in norm_bwd.users if u is not node and u.target is operator.getitem and u.args[1] == _NORM_DX_SUM]
    return norm_bwd.args[_NORM_DX_SUM_DTYPE] in _HALF and not others


def _is_activation_dbias(node: fx.Node) -> bool:
    """getitem(activation_bias_backward, 1) in 16 bits, read by nothing else."""
    if node.target is not operator.getitem or node.args[1] != 1:
        return False
    act_bwd = node.args[0]
    if not isinstance(act_bwd, fx.Node) or act_bwd.target is not torch.ops.transfuse.activation_bias_backward.default:
        return False
    if act_bwd.kwargs or len(act_bwd.args) != 3:
        return False  # a dbias_dtype given already
    pre = act_bwd.args[1].meta.get("val") if isinstance(act_bwd.args[1], fx.Node) else None
    others = [u for u in act_bwd.users if u is not node and u.target is operator.getitem and u.args[1] == 1]
    return isinstance(pre, torch.Tensor) and pre.dtype in _HALF and not others
