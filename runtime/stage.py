"""Build one GraphModule per stage from the traced graph and a Plan, and place weights on devices.

Each stage graph takes the values it needs (pipeline inputs or outputs of earlier stages,
skips included, by node name) and returns the values later stages or the model output
need. Parameters and buffers stay the model's own objects: each is moved in place to the
device of the stage that owns it; a stage on another device that also reads it (a tied
weight) gets a `.to(device)` copy inside its graph, so autograd sums both gradients into
the one parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from runtime.batchnorm import DeferredBatchNorm
from runtime.plan import Plan

__all__ = ["Stage", "build_stages"]

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


def _resolve(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, nn.Module):
        return list(obj.parameters()) + list(obj.buffers())
    return [obj] if isinstance(obj, torch.Tensor) else []


def _move(t: torch.Tensor, device: torch.device) -> None:
    with torch.no_grad():
        t.data = t.data.to(device)
        if t.grad is not None:
            t.grad = t.grad.to(device)


def _homes(gm: torch.fx.GraphModule, stage_of: dict[str, int], devices: list[torch.device]) -> dict[int, tuple[torch.Tensor, torch.device]]:
    """Each parameter/buffer's device: its leaf module's stage first, else the first stage reading it."""
    homes: dict[int, tuple[torch.Tensor, torch.device]] = {}
    for op in ("call_module", "get_attr"):
        for node in gm.graph.nodes:
            if node.op != op:
                continue
            users = [stage_of[u.name] for u in node.users if u.name in stage_of]
            if node.op == "call_module" and node.name in stage_of:
                users = [stage_of[node.name]]
            if not users:
                continue
            for t in _tensors_of(_resolve(gm, str(node.target))):
                homes.setdefault(id(t), (t, devices[min(users)]))
    return homes


def _rewrite_devices(node: torch.fx.Node, device: torch.device) -> None:
    """Graphs from torch.export hard-code the tracing device (arange(device=cpu), ...)."""
    if isinstance(node.kwargs.get("device"), torch.device):
        node.kwargs = {**node.kwargs, "device": device}


def build_stages(gm: torch.fx.GraphModule, plan: Plan) -> tuple[list[Stage], Callable[[], None]]:
    """Build the stage modules of `plan` and move the model's weights to their devices.

    Returns the stages and an `undo` function that moves every weight back where it was.
    """
    devices = [torch.device(s.device) for s in plan.stages]
    stage_of = plan.stage_of()
    nodes = {n.name: n for n in gm.graph.nodes}
    missing = [n for n in stage_of if n not in nodes]
    if missing:
        raise ValueError(f"the plan names nodes the graph does not have: {missing[:5]}")
    output_node = next(n for n in gm.graph.nodes if n.op == "output")

    homes = _homes(gm, stage_of, devices)
    original = [(t, t.data, t.grad) for t, _ in homes.values()]

    def undo() -> None:
        # Restore the very storage each tensor had: lossless whatever device it went to.
        for t, data, grad in original:
            t.data = data
            t.grad = grad

    try:
        for t, dev in homes.values():
            if t.device != dev:
                _move(t, dev)
        wrappers: dict[int, DeferredBatchNorm] = {}
        stages = [
            _build_one(gm, plan, s, devices[s], stage_of, nodes, output_node, homes, wrappers)
            for s in range(len(plan.stages))
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
    stage_of: dict[str, int],
    nodes: dict[str, torch.fx.Node],
    output_node: torch.fx.Node,
    homes: dict[int, tuple[torch.Tensor, torch.device]],
    wrappers: dict[int, DeferredBatchNorm],
) -> Stage:
    own = [nodes[name] for name in plan.stages[s].nodes if nodes[name].target not in _DROP_TARGETS]
    own_names = {n.name for n in own}
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    inputs: list[str] = []
    attrs: dict[str, Any] = {}

    def lookup(n: torch.fx.Node) -> torch.fx.Node:
        if n.name in env:
            return env[n.name]
        if n.op == "get_attr":
            target = str(n.target)
            obj = _resolve(gm, target)
            attrs[target] = obj
            value = graph.get_attr(target)
            home = homes.get(id(obj))
            if isinstance(obj, torch.Tensor) and home is not None and home[1] != device:
                value = graph.call_method("to", (value, device))
            env[n.name] = value
            return value
        if n.name in own_names:
            raise RuntimeError(f"node {n.name} is used before it is computed in stage {s}; is the plan in topological order?")
        inputs.append(n.name)
        env[n.name] = graph.placeholder(n.name)
        return env[n.name]

    deferred: list[DeferredBatchNorm] = []
    for node in own:
        for producer in node.all_input_nodes:
            lookup(producer)
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

    outputs = [
        n.name for n in own if any(u is output_node or stage_of.get(u.name, -1) > s for u in n.users)
    ]
    graph.output(tuple(env[name] for name in outputs))
    module = torch.fx.GraphModule(attrs, graph, f"stage{s}")
    return Stage(s, device, module, inputs, outputs, deferred)
