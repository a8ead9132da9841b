"""Build one GraphModule per stage from the traced graph and a Plan, and place weights on devices.

Each stage graph takes the values it needs (pipeline inputs or outputs of earlier stages,
skips included, by node name) and returns the values later stages or the model output
need. Parameters and buffers stay the model's own objects: each is moved in place to the
device of the stage that owns it; a stage on another device that also reads it (a tied
weight) gets a `.to(device)` copy inside its graph, so autograd sums both gradients into
the one parameter.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Collection

import torch
import torch.fx
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from runtime.batchnorm import DeferredBatchNorm
from runtime.plan import Plan

__all__ = ["Stage", "build_stages", "stage_io", "tensor_stages"]

_DROP_TARGETS = {"_guards_fn", torch.ops.aten._assert_tensor_metadata.default}


@dataclass
class Stage:
    """A runnable stage: its module, device, and the value names it reads and writes."""

    index: int
    device: torch.device
    module: torch.fx.GraphModule
    inputs: list[str]
    outputs: list[str]
    deferred_bns: list[DeferredBatchNorm] = field(default_factory=list)


def _tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, nn.Module):
        return list(obj.parameters()) + list(obj.buffers())
    return [obj] if isinstance(obj, torch.Tensor) else []


def _move(t: torch.Tensor, device: torch.device) -> None:
    with torch.no_grad():
        t.data = t.data.to(device)
        if t.grad is not None:
            t.grad = t.grad.to(device)


def tensor_stages(gm: torch.fx.GraphModule, stage_of: dict[str, int]) -> dict[int, tuple[torch.Tensor, list[int]]]:
    """Each parameter/buffer (by id) and the stages that read it, its owner first.

    The owner is the stage of the leaf module holding it, else the first stage reading it.
    """
    found: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for op in ("call_module", "get_attr"):
        for node in gm.graph.nodes:
            if node.op != op:
                continue
            if op == "call_module":
                users = [stage_of[node.name]] if node.name in stage_of else []
            else:
                users = sorted({stage_of[u.name] for u in node.users if u.name in stage_of})
            for t in _tensors_of(operator.attrgetter(str(node.target))(gm)):
                entry = found.setdefault(id(t), (t, []))
                entry[1].extend(u for u in users if u not in entry[1])
    return {k: v for k, v in found.items() if v[1]}


def stage_io(gm: torch.fx.GraphModule, plan: Plan) -> list[tuple[list[str], list[str]]]:
    """(inputs, outputs) value names of every stage, without building any module.

    Inputs are pipeline inputs or values of other stages, in order of first use; outputs
    are values read by later stages or by the model output.
    """
    stage_of = plan.stage_of()
    nodes = {n.name: n for n in gm.graph.nodes}
    missing = [n for n in stage_of if n not in nodes]
    if missing:
        raise ValueError(f"the plan names nodes the graph does not have: {missing[:5]}")
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
                    raise ValueError(f"stage {s} reads {name}, computed later in stage {stage_of[name]}; stages must follow topological order")
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


def build_stages(
    gm: torch.fx.GraphModule,
    plan: Plan,
    local: Collection[int] | None = None,
) -> tuple[list[Stage], Callable[[], None]]:
    """Build the stage modules of `plan` and move the model's weights to their devices.

    With `local` (the stages of this process, all on one device), only those stages are
    built: weights they read move to their device, weights only other stages read are
    freed (emptied) so this process holds its stages' parameters only; weights no stage
    reads are left as they are.

    Returns the stages and an `undo` function that restores every weight as it was.
    """
    devices = [torch.device(s.device) for s in plan.stages]
    stage_of = plan.stage_of()
    io = stage_io(gm, plan)
    nodes = {n.name: n for n in gm.graph.nodes}
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
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

    def undo() -> None:
        # Restore the very storage each tensor had: lossless whatever device it went to.
        for t, data, grad in original:
            t.data = data
            t.grad = grad

    try:
        for t, dev in homes.values():
            if dev is None:
                with torch.no_grad():
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
                    t.grad = None
            elif t.device != dev:
                _move(t, dev)
        wrappers: dict[int, DeferredBatchNorm] = {}
        stages = [
            _build_one(gm, plan, s, devices[s], io[s], nodes, homes, wrappers)
            for s in wanted
        ]
    except BaseException:
        undo()
        raise
    return stages, undo


def _build_one(
    gm: torch.fx.GraphModule,
    plan: Plan,
    s: int,
    device: torch.device,
    io: tuple[list[str], list[str]],
    nodes: dict[str, torch.fx.Node],
    homes: dict[int, tuple[torch.Tensor, torch.device | None]],
    wrappers: dict[int, DeferredBatchNorm],
) -> Stage:
    inputs, outputs = io
    own = [nodes[name] for name in plan.stages[s].nodes if nodes[name].target not in _DROP_TARGETS]
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {name: graph.placeholder(name) for name in inputs}
    attrs: dict[str, Any] = {}

    def attr(n: torch.fx.Node) -> None:
        target = str(n.target)
        obj = operator.attrgetter(target)(gm)
        attrs[target] = obj
        value = graph.get_attr(target)
        home = homes.get(id(obj))
        if isinstance(obj, torch.Tensor) and home is not None and home[1] is not None and home[1] != device:
            value = graph.call_method("to", (value, device))
        env[n.name] = value

    deferred: list[DeferredBatchNorm] = []
    for node in own:
        for producer in node.all_input_nodes:
            if producer.name not in env and producer.op == "get_attr":
                attr(producer)
        if node.op == "call_module":
            target = str(node.target)
            module = gm.get_submodule(target)
            if isinstance(module, _BatchNorm):
                module = wrappers.setdefault(id(module), DeferredBatchNorm(module))
                deferred.append(module)
            attrs[target] = module
        copied = graph.node_copy(node, lambda n: env[n.name])
        _rewrite_devices(copied, device)
        env[node.name] = copied

    graph.output(tuple(env[name] for name in outputs))
    module = torch.fx.GraphModule(attrs, graph, f"stage{s}")
    return Stage(s, device, module, inputs, outputs, deferred)
