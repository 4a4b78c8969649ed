"""Attention masks that are exactly causal, recognised in a training graph so that the attention
kernels get `is_causal` and skip the blocks above the diagonal instead of reading a T x T mask.

Three forms, each proven before it is replaced:

* `CausalMaskBuffer` (causal_buffer) — nanoGPT's registered `tril(ones)` buffer, sliced to T x T
  and compared with 0. Its value is read at compile time.
* `CausalMaskFromShapes` (causal_from_shapes) — a mask computed from the sequence length alone, as
  Hugging Face's `create_causal_mask` builds one under tracing (`kv_idx <= q_idx` over aranges,
  expanded over the batch) when the model gets no attention_mask. The mask's subgraph reads no
  tensor input, only sizes, so it is run at compile time on sequence lengths beyond every integer
  constant it contains (a sliding window of W is causal below W and not above: the probe sees
  both), for two batch sizes, and must equal the lower triangle at every one of them.
* `CausalKeyPadding` (causal_key_padding) — the same with the model's attention_mask on the keys:
  the causal triangle and the keys whose attention_mask is nonzero, probed with padding patterns;
  the attention gets is_causal and a (batch, 1, 1, T) key mask.

None of them runs on inference graphs: there the mask gets a block summary once per forward, which
skips the same blocks and also handles padding. One form is for inference graphs:

* `KeyPadding` (key_rows) — a bidirectional bool mask that keeps, for every query, the keys k with
  P[b, k] != 0: Hugging Face's encoder mask (BERT's `create_bidirectional_mask` under tracing)
  indexes P with aranges, then broadcasts the (batch, 1, 1, keys) result over the queries with an
  `&` of `q >= 0`. The (batch, 1, 1, keys) node inside the mask's own computation that the probe
  proves equal to the whole mask at every query becomes the attention's mask: the kernels read one
  row per batch (its block summary too), and the broadcast's kernels are dead code. Nothing new
  enters the graph: the node was there, so are its inputs.
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from transfuse.passes.graph import evaluate_all, kind, node_order, scalar, tensor_meta, value
from transfuse.passes.manager import PassContext

# The probe runs the mask at this many query positions at most (a bool T x T tensor: 64 MiB at 8192).
MAX_PROBE_LENGTH = 8192


def causal_buffer(ctx: PassContext, spec: dict) -> bool:
    """nanoGPT's mask: `scores.masked_fill(self.bias[:, :, :T, :T] == 0, -inf)` over a registered
    buffer that holds tril(ones) (or `torch.where(bias[..] != 0 / .bool(), scores, -inf)`). The top-left
    T x T corner of a lower-triangular buffer is causal for every T. The buffer is read at compile time
    and is assumed not to change afterwards, as a causal-mask buffer does not."""
    if not ctx.training or len(spec["bool_masks"]) != 1:
        return False
    how, cond = spec["bool_masks"][0]
    if not isinstance(cond, fx.Node):
        return False
    want_zero = how == "fill"  # masked where the buffer is 0, or kept where it is nonzero
    comparison = kind(cond)
    if comparison in ("eq", "ne") and len(cond.args) == 2 and scalar(cond.args[1]) == 0.0:
        if (comparison == "eq") != want_zero:
            return False
        sliced = cond.args[0]
    else:
        return False
    if not (isinstance(sliced, fx.Node) and sliced.op == "call_function" and sliced.target is operator.getitem):
        return False
    buffer, index = sliced.args
    tril_buffer = ctx.placeholder_value(buffer) if isinstance(buffer, fx.Node) else None
    if tril_buffer is None or tril_buffer.dim() < 2 or tril_buffer.shape[-1] != tril_buffer.shape[-2] or not isinstance(index, tuple):
        return False
    *lead, rows, cols = index
    if len(index) != tril_buffer.dim() or any(i != slice(None) for i in lead):
        return False
    if not all(isinstance(i, slice) and i.start in (None, 0) and i.step is None for i in (rows, cols)) \
            or rows.stop is not cols.stop and str(rows.stop) != str(cols.stop):
        return False
    q_len, k_len = tensor_meta(spec["q"]).shape[-2], tensor_meta(spec["v"]).shape[-2]
    if str(q_len) != str(k_len):
        return False
    n = tril_buffer.shape[-1]
    tril = torch.ones(n, n, dtype=torch.bool, device=tril_buffer.device).tril()
    return bool(((tril_buffer != 0) == tril).all())


def causal_from_shapes(ctx: PassContext, spec: dict) -> bool:
    """Whether the spec's one mask is computed from sizes alone and is the causal lower triangle at
    every probed length (module docstring)."""
    found = _one_mask(ctx, spec)
    if found is None:
        return False
    mask, keep_where, seq, (nodes, sizes, tensors, biggest) = found
    probes = _probe_sizes(biggest, seq, spec)
    if tensors or probes is None:
        return False
    for seq_len, other in probes:
        result = _run(nodes, mask, _size_env(sizes, seq, seq_len, other))
        if result is None or not _is_causal(result, seq_len, keep_where):
            return False
    return True


def causal_key_padding(ctx: PassContext, spec: dict) -> tuple[fx.Node, tuple[bool, bool]] | None:
    """(the model input P (batch, seq), whether each of its dims must be exactly that size) when the
    spec's one mask is the causal triangle and the keys k with P[b, k] != 0: Hugging Face's mask when the model gets an attention_mask (a data collator
    always passes one). The attention then gets is_causal and a (batch, 1, 1, seq) key mask instead
    of reading a T x T one. Proven as causal_from_shapes is, for P of all ones, all zeros, right and
    left padding and random values (2 and -3 among them: any nonzero value keeps a key)."""
    found = _one_mask(ctx, spec) if not spec.get("dropout_p", 0.0) else None  # SDPA takes no mask with is_causal
    if found is None:
        return None
    mask, keep_where, seq, (nodes, sizes, tensors, biggest) = found
    probes = _probe_sizes(biggest, seq, spec)
    if len(tensors) != 1 or probes is None:
        return None
    (padding,) = tensors
    meta = tensor_meta(padding)
    if meta.dim() != 2 or meta.dtype.is_complex:
        return None
    own = [d.node.expr if isinstance(d, torch.SymInt) else None for d in meta.shape]
    if any(e is not None and not isinstance(e, sympy.Symbol) for e in own):
        return None
    generator = torch.Generator().manual_seed(0)
    exact = [False, False]  # P's rows, P's columns
    for seq_len, other in probes:
        # P of the batch's and the keys' sizes, then with more rows, then more columns: where the
        # mask also reads P[b, k] for b < batch, k < keys of a larger P, so may the key mask; where
        # it fails or reads P otherwise (GPT-2 views it as (batch, -1)), that dim of P must be
        # exactly the batch's or the keys' (checked at run time)
        for dim, (rows, cols) in ((None, (other, seq_len)), (0, (other + 1, seq_len)), (1, (other, seq_len + 3))):
            if dim is not None and exact[dim]:
                continue
            if any(e is None and n != d for e, n, d in zip(own, (rows, cols), meta.shape)):
                if dim is None:
                    return None
                exact[dim] = True  # a static dim of P: only its own size
                continue
            fixed = {e: n for e, n in zip(own, (rows, cols)) if e is not None}
            env = _size_env(sizes, seq, seq_len, other, fixed)
            for pattern in _padding_patterns(rows, cols, generator):
                env[padding] = pattern.to(dtype=meta.dtype, device=meta.device)
                result = _run(nodes, mask, env)
                keep = (pattern[:other, :seq_len] != 0)[:, None, None, :].to(meta.device)
                if result is None or not _is_causal(result, seq_len, keep_where, keys=keep):
                    if dim is None:
                        return None
                    exact[dim] = True
                    break
    return padding, tuple(exact)


def key_rows(ctx: PassContext, spec: dict) -> fx.Node | None:
    """In an inference graph, the node of the spec's one bool mask's own computation that is its
    (batch, 1, 1, keys) row of kept keys: the mask keeps, for every query, exactly the keys that
    node keeps (module docstring); None when there is no such node or the probe cannot prove it.
    Proven for the model input P (batch, keys) of all ones, all zeros, right and left padding and
    random values (any nonzero value keeps a key), at sequence lengths beyond every integer constant
    of the mask."""
    found = _one_mask(ctx, spec, training=False)
    if found is None or found[1] is not None:  # SDPA's own mask argument only
        return None
    mask, _, seq, (nodes, sizes, tensors, biggest) = found
    meta = tensor_meta(mask)
    probes = _probe_sizes(biggest, seq, spec)
    if meta.dtype != torch.bool or meta.dim() != 4 or len(tensors) != 1 or probes is None:
        return None
    batch, keys = str(meta.shape[0]), str(meta.shape[-1])

    def is_row(node):
        m = tensor_meta(node)
        return (m is not None and m.dtype == torch.bool and m.dim() == 4 and tuple(map(str, m.shape)) == (batch, "1", "1", keys))

    candidates = [n for n in reversed(nodes) if n is not mask and is_row(n)]  # the nearest to the mask first
    (padding,) = tensors
    p_meta = tensor_meta(padding)
    own = [d.node.expr if isinstance(d, torch.SymInt) else None for d in p_meta.shape]
    if not candidates or p_meta.dim() != 2 or any(e is not None and not isinstance(e, sympy.Symbol) for e in own):
        return None
    generator = torch.Generator().manual_seed(0)
    for seq_len, other in probes:
        if own[0] is None:
            other = p_meta.shape[0]  # a static batch (Dynamo keeps a batch of one static): the graph's own
        shape = (other, seq_len)
        if own[1] is None and p_meta.shape[1] != seq_len:
            return None  # static keys of P beside a dynamic sequence: not proven here
        env = _size_env(sizes, seq, seq_len, other, {e: n for e, n in zip(own, shape) if e is not None})
        if env is None:
            return None
        for pattern in _padding_patterns(other, seq_len, generator):
            env[padding] = pattern.to(dtype=p_meta.dtype, device=p_meta.device)
            values = _run_all(nodes, env)  # the mask and every candidate from one run of the region
            whole = values.get(mask) if values is not None else None
            if not isinstance(whole, torch.Tensor) or whole.dim() != 4 or whole.shape[-2] != seq_len:
                return None
            candidates = [c for c in candidates if _same_at_every_query(whole, values[c])]
            if not candidates:
                return None
    return candidates[0]


def key_padding_mask(padding: torch.Tensor, batch: int, keys: int, exact: tuple[bool, bool]) -> torch.Tensor:
    """The (batch, 1, 1, keys) bool mask of the keys `padding` keeps (nonzero), as the graph computes
    it in place of a CausalKeyPadding mask: P[:batch, :keys]. A dim of P that the model's own mask
    read only at exactly the batch's or the keys' size (`exact`) must have it: a one-line error
    otherwise, where eager would fail or read P differently."""
    rows, cols = padding.shape
    message = (lambda: f"transfuse: attention_mask of shape ({rows}, {cols}) for {batch} sequences of {keys} "
               "tokens; pass one of the input's shape")
    torch._check(rows == batch if exact[0] else rows >= batch, message)
    torch._check(cols == keys if exact[1] else cols >= keys, message)
    return (padding[:batch, :keys] != 0)[:, None, None, :]


def _one_mask(ctx: PassContext, spec: dict, training: bool = True) -> tuple | None:
    """(the spec's one mask, keep_where (None: SDPA's mask, bool True keeps, additive 0 keeps; else
    whether the bool keeps), the sequence length (_sequence_symbol), _mask_region of the mask) in a
    training graph (an inference one with training=False) whose attention has exactly one mask that
    the probe can run; else None."""
    if ctx.training != training or len(spec["masks"]) + len(spec["bool_masks"]) != 1:
        return None
    if spec["masks"]:
        mask, keep_where = spec["masks"][0], None
    else:
        how, mask = spec["bool_masks"][0]
        keep_where = how == "keep"
    seq = _sequence_symbol(spec)
    if not isinstance(mask, fx.Node) or tensor_meta(mask) is None or seq is None:
        return None
    region = _mask_region(mask)
    return None if region is None else (mask, keep_where, seq, region)


def _probe_sizes(biggest: int, seq: sympy.Symbol | int, spec: dict) -> list[tuple[int, int]] | None:
    """(sequence length, batch) pairs to run a mask at: lengths beyond every integer constant in it
    (None when that would pass MAX_PROBE_LENGTH: not provable here); a static length (and batch)
    alone, the only ones the graph runs at."""
    if isinstance(seq, int):
        batch = tensor_meta(spec["q"]).shape[0]
        return [(seq, batch if isinstance(batch, int) else 2)]
    length = max(2 * biggest + 3, 67)
    return [(1, 2), (17, 3), (length, 2)] if length <= MAX_PROBE_LENGTH else None


def _size_env(sizes: list[fx.Node], seq: sympy.Symbol, seq_len: int, other: int, fixed: dict | None = None) -> dict | None:
    env = {}
    for leaf in sizes:
        size = _size_value(leaf, seq, seq_len, other, fixed or {})
        if size is None:
            return None
        env[leaf] = size
    return env


def _run(nodes: list[fx.Node], mask: fx.Node, env: dict | None):
    values = _run_all(nodes, env) if env is not None else None
    return values[mask] if values is not None else None


def _run_all(nodes: list[fx.Node], env: dict) -> dict | None:
    """The probe: every node's value (None where an op cannot run at compile time)."""
    try:
        with torch.no_grad():
            return evaluate_all(nodes, env)
    except Exception:  # an op the probe cannot run at compile time: nothing is proven
        return None


def _padding_patterns(batch: int, seq_len: int, generator: torch.Generator) -> list[torch.Tensor]:
    ones = torch.ones(batch, seq_len, dtype=torch.int64)
    right, left = ones.clone(), ones.clone()
    right[0, seq_len // 2 + 1:] = 0
    left[-1, : seq_len // 3] = 0
    values = torch.tensor([0, 1, 1, 2, -3])
    random = values[torch.randint(0, len(values), (batch, seq_len), generator=generator)]
    return [ones, torch.zeros_like(ones), right, left, random]


def _sequence_symbol(spec: dict) -> sympy.Symbol | int | None:
    """The query length when queries and keys have that same length: its symbol when dynamic, the
    int when static (the graph is then traced again for any other length)."""
    q_len, k_len = tensor_meta(spec["q"]).shape[-2], tensor_meta(spec["v"]).shape[-2]
    if str(q_len) != str(k_len):
        return None
    if not isinstance(q_len, torch.SymInt):
        return int(q_len)
    expr = q_len.node.expr
    return expr if isinstance(expr, sympy.Symbol) else None


def _mask_region(mask: fx.Node) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node], int] | None:
    """(the nodes computing `mask` in graph order, their size leaves, their tensor-input leaves, the
    largest integer constant among their arguments). A size leaf is a SymInt or int node (a
    placeholder, `x.size(1)`...), a tensor leaf a placeholder holding a tensor (the model's inputs:
    attention_mask). None when the mask reads anything else (an attribute, a value without a record)."""
    seen: set[fx.Node] = set()
    nodes, sizes, tensors = [], [], []
    biggest = 0
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        recorded = value(node)
        if isinstance(recorded, (torch.SymInt, int)) and not isinstance(recorded, bool):
            sizes.append(node)  # assigned a value by the probe, whatever computes it
            continue
        if node.op == "placeholder" and isinstance(recorded, torch.Tensor):
            tensors.append(node)
            continue
        if node.op in ("placeholder", "get_attr", "output") or not isinstance(recorded, torch.Tensor):
            return None
        nodes.append(node)
        for a in _flat(node.args) + _flat(node.kwargs):
            if isinstance(a, fx.Node):
                stack.append(a)
            elif isinstance(a, int) and not isinstance(a, bool):
                biggest = max(biggest, abs(a))
    order = node_order(mask.graph)
    return sorted(nodes, key=order.__getitem__), sizes, tensors, biggest


def _flat(args) -> list:
    if isinstance(args, dict):
        args = list(args.values())
    out = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.extend(_flat(a))
        elif isinstance(a, slice):
            out.extend([a.start, a.stop, a.step])
        else:
            out.append(a)
    return out


def _size_value(leaf: fx.Node, seq: sympy.Symbol, seq_len: int, other: int, fixed: dict) -> int | None:
    """The probe's value of a size node: its expression with the sequence symbol at seq_len, the
    symbols in `fixed` (a mask input's own dims) at theirs, every other symbol (the batch) at `other`."""
    size = value(leaf)
    if isinstance(size, int):
        return size
    expr = size.node.expr
    result = expr.subs({s: (seq_len if s == seq else fixed.get(s, other)) for s in expr.free_symbols})
    return int(result) if result.is_Integer else None


def _is_causal(mask: torch.Tensor, seq_len: int, keep_where: bool | None, keys: torch.Tensor | None = None) -> bool:
    """Whether `mask` (bool, or additive when keep_where is None and it is floating) keeps exactly
    the lower triangle of every (seq_len, seq_len) slice (and of those keys only, when `keys`, a
    (batch, 1, 1, seq_len) bool, is given)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or tuple(mask.shape[-2:]) != (seq_len, seq_len):
        return False
    if mask.dtype == torch.bool:
        keep = mask if keep_where in (None, True) else ~mask
    elif mask.dtype.is_floating_point and keep_where is None:
        # additive: 0 keeps, and a masked score must vanish in the softmax as under -inf. With key
        # padding a row can lose every key: eager then spreads a finite mask's row (Hugging Face's
        # dtype minimum) evenly over all keys, where -inf and the kernels give zeros; only -inf then.
        masked = torch.isinf(mask) if keys is not None else mask <= torch.finfo(mask.dtype).min / 2
        if not bool(((mask == 0) | masked).all()):
            return False
        keep = mask == 0
    else:
        return False
    expected = torch.ones(seq_len, seq_len, dtype=torch.bool, device=mask.device).tril()
    if keys is not None:
        expected = expected & keys
        if keep.shape[0] != keys.shape[0]:  # the mask must follow each row's padding
            return False
    return bool((keep == expected).all())


def _same_at_every_query(whole: torch.Tensor, row) -> bool:
    """Whether a (batch, 1, 1, keys) bool `row` equals the (batch, heads, queries, keys) bool mask
    `whole` at every head and query."""
    return (isinstance(row, torch.Tensor) and row.dtype == torch.bool and row.dim() == 4
            and row.shape[0] == whole.shape[0] and tuple(row.shape[1:3]) == (1, 1) and row.shape[-1] == whole.shape[-1]
            and bool((whole == row).all()))
