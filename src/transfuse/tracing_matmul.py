"""While Dynamo traces a transfuse forward without gradients: torch.matmul's fake-tensor rule for two
3-d operands with the same batch size is torch.bmm's, so that the trace makes no guard on the batch.

Dynamo runs every `a @ b` on fake tensors to learn its output's shape, through matmul's Python
decomposition (torch/_decomp/decompositions.py). For two 3-d operands it expands and reshapes each
one to (batch, n, m) first, and reshaping an expanded operand (stride 0 along the batch) asks whether
the batch is 1: a guard `input_ids.size()[0] != 1`. Llama's rotary embedding (and every family that
copied it: Mistral, Qwen, Gemma, Phi-3, ...) multiplies `inv_freq[None, :, None].expand(batch, -1, 1)`
by the position ids that way, so a model traced at batch 3 traced its prefill and its decode step
again at the first batch of 1, and the other way round (development CPU, torch 2.13, transformers
5.17, bench/first_generate_phases.py; a Llama-1.1B trace takes seconds on a GPU host).

F.linear on a (batch, n, k) input takes the same decomposition (folded to (batch * n, k) by a reshape
that guards the same way when the input is a slice, as the LM head's last position is in a decode step).

For 3-d operands whose batch sizes are provably equal (the same symbol, or the same number), and for
a 3-d operand times a matrix (the matrix expanded along the batch), matmul is bmm: same values, same
contiguous (batch, n, p) output. F.linear with a bias is not covered: it takes torch's C++ path
(addmm on the folded input), which has no Python rule to swap, and still guards on a sliced batch
(Phi's and GPT-J's LM heads in a decode step: one more trace there, development CPU).

Only the fake-tensor rule changes: the graph still records `a @ b`, which runs as torch.matmul, and
every other case (other ranks, broadcast batches, out=) takes the decomposition as it is. The rule is swapped in by the
compile-start callback of tracing_sdpa.py (shared, counted and given back as that module's SDPA
switch is) and given back before transfuse's backend reads the graph; TRANSFUSE_TRACE_SDPA=math or
=as-is leaves matmul alone too.
"""

from __future__ import annotations

import torch
from torch._C import DispatchKey
from torch.fx.experimental.symbolic_shapes import statically_known_true

_OP = torch.ops.aten.matmul.default
_KEY = DispatchKey.CompositeImplicitAutograd


def current():
    """matmul's CompositeImplicitAutograd rule as registered now (None in a build that has none)."""
    return getattr(_OP, "py_kernels", {}).get(_KEY)


_ORIGINAL = current()  # torch's own decomposition


def available() -> bool:
    return _ORIGINAL is not None and hasattr(_OP, "_dispatch_cache")


def guard_free(tensor1, tensor2, **kwargs):
    """matmul's fake-tensor rule while a transfuse trace runs: bmm's where it is matmul (see above)."""
    if not kwargs and tensor1.dim() == 3:
        if tensor2.dim() == 3 and statically_known_true(tensor1.shape[0] == tensor2.shape[0]):
            return torch.bmm(tensor1, tensor2)
        if tensor2.dim() == 2:  # a linear's (batch, n, k) @ (k, p): one weight for every batch row
            return torch.bmm(tensor1, tensor2.expand(tensor1.shape[0], *tensor2.shape))
    return _ORIGINAL(tensor1, tensor2, **kwargs)


def install(rule) -> None:
    """Sets matmul's CompositeImplicitAutograd rule (`guard_free`, or what current() returned)."""
    _OP.py_kernels[_KEY] = rule
    _OP._dispatch_cache.clear()

