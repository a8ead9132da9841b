"""Build one GraphModule per stage from the traced graph and a Plan, and place weights on devices.

Each stage graph takes the values it needs (pipeline inputs or outputs of earlier stages,
skips included, by node name) and returns the values later stages or the model output
need. Parameters and buffers stay the model's own objects: each is moved in place to the
device of the stage that owns it; a stage on another device that also reads it (a tied
weight) gets a `.to(device)` copy inside its graph, so autograd sums both gradients into
the one parameter. A stage the plan recomputes (`StagePlan.recompute`) is that graph called
through runtime.recompute, which keeps less for backward and reruns what it dropped.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Sequence, cast

import torch
import torch.fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.modules.batchnorm import _BatchNorm

from runtime.batchnorm import DeferredBatchNorm, DeferredBatchNormOp
from runtime.loss_split import mark_loss_outputs
from runtime.mutation import after, check_cuts, mutated_inputs
from runtime.plan import Plan
from runtime.recompute import wrap
from runtime.stage_weights import tensor_stages
from runtime.tensor_parallel import parallelize_stage, rebind

__all__ = ["Stage", "build_stages", "stage_io", "switches_state"]

_DROP_TARGETS = {"_guards_fn", torch.ops.aten._assert_tensor_metadata.default}
# (tensor, device) pairs to give storage -> (ids of the tensors it filled, undo); see runtime.materialize
Materialize = Callable[[list[tuple[torch.Tensor, torch.device]]], tuple[set[int], Callable[[], None]]]
# (stage graph, stage index, device) -> {id(old parameter): new}: experts and sequence split (runtime.layer_split)
Rewrite = Callable[[torch.fx.GraphModule, int, torch.device], dict[int, nn.Parameter]]


@dataclass
class Stage:
    """A runnable stage: its module, device, and the value names it reads and writes."""

    index: int
    device: torch.device
    module: torch.fx.GraphModule
    inputs: list[str]
    outputs: list[str]
    deferred_bns: list[DeferredBatchNorm | DeferredBatchNormOp] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)  # inputs the stage writes into (in place)


def _export_batch_norms(gm: torch.fx.GraphModule) -> dict[str, tuple[Any, Any, Any, Any]]:
    """Training-mode aten.batch_norm nodes of a torch.export graph reading the model's running statistics:
    node name -> (running_mean, running_var, num_batches_tracked or None, momentum)."""
    found: dict[str, tuple[Any, Any, Any, Any]] = {}
    for node in gm.graph.nodes:
        if node.target is torch.ops.aten.batch_norm.default and len(node.args) >= 8 and node.args[5] is True:
            mean, var = node.args[3], node.args[4]
            if isinstance(mean, torch.fx.Node) and mean.op == "get_attr" and isinstance(var, torch.fx.Node):
                prefix = str(mean.target).rpartition(".")[0]
                try:
                    count = operator.attrgetter(f"{prefix}.num_batches_tracked".lstrip("."))(gm)
                except AttributeError:
                    count = None
                found[node.name] = (operator.attrgetter(str(mean.target))(gm), operator.attrgetter(str(var.target))(gm),
                                    count, node.args[6])
    return found


def _counts_batches(node: torch.fx.Node, counted: dict[str, tuple[Any, Any, Any, Any]]) -> bool:
    """export's `num_batches_tracked.add_(1)` of a BatchNorm whose statistics are deferred."""
    if node.target is not torch.ops.aten.add_.Tensor or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    buffer = node.args[0]
    while buffer.target in (after, torch.ops.aten.add_.Tensor) and isinstance(buffer.args[0], torch.fx.Node):
        buffer = buffer.args[0]  # through runtime.mutation's ordering and export's chained increments
    if buffer.op != "get_attr":
        return False
    tensor = operator.attrgetter(str(buffer.target))(buffer.graph.owning_module)
    return any(entry[2] is tensor for entry in counted.values())


def set_grad_mode(enabled: bool) -> None:
    """Stage graphs switch grad mode where forward did (`with torch.no_grad():` and the like);
    the interpreter restores the caller's mode after every stage, even when one raises."""
    torch._C._set_grad_enabled(enabled)


def enter_autocast(regions: tuple[tuple[str, torch.dtype], ...]) -> list[torch.autocast]:
    """Stage graphs enter forward's `with torch.autocast(...)` regions where it did; returns them to exit."""
    contexts = [torch.autocast(device, dtype=dtype) for device, dtype in regions]
    for c in contexts:
        c.__enter__()
    return contexts


def exit_autocast(contexts: list[torch.autocast]) -> None:
    for c in reversed(contexts):
        c.__exit__(None, None, None)


_SWITCHES = (set_grad_mode, enter_autocast, exit_autocast, torch._C._set_grad_enabled, torch.set_grad_enabled,
             torch.set_autocast_enabled, torch.amp.autocast_mode._enter_autocast,
             torch.amp.autocast_mode._exit_autocast)


def switches_state(module: nn.Module) -> bool:
    """Whether running `module` switches grad mode or autocast in the calling thread: a stage graph that
    enters forward's `no_grad` or `autocast` regions (it leaves them at its end, but not if it raises).
    Leaf modules are not looked into: their own `with` blocks restore the state even when they raise."""
    for m in module.modules():
        if isinstance(m, torch.fx.GraphModule):
            for node in m.graph.nodes:
                if node.op == "call_function" and (
                    node.target in _SWITCHES or "grad_enabled" in str(node.target) or "autocast" in str(node.target)
                ):
                    return True
    return False


def _move(t: torch.Tensor, device: torch.device) -> None:
    with torch.no_grad():
        t.data = t.data.to(device)
        if t.grad is not None:
            t.grad = t.grad.to(device)


def stage_io(gm: torch.fx.GraphModule, plan: Plan) -> list[tuple[list[str], list[str]]]:
    """(inputs, outputs) value names of every stage, without building any module.

    Inputs are pipeline inputs or values of other stages, in order of first use; outputs
    are values read by later stages or by the model output.
    """
    stage_of = plan.stage_of()
    nodes = {n.name: n for n in gm.graph.nodes}
    plan.check({n.name: [p.name for p in n.all_input_nodes] for n in gm.graph.nodes  # every node in one stage
                if n.op.startswith("call") and n.target != "_guards_fn"})
    check_cuts(gm, stage_of)
    result = []
    for s, stage in enumerate(plan.stages):
        own = [nodes[name] for name in stage.nodes if nodes[name].target not in _DROP_TARGETS]
        own_names = {n.name for n in own}
        inputs: list[str] = []
        seen: set[str] = set()
        for node in own:
            for producer in node.all_input_nodes:
                name = producer.name
                if name in seen or producer.op == "get_attr":
                    continue
                seen.add(name)
                if name in own_names:
                    continue
                if stage_of.get(name, -1) > s:
                    raise ValueError(f"stage {s} reads {name}, computed later in stage {stage_of[name]}; "
                                     "stages must follow topological order")
                inputs.append(name)
        outputs = [
            n.name for n in own if any(u.op == "output" or stage_of.get(u.name, -1) > s for u in n.users)
        ]
        result.append((inputs, outputs))
    return result


def _rewrite_devices(node: torch.fx.Node, device: torch.device) -> None:
    """Graphs from torch.export hard-code the tracing device (arange(device=cpu), ...)."""
    if isinstance(node.kwargs.get("device"), torch.device):
        node.kwargs = {**node.kwargs, "device": device}


def _nested_on(sub: torch.fx.GraphModule, device: torch.device) -> torch.fx.GraphModule:
    """A nested graph of export's (a no_grad or autocast region's body) with its hard-coded devices `device`:
    a copy sharing the weights, or `sub` itself where no node of it (or of its own nested graphs) names one."""
    if not any(isinstance(n.kwargs.get("device"), torch.device) for m in sub.modules()
               if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes):
        return sub
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(sub.graph, {}))
    copied = torch.fx.GraphModule(sub, graph)
    for node in copied.graph.nodes:
        _rewrite_devices(node, device)
        inner = getattr(copied, str(node.target), None) if node.op == "get_attr" else None
        if isinstance(inner, torch.fx.GraphModule):
            setattr(copied, str(node.target), _nested_on(inner, device))
    copied.recompile()
    return copied


def build_stages(
    gm: torch.fx.GraphModule,
    plan: Plan,
    local: Collection[int] | None = None,
    device: torch.device | None = None,
    materialize: Materialize | None = None,
    tensor_mesh: DeviceMesh | None = None,
    owners: Sequence[nn.Module] = (),
    rewrite: Rewrite | None = None,
) -> tuple[list[Stage], Callable[[], None]]:
    """Build the stage modules of `plan` and move the model's weights to their devices.

    With `local` (the stages of this process, all on one device), only those stages are
    built: weights they read move to their device, weights only other stages read are
    freed (emptied) so this process holds its stages' parameters only; weights no stage
    reads are left as they are.

    `device` (with `local`) is this process's own device: a replicated stage names the device
    of its first replica, and every other replica runs the same stage on its own device.

    `materialize` (runtime.materialize.Materializer) gives storage to the tensors on `meta`
    (and any others it loads), called with every (tensor, device) this process holds; it
    returns the ids it handled and its own undo. Without it, a weight on meta is an error.

    `tensor_mesh` (with `local`): this process's tensor-parallel mesh; a stage with `tensor` > 1 has its
    `tensor_groups` split on it (runtime.tensor_parallel) before recomputation wraps it, and the modules
    of `gm` and `owners` (the model) then hold the split parameters. `rewrite` (with `local`) then splits its
    experts and sequence (runtime.layer_split.axis_rewrite), the same modules pointed at its new parameters.

    Returns the stages and an `undo` function that restores every weight as it was.
    """
    devices = [torch.device(s.device) for s in plan.stages]
    if local is not None and device is not None:
        devices = [device if s in local else d for s, d in enumerate(devices)]
    stage_of = plan.stage_of()
    io = stage_io(gm, plan)
    nodes = {n.name: n for n in gm.graph.nodes}
    readers = tensor_stages(gm, stage_of)
    wanted = range(len(plan.stages)) if local is None else sorted(set(local))
    if local is not None and len({devices[s] for s in wanted}) > 1:
        raise ValueError(f"the stages of one process must share a device, got {[str(devices[s]) for s in wanted]}")

    homes: dict[int, tuple[torch.Tensor, torch.device | None]] = {}
    for key, (t, stages) in readers.items():
        if local is None:
            homes[key] = (t, devices[stages[0]])
        else:
            mine = [s for s in stages if s in wanted]
            homes[key] = (t, devices[mine[0]] if mine else None)
    original = [(t, t.data, t.grad) for t, _ in homes.values()]
    filled: set[int] = set()
    undo_filled: list[Callable[[], None]] = []

    swapped: list[tuple[nn.Module, str, Any]] = []  # attributes pointed at split parameters (tensor_mesh)

    def undo() -> None:
        for module, name, p in reversed(swapped):
            module._parameters[name] = p
        # Restore the very storage each tensor had: lossless whatever device it went to.
        for t, data, grad in original:
            if id(t) not in filled:
                t.data = data
                t.grad = grad
        for u in undo_filled:
            u()

    try:
        if materialize is not None:
            filled, done = materialize([(t, dev) for t, dev in homes.values() if dev is not None])
            undo_filled.append(done)
        for t, dev in homes.values():
            if id(t) in filled:
                continue
            if dev is not None and t.device.type == "meta":
                raise ValueError(f"a weight of shape {tuple(t.shape)} is on meta (no storage); pass weights= "
                                 "(a checkpoint) or init= to partition() to materialize it on its stage's device")
            if dev is None:
                with torch.no_grad():
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
                    t.grad = None
            elif t.device != dev:
                _move(t, dev)
        wrappers: dict[str, DeferredBatchNorm | DeferredBatchNormOp] = {}
        built = []
        for s in wanted:
            split = (tensor_mesh, [gm, *owners], swapped) if tensor_mesh is not None else None
            axes = (rewrite, [gm, *owners], swapped) if rewrite is not None else None
            built.append(_build_one(gm, plan, s, devices[s], io[s], nodes, homes, wrappers, split, axes))
    except BaseException:
        undo()
        raise
    return built, undo


def _build_one(
    gm: torch.fx.GraphModule,
    plan: Plan,
    s: int,
    device: torch.device,
    io: tuple[list[str], list[str]],
    nodes: dict[str, torch.fx.Node],
    homes: dict[int, tuple[torch.Tensor, torch.device | None]],
    wrappers: dict[str, DeferredBatchNorm | DeferredBatchNormOp],
    split: tuple[DeviceMesh, list[nn.Module], list[tuple[nn.Module, str, Any]]] | None = None,
    axes: tuple[Rewrite, list[nn.Module], list[tuple[nn.Module, str, Any]]] | None = None,
) -> Stage:
    inputs, outputs = io
    own = [nodes[name] for name in plan.stages[s].nodes if nodes[name].target not in _DROP_TARGETS]
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {name: graph.placeholder(name) for name in inputs}
    attrs: dict[str, Any] = {}

    def attr(n: torch.fx.Node) -> None:
        target = str(n.target)
        obj = operator.attrgetter(target)(gm)
        if isinstance(obj, torch.fx.GraphModule):
            obj = _nested_on(obj, device)
        attrs[target] = obj
        value = graph.get_attr(target)
        home = homes.get(id(obj))
        if isinstance(obj, torch.Tensor) and home is not None and home[1] is not None and home[1] != device:
            value = graph.call_method("to", (value, device))
        env[n.name] = value

    deferred: list[DeferredBatchNorm | DeferredBatchNormOp] = []
    counted = _export_batch_norms(gm)
    entry: torch.fx.Node | None = None  # the caller's grad mode, read once if the stage switches it
    mode: bool | None = None  # the grad mode forced now (None: the caller's)
    region: tuple[Any, ...] = ()  # the autocast regions of forward the stage is inside now
    context: torch.fx.Node | None = None
    for node in own:
        wanted = node.meta.get("grad_mode")
        if wanted != mode:
            if entry is None:
                entry = graph.call_function(torch.is_grad_enabled)
            graph.call_function(set_grad_mode, (entry if wanted is None else wanted,))
            mode = wanted
        autocast = node.meta.get("autocast", ())
        if autocast != region:
            if context is not None:
                graph.call_function(exit_autocast, (context,))
            context = graph.call_function(enter_autocast, (autocast,)) if autocast else None
            region = autocast
        for producer in node.all_input_nodes:
            if producer.name not in env and producer.op == "get_attr":
                attr(producer)
        if _counts_batches(node, counted):  # export's num_batches_tracked += 1: the deferred commit does it once
            env[node.name] = env[cast(torch.fx.Node, node.args[0]).name]
            continue
        if node.name in counted:  # export's batch_norm on the model's running statistics, training
            site = wrappers.setdefault(node.name, DeferredBatchNormOp(*counted[node.name]))
            deferred.append(site)
            attrs[f"deferred_{node.name}"] = site
            args = torch.fx.node.map_arg(node.args, lambda n: env[n.name])
            env[node.name] = graph.call_module(f"deferred_{node.name}", args)
            continue
        target = str(node.target)
        if node.op == "call_module":
            module = gm.get_submodule(target)
            if isinstance(module, _BatchNorm):  # one deferred wrapper per call site, as plain BatchNorm
                module = wrappers.setdefault(node.name, DeferredBatchNorm(module))  # updates once per call
                deferred.append(module)
                target = f"{target.replace('.', '_')}__{node.name}"
            attrs[target] = module
        copied = graph.node_copy(node, lambda n: env[n.name])
        if node.op == "call_module":
            copied.target = target
        _rewrite_devices(copied, device)
        env[node.name] = copied

    if mode is not None and entry is not None:
        graph.call_function(set_grad_mode, (entry,))
    if context is not None:
        graph.call_function(exit_autocast, (context,))
    graph.output(tuple(env[name] for name in outputs))
    module = torch.fx.GraphModule(attrs, graph, f"stage{s}")
    writes = mutated_inputs(module)
    if split is not None and plan.stages[s].tensor > 1:  # on the bare graph, before recomputation wraps it
        mesh, roots, swapped = split
        before = dict(module.named_parameters(remove_duplicate=False))
        parallelize_stage(module, mesh, plan.stages[s].tensor_groups)
        after = dict(module.named_parameters(remove_duplicate=False))
        swapped += rebind(roots, {id(p): after[n] for n, p in before.items() if n in after})
    if axes is not None:  # experts and sequence split, on the graph the tensor split left
        rewrite, roots, swapped = axes
        swapped += rebind(roots, rewrite(module, s, device))
    if split is not None and plan.stages[s].tensor > 1:
        mark_loss_outputs(module)  # on the final graph: logits the loss may take split (runtime.loss_split)
    if plan.recomputes:  # every stage, "none" ones too: see [Note: recomputation replays the stage's random numbers]
        module = wrap(module, plan.stages[s].recompute, device, deferred, writes)
    return Stage(s, device, module, inputs, outputs, deferred, writes)
