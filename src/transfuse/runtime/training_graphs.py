"""A training graph as AOTAutograd's forward and backward graphs, each replayed as a CUDA graph.

Run eagerly, the rewritten graph pays for every op the dispatcher, the custom op's Python wrapper,
an autograd node and the Triton launcher: ~150 us of host time an op on an H100, which leaves a
GPT-2 step host-bound. Here PyTorch's own machinery takes over after the passes:

* AOTAutograd (torch._dynamo.backends.common.aot_autograd) traces forward and backward together
  through the ops' fake impls and register_autograd formulas and partitions them into one forward
  and one backward FX graph, run as one autograd.Function: one autograd node a graph, not one an op.
* cudagraph trees (torch._inductor.cudagraph_trees, what torch.compile(mode="reduce-overhead")
  runs) run each of the two graphs once eagerly (Triton compiles and autotunes there, never inside
  a capture), record it at its next call and replay it after, composed as in
  torch/_dynamo/backends/cudagraphs.py: the same skip checks, device index and stack traces. Unlike
  that backend, parameters are static inputs, read in place, as Inductor has them
  (fw_metadata.static_input_indices: Dynamo inputs that are parameters): the optimizer updates them
  in place, outside any graph, and the graphs see the new values; a parameter that moves re-records.

What happens where the graphs cannot simply replay:

* Not on CUDA (the interpreter's CPU tests): the two graphs run as plain FX code (`boxed_nop`).
* A CPU tensor among the inputs, an op on the CPU, an input mutated by the graph, an incompatible
  op: torch's check_for_skip says so, and both graphs run as plain FX code; the reason is kept for
  the report.
* Dropout: native_dropout (and SDPA's dropout) stays in the forward graph, its mask or philox
  state saved for the backward, which draws nothing. A CUDA graph registers the default CUDA
  generator at capture and at each replay takes the generator's offset and advances it by what its
  ops drew at capture, as eager would; the recording itself restores the RNG state. So a replay
  draws eager's masks under eager's seed. A torch.Generator of the model's own is not registered:
  its capture fails.
* A new shape (dynamic dims): cudagraphify_impl keys recordings on the graph's int inputs; each new
  size records once, then replays, and the old sizes keep their recordings.
* Several forwards before a backward (graph breaks, gradient checkpointing outside the graph,
  micro-batches whose losses are summed): cudagraph trees records each forward as a child of the
  one before while the earlier outputs are alive.
* Outputs live in the trees' memory pool until the next step starts (the first forward after a
  backward): a tensor kept from an earlier step (logits, an unreduced loss) raises on access, as
  under torch.compile(mode="reduce-overhead"); .item() or .clone() it first.
* A step that raises inside the graphs (out of memory: a batch-size search, a smaller batch retried
  after an OOM): torch's trees are left half-recorded and would fail the next step, so they are
  reset and every graph records again at its next call (_reset_trees_after_failure).
* Gradient accumulation: autograd's AccumulateGrad takes a backward output as `.grad` when nothing
  else holds it, so a `.grad` may live in the pool too and the next step would overwrite it.
  `unpool_grads()`, called before every forward, gives such gradients memory of their own; a loop
  that sets grads to None before the next forward (zero_grad's default) copies nothing.
* The optimizer step, gradient clipping, loss.item(): outside the graphs, untouched.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Callable

import torch


class TrainingGraphs:
    """The compiled training step of one Dynamo graph: call it with the Dynamo graph's inputs."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list, static: list[int], cuda_graphs: bool,
                 why_not: str = "not asked for", disabled: frozenset[str] = frozenset()):
        from torch._dynamo.backends.common import aot_autograd

        self.static = static  # positions of the parameters among the Dynamo inputs
        self.cuda_graphs = cuda_graphs
        self.skipped: str | None = None if cuda_graphs else why_not  # why CUDA graphs are off, when they are
        self.record = None  # the report's GraphRecord, told when the backward turns graphs off
        self.backward_rewrites: dict[str, int] = {}  # the backward graph's own passes, for the report
        self.disabled = disabled  # optimize(disable=...): backward passes named there do not run
        self.params: list = []
        self.pooled_ptrs: set[int] = set()  # storages of the backward's outputs since the last forward
        self.pool_owner = None  # weak reference to the tree manager whose pool holds them
        self.device_index: int | None = None
        if cuda_graphs:
            fw, bw = self._forward_graphs, self._backward_graphs
        else:
            fw = bw = _plain
        inference = functools.partial(fw, is_inference=True) if cuda_graphs else fw
        compiler = aot_autograd(fw_compiler=fw, bw_compiler=functools.partial(self._rewrite_backward, bw),
                                inference_compiler=inference, partition_fn=self._partition)
        self.fn = compiler(gm, example_inputs)

    def describe(self) -> str:
        if self.skipped is None:
            return "AOTAutograd forward + backward graphs, replayed as CUDA graphs (cudagraph trees)"
        return f"AOTAutograd forward + backward graphs, no CUDA graphs: {self.skipped}"

    def __call__(self, *args):
        if _POOLED:
            unpool_grads()
        if self.cuda_graphs:
            self.params = [args[i] for i in self.static]
        return self.fn(*args)

    # -- compilers handed to AOTAutograd ------------------------------------------------------

    def _partition(self, joint: torch.fx.GraphModule, joint_inputs, **kwargs):
        """AOTAutograd's default partition of the joint graph, after it is told what the backward
        recomputes instead of the forward saving it (passes/recompute_activations.py; in the report)."""
        from torch._functorch.partitioners import default_partition

        from transfuse.passes import recompute_activations

        if recompute_activations.NAME not in self.disabled:
            count = recompute_activations.run(joint)
            if count:
                self.backward_rewrites[recompute_activations.PATTERN] = count
        return default_partition(joint, joint_inputs, **kwargs)

    def _rewrite_backward(self, compile_backward: Callable, gm: torch.fx.GraphModule, inputs: list):
        """The backward graph's own passes (passes.manager.backward_registry), counted in the report."""
        from transfuse.passes.manager import backward_registry

        for p in backward_registry():
            if p.name in self.disabled:
                continue
            count = p.run(gm)
            if count:
                self.backward_rewrites[p.pattern] = count
        if self.backward_rewrites and self.record is not None:  # None when AOTAutograd compiles the backward at once
            self.record.rewrites.update(self.backward_rewrites)
        return compile_backward(gm, inputs)

    def _skip(self, reason: str) -> None:
        self.skipped = reason.strip().splitlines()[0][:200]
        if self.record is not None:
            self.record.training_runtime = self.describe()

    def _forward_graphs(self, gm: torch.fx.GraphModule, inputs: list, is_inference: bool = False):
        from torch._dynamo.backends.cudagraphs import find_input_mutations, get_device_index

        run = _plain(gm, inputs)
        fixed = _static_input_indices()
        reason = _skip_reason(gm, fixed)
        if reason is not None:
            self._skip(reason)
            return run
        self.device_index = get_device_index(gm)
        return _cudagraphify(run, gm, inputs, fixed, self.device_index, False, is_inference,
                             find_input_mutations(gm.graph))

    def _backward_graphs(self, gm: torch.fx.GraphModule, inputs: list):
        from torch._dynamo.backends.cudagraphs import find_input_mutations
        from torch._inductor.utils import count_tangents

        run = _plain(gm, inputs)
        if self.skipped is not None:  # the forward runs without graphs: so does the backward
            return run
        fixed = list(range(count_tangents(gm)))  # saved activations (the forward's outputs) stay put
        reason = _skip_reason(gm, fixed)
        if reason is not None:
            self._skip(f"backward: {reason}")
            device_index = self.device_index

            def eager_backward(args):
                # The forward replayed from the pool: tell its tree this backward ran (as
                # torch/_dynamo/backends/cudagraphs.py does), or the next step cannot start a new one.
                manager = _current_manager(device_index)
                if manager is not None:
                    manager.set_to_running_backward()
                return run(args)

            eager_backward._boxed_call = True
            return eager_backward

        graphs = _cudagraphify(run, gm, inputs, fixed, self.device_index, True, False, find_input_mutations(gm.graph))
        owner = weakref.ref(self)

        def backward(args):
            out = graphs(args)
            me = owner()
            if me is not None:  # where this step's gradients are, for unpool()
                me.pooled_ptrs.update(t.untyped_storage().data_ptr() for t in out if isinstance(t, torch.Tensor))
                manager = _current_manager(me.device_index)
                me.pool_owner = weakref.ref(manager) if manager is not None else None
                _POOLED.add(me)
            return out

        backward._boxed_call = True
        return backward

    def unpool(self) -> None:
        """Gives each parameter whose .grad is a backward output in the pool a copy of its own. When
        the pool is gone (cudagraph trees were reset, as torch._dynamo.reset() does, between this
        backward and the next forward), those gradients went with it: they become None, with a
        warning, instead of being read from freed memory ("CUDA error: invalid argument")."""
        ptrs, self.pooled_ptrs = self.pooled_ptrs, set()
        owner, self.pool_owner = self.pool_owner, None
        pooled = [p for p in self.params if p.grad is not None and p.grad.untyped_storage().data_ptr() in ptrs]
        manager = owner() if owner is not None else None
        if owner is not None and (manager is None or manager is not _current_manager(self.device_index)):
            for p in pooled:
                p.grad = None
            if pooled:
                warnings.warn(f"transfuse: CUDA graph trees were reset (torch._dynamo.reset()) after a backward: "
                              f"{len(pooled)} parameter gradients that were still in their memory pool are gone and "
                              "set to None (use them, or zero_grad(set_to_none=True), before resetting)")
            return
        for p in pooled:
            p.grad = p.grad.clone()


# Graphs whose backward left outputs in the CUDA-graph pool since the last forward. The pool belongs
# to cudagraph trees, one per device for the whole process: whichever graph starts the next step
# lets its replay overwrite every graph's outputs, so every graph's gradients are copied out then.
_POOLED: weakref.WeakSet = weakref.WeakSet()


def _current_manager(device_index):
    """The cudagraph tree manager that owns `device_index`'s pool now, or None."""
    from torch._inductor.cudagraph_trees import get_manager

    return get_manager(device_index, create_if_none_exists=False) if device_index is not None else None


def unpool_grads() -> None:
    """Copies every parameter gradient that still lives in the CUDA-graph pool into memory of its own."""
    for graphs in list(_POOLED):
        graphs.unpool()
    _POOLED.clear()


def _plain(gm: torch.fx.GraphModule, inputs: list) -> Callable:
    from torch._dynamo.backends.debugging import boxed_nop

    return boxed_nop(gm, inputs)


def _static_input_indices() -> list[int]:
    # As torch._inductor.compile_fx.get_static_input_idxs: the forward graph's inputs that are
    # parameters and buffers (AOTAutograd's metadata, read in the compiler's tracing context).
    context = torch._guards.TracingContext.try_get()
    if context is None or context.fw_metadata is None:
        return []
    return list(context.fw_metadata.static_input_indices)


def _skip_reason(gm: torch.fx.GraphModule, fixed: list[int]) -> str | None:
    """torch's reasons not to replay a graph (cudagraphs backend's check_for_skip), with input
    mutations counted against the static inputs as they are, not as a prefix of the inputs."""
    from torch._dynamo.backends.cudagraphs import check_for_skip, find_input_mutations
    from torch._inductor.cudagraph_utils import get_mutation_stack_trace, get_placeholder_info

    mutated = find_input_mutations(gm.graph) - set(fixed)
    if mutated:
        return get_mutation_stack_trace(get_placeholder_info(gm.graph), mutated)
    n_inputs = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
    return check_for_skip(gm, n_inputs)  # its own mutation check is done above


def _cudagraphify(run, gm, inputs, fixed, device_index, is_backward, is_inference, mutated):
    from torch._dynamo.backends.cudagraphs import get_stack_traces
    from torch._inductor.cudagraph_trees import cudagraphify_impl
    from torch._inductor.cudagraph_utils import get_placeholder_info

    # cudagraphify_impl keys its recordings on the inputs that are ints in `inputs` (the sizes of
    # dynamic dims); at compile time those are SymInts, which it would not see: every size would then
    # replay the first size's recording. A plain int marks their positions.
    inputs = [0 if isinstance(v, torch.SymInt) else v for v in inputs]
    stack_traces, placeholders = get_stack_traces(gm), get_placeholder_info(gm.graph)

    def build():
        return cudagraphify_impl(run, inputs, fixed, device_index=device_index, is_backward=is_backward,
                                 is_inference=is_inference, stack_traces=stack_traces,
                                 placeholders=placeholders, mutated_input_idxs=mutated)

    state = {"impl": build(), "generation": _TREES[0]}

    def call(args):
        if state["generation"] != _TREES[0]:  # the trees were reset after a failure: record afresh
            state["impl"], state["generation"] = build(), _TREES[0]
        try:
            return state["impl"](args)
        except Exception:
            _reset_trees_after_failure()
            raise

    call._boxed_call = True
    return call


# How many times the trees were reset after a failed run (see _reset_trees_after_failure).
_TREES = [0]


def _reset_trees_after_failure() -> None:
    """A run that raised inside cudagraph trees (out of memory, the usual case: a batch-size search,
    an OOM retried with a smaller batch) leaves the tree half-recorded, and the next step dies on an
    AssertionError inside torch (dealloc_current_path_weakrefs; bench/results, twentieth session).
    The trees are reset instead, as torch._dynamo.reset() resets them: every graph records again at
    its next call, and tensors still held from earlier steps keep their memory until they are freed."""
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    reset_cudagraph_trees()
    _TREES[0] += 1
