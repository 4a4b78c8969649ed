"""The Dynamo backend: runs the passes on each captured graph and hands it to the runtime.

`torch.compile(model, backend="transfuse")` reaches `transfuse_backend` (registered on import and as a
`torch_dynamo_backends` entry point); `transfuse.optimize()` builds a `Backend` bound to the model's
state so that `transfuse.report(model)` can show what happened.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from transfuse import ops  # noqa: F401  (registers torch.ops.transfuse.*)
from transfuse import tracing_sdpa
from transfuse.kernels._config import INTERPRET
from transfuse.ops.cross_entropy import attach_returned_logits
from transfuse.passes.graph import static_inputs, written_inputs
from transfuse.passes.host_tensors import host_copies
from transfuse.passes.manager import PassContext, Rejection, run_passes
from transfuse.passes.padding import plan_padding
from transfuse.report import GraphRecord, compute_flops
from transfuse.runtime.buckets import BucketPolicy, PaddedRunner
from transfuse.runtime.cuda_graphs import AddressCheck, CudaGraphRunner, GraphCache, GraphPool, first_line
from transfuse.runtime.instances import Instances, pristine_copy
from transfuse.runtime.training_graphs import TrainingGraphs
from transfuse.runtime.weights import MergedWeights

log = logging.getLogger("transfuse")


class TransfuseError(RuntimeError):
    """Bad input: the message is one line and names the fix."""


class StaleGraph(RuntimeError):
    """A parameter changed dtype, device or shape (`model.half()`, `model.to(...)`) but Dynamo
    reused the graph compiled for the old one (optimize() drops Dynamo's guards on module state, and
    Dynamo skips tensor guards on parameters whose module dict is unchanged anyway). `optimize()`
    catches this and compiles afresh."""


# What a Backend reads (optimize()'s keywords that reach it, and training_graphs); anything else is a
# typo or an option of another backend, refused so that it is never silently without effect.
OPTIONS = ("buckets", "cuda_graphs", "disable", "dynamic", "max_graphs", "module_guards", "training_graphs")
# torch.compile(mode=...): transfuse replays CUDA graphs by itself (optimize's cuda_graphs), so the
# modes that ask for that, or for nothing, mean what they say; the others ask for Inductor's tuning.
COMPILE_MODES = (None, "default", "reduce-overhead")


class Backend:
    """A Dynamo backend bound to one optimized model's options and records."""

    def __init__(self, **options):
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TransfuseError(f"transfuse: unknown option{'s' if len(unknown) > 1 else ''} "
                                 f"{', '.join(map(repr, unknown))}; the options are {', '.join(OPTIONS)}")
        self.options = options
        self.records: list[GraphRecord] = []
        self.graphs: list[fx.GraphModule] = []  # the rewritten graphs, for tests and debugging
        self.runners: list = []
        self.pool = GraphPool()
        self.merged: list[MergedWeights] = []
        self._slots: list = []  # (runner, merged weights) per compiled graph, None once released
        self.graph_calls = 0  # calls of any compiled graph: whether a failed model call ran one
        self.compile_ids: set[str] = set()  # Dynamo's "frame/compile" of each trace this backend compiled

    def release(self) -> None:
        """Drops the graphs, CUDA graphs and merged weights this backend holds (the records stay,
        for the report). Called when the optimized model is restored or garbage collected."""
        for runner in self.runners:
            if hasattr(runner, "graphs"):
                runner.graphs.clear()
        for gm in self.graphs:
            # Dynamo's cache entries may keep the traced graph itself alive: not the tensors on it.
            for name in [n for n in gm._buffers if n.startswith("_transfuse")]:
                delattr(gm, name)
            for node in gm.graph.nodes:
                if node.op == "get_attr" and str(node.target).startswith("_transfuse"):
                    node.meta.pop("example_value", None)  # the real buffer, as the passes recorded it
        self._slots[:] = [None] * len(self._slots)
        self.runners.clear()
        self.graphs.clear()
        self.merged.clear()

    def __call__(self, gm: fx.GraphModule, example_inputs: list):
        compile_id = torch._guards.CompileContext.current_compile_id()
        if compile_id is not None:  # "frame/compile", as Dynamo's guard failures name a trace (capture.py)
            self.compile_ids.add(f"{compile_id.frame_id}/{compile_id.frame_compile_id}")
        tracing_sdpa.restore()  # the user's SDPA flags for the passes and the graph (tracing_sdpa.py)
        tracing_sdpa.untrace(gm)  # the stand-in SDPA nodes of a trace without gradients, SDPA again
        if _host_graph(gm, example_inputs):
            return self._as_traced(gm, "every input is on the CPU and none is a parameter: host-side bookkeeping "
                                       "between the model's GPU graphs; it runs as traced")
        _check_inputs(gm, example_inputs)
        # Dynamo may run this graph for another instance of the module it traced (runtime/instances.py):
        # that instance gets a compile of its own, from the graph as traced.
        static = sorted(static_inputs(gm).values())
        instances = None
        if static:
            instances = Instances(pristine_copy(gm), static,
                                  lambda graph, inputs: self._compile(graph, inputs, static, instances, instance=True))
        return self._compile(gm, example_inputs, static, instances)

    def _as_traced(self, gm: fx.GraphModule, reason: str):
        """A graph no pass touches, in the report with the reason."""
        first = next((n.name for n in gm.graph.nodes if n.op == "placeholder"), "graph")
        flops = compute_flops(gm)
        self.records.append(GraphRecord(rewrites={}, rejections=[Rejection("HostGraph", first, reason)],
                                        flops_total=flops, flops_transfuse=0.0, cuda_graphs=False,
                                        nodes=len(gm.graph.nodes)))
        log.info("transfuse: a graph %s", reason)
        return gm

    def _compile(self, gm: fx.GraphModule, example_inputs: list, static: list[int], instances: Instances | None,
                 instance: bool = False):
        """Passes and runtime for one graph; `static`: the positions of its parameter and buffer
        inputs (the passes keep the placeholders)."""
        flops_before = compute_flops(gm)
        # A graph traced with gradients on and a tensor that needs them is a training graph: only
        # passes whose ops have a backward run, it is never padded, and it runs as AOTAutograd's
        # forward and backward graphs (runtime/training_graphs.py), not through these runners.
        training = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)
        ctx = PassContext(gm=gm, example_inputs=list(example_inputs), options=self.options, training=training)
        run_passes(ctx, disabled=frozenset(self.options.get("disable", ())))
        merged = MergedWeights(ctx.merged_weights)
        self.merged.append(merged)
        use_graphs = (self.options.get("cuda_graphs", True) and not training and _on_cuda(example_inputs)
                      and _graph_safe(gm, example_inputs))
        copies = host_copies(gm) if use_graphs else []
        if copies:  # a host tensor the passes could not build on the GPU: capture would refuse its copy
            use_graphs = False
            ctx.rejections.append(Rejection("CudaGraphs", copies[0].name,
                                            "copies a tensor built on the CPU to the GPU at every call; "
                                            "this graph runs without CUDA graphs"))
        # Inputs the graph writes in place (a static KV cache): a CUDA graph must write the caller's
        # tensor itself, not a copy, so they are read in place like parameters and never padded.
        written = sorted(written_inputs(gm) - set(static))
        padding = self.options.get("buckets", None) is not False and not training
        plan = plan_padding(gm) if padding and not written else None
        if padding and written:
            names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
            ctx.rejections.append(Rejection("BucketPadding", names[written[0]],
                                            "the graph writes into this input in place; every input runs at its exact size"))
        if plan is not None:
            for symbol, reason in sorted(plan.refused.items(), key=str):
                ctx.rejections.append(Rejection("BucketPadding", plan.names[symbol], reason + "; run at its exact size"))
        training_runtime = None
        if training and _training_graphs(self.options, example_inputs):
            runner, training_runtime = _training_runner(gm, example_inputs, static, self.options)
            use_graphs = isinstance(runner, TrainingGraphs) and runner.skipped is None
        elif plan is not None and plan.paddable:
            policy = BucketPolicy(self.options.get("buckets"))
            runner = PaddedRunner(gm, plan, static, self.pool, policy, use_graphs, self.options.get("max_graphs", 32))
        else:
            runner = (CudaGraphRunner(gm, static, self.pool, self.options.get("max_graphs", 32), written=written)
                      if use_graphs else gm)
        self.runners.append(runner)
        record = GraphRecord(
            rewrites=dict(ctx.rewrites),
            rejections=list(ctx.rejections),
            flops_total=flops_before,
            flops_transfuse=compute_flops(gm, transfuse_only=True),
            cuda_graphs=use_graphs,
            nodes=len(gm.graph.nodes),
            training=training,
            instance=instance,
        )
        if training_runtime is not None:
            record.training_runtime = training_runtime
        if isinstance(runner, TrainingGraphs):
            runner.record = record  # told when the backward, compiled at its first call, turns graphs off
            record.rewrites.update(runner.backward_rewrites)  # a backward compiled already
        self.records.append(record)
        self.graphs.append(gm)
        log.info("transfuse: %s", record.summary())
        ctx.example_inputs.clear()  # drop references to the real tensors

        # Dynamo's guards on module parameters are dropped by optimize() (see guards.py): this one
        # C call per call notices any parameter that moved; a moved one must keep its dtype, device
        # and shape, or the graph is compiled afresh.
        params = [(i, example_inputs[i].dtype, example_inputs[i].device, example_inputs[i].shape) for i in static]
        addresses = AddressCheck(example_inputs, static)
        if isinstance(runner, GraphCache):
            runner.param_check = addresses  # its graphs rely on this check (GraphCache.param_check)
        owners = instances.owners(example_inputs) if instances is not None else None

        # Dynamo keeps every backend alive for the life of the process (torch._dynamo.eval_frame's
        # cached_backends): what holds memory (graph, CUDA graphs, merged weights) sits in a slot
        # that release() empties once the model is gone.
        returned_logits = list(ctx.returned_logits)
        slot = self._slots
        slot.append((runner, merged))
        index = len(slot) - 1

        def compiled(*args):
            self.graph_calls += 1
            held = slot[index]
            if held is None:
                raise StaleGraph("this graph was released (its model was restored or deleted)")
            runner, merged = held
            if not addresses.same(args):
                if instances is not None and instances.foreign(args, owners):
                    return instances(args)  # another module instance's parameters: its own compile
                for i, dt, dev, shp in params:
                    if args[i].dtype != dt or args[i].device != dev or args[i].shape != shp:
                        raise StaleGraph("a parameter changed dtype, device or shape since this graph was compiled")
                merged.refresh(args)  # a replaced member of a merged weight is copied in and re-pointed
                addresses.reset(args)
            if training:
                # One autograd node for the whole graph (TrainingGraphs), or autograd recording
                # through the graph's ops (ours have backward formulas).
                out = runner(*args)
                return attach_returned_logits(out, args, returned_logits) if returned_logits else out
            if not torch.is_grad_enabled():  # the caller's no_grad / inference_mode: no second context
                return runner(*args)
            with torch.no_grad():
                return runner(*args)

        return compiled


def transfuse_backend(gm: fx.GraphModule, example_inputs: list, mode: str | None = None,
                      options: dict | None = None, **direct):
    """Entry for `torch.compile(model, backend="transfuse", options={...})`: torch.compile hands the
    options dict (and a mode) over as keywords of their own."""
    if mode not in COMPILE_MODES:
        raise TransfuseError(f"torch.compile(backend=\"transfuse\"): mode={mode!r} is Inductor's; transfuse takes "
                             f"mode=None, \"default\" or \"reduce-overhead\" (it replays CUDA graphs itself; "
                             f"options={{\"cuda_graphs\": False}} turns them off)")
    return Backend(**{**(options or {}), **direct})(gm, example_inputs)


def _training_runner(gm: fx.GraphModule, example_inputs, static: list[int], options: dict):
    """(runner, how it runs, for the report) of a training graph: TrainingGraphs, or the graph
    itself under eager autograd where AOTAutograd cannot trace it (the report says why)."""
    # CUDA graphs only where every input is on the GPU; torch checks the rest (CPU ops, mutations).
    if not options.get("cuda_graphs", True):
        graphs, why_not = False, "optimize(cuda_graphs=False)"
    elif not _on_cuda(example_inputs):
        graphs, why_not = False, "not on a GPU"
    else:
        graphs, why_not = _graph_safe(gm, example_inputs), "an input is not on the GPU"
    try:
        runner = TrainingGraphs(gm, example_inputs, static, graphs, why_not,
                                disabled=frozenset(options.get("disable", ())))
    except torch._dynamo.exc.RestartAnalysis:
        raise  # Dynamo's own control flow (it traces the frame again)
    except Exception as e:  # an op AOTAutograd cannot trace: today's eager path still runs it
        reason = first_line(e)
        log.warning("transfuse: AOTAutograd could not trace a training graph (%s); it runs under eager autograd", reason)
        return gm, f"eager autograd through the graph's ops (AOTAutograd failed: {reason})"
    return runner, runner.describe()


def _training_graphs(options: dict, example_inputs) -> bool:
    """Whether a training graph runs as AOTAutograd's forward and backward graphs replayed as CUDA
    graphs: by default on a GPU (nanoGPT on an H100: 25 ms a step against 42-52 under eager autograd;
    Hugging Face's GPT-2 the same 53 ms either way; bench/results, ninth session), never by default
    on the CPU, where there are no CUDA graphs to gain. optimize(model, training_graphs=False) keeps
    eager autograd (a step's outputs then stay valid across steps); =True forces AOTAutograd on the
    CPU too (the tests use it)."""
    asked = options.get("training_graphs")
    return _on_cuda(example_inputs) if asked is None else bool(asked)


def _on_cuda(example_inputs) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)


def _graph_safe(gm: fx.GraphModule, example_inputs) -> bool:
    """CUDA graphs need every tensor on the GPU (a CPU tensor input means a host copy at capture)."""
    return all(not isinstance(t, torch.Tensor) or t.is_cuda for t in example_inputs)


def check_device(tensors) -> None:
    """The one device rule for optimize() and the backend: a CUDA GPU of compute capability 8.0+,
    or CPU tensors under Triton's interpreter."""
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if any(t.is_cuda for t in tensors):
        device = next(t.device for t in tensors if t.is_cuda)
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            raise TransfuseError(
                f"transfuse needs a GPU of compute capability 8.0 or newer (this one is {major}.{minor}); "
                "run the model without transfuse on it"
            )
    elif tensors and not INTERPRET:
        raise TransfuseError(
            "transfuse: the model is on the CPU; move it to a CUDA GPU (model.cuda()), or set "
            "TRITON_INTERPRET=1 before importing transfuse to run the kernels through Triton's interpreter"
        )


def _host_graph(gm: fx.GraphModule, example_inputs) -> bool:
    """A graph between two graph breaks that only counts on the host (Aria's experts take the
    per-expert token counts to the CPU and slice by them) in a model whose other graphs run on the
    GPU. Under Triton's interpreter every graph is on the CPU and compiles; a CPU graph that takes
    parameters is a model left on the CPU, which check_device refuses."""
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    return (not INTERPRET and bool(tensors) and not any(t.is_cuda for t in tensors)
            and not static_inputs(gm))


def _check_inputs(gm: fx.GraphModule, example_inputs) -> None:
    check_device(example_inputs)


torch._dynamo.register_backend(transfuse_backend, name="transfuse")
