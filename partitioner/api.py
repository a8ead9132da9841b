"""partition(model, devices): trace, cost, split and return a pipelined model in one call."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from cost_model.analytic import AnalyticCostModel, CostModel
from cost_model.devices import DeviceLike, resolve_devices
from partitioner.errors import PartitionError
from partitioner.graph import build_graph, compute_nodes
from partitioner.planner import plan_pipeline
from partitioner.trace import trace
from runtime.microbatch import scatter
from runtime.pipeline import Pipeline
from runtime.plan import Plan
from runtime.stage import build_stages

__all__ = ["partition"]


def partition(
    model: nn.Module,
    devices: Sequence[DeviceLike],
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    micro_batches: int = 1,
    cost_model: CostModel | None = None,
    plan: Plan | None = None,
    threads: bool | None = None,
) -> Pipeline:
    """Split `model` into one pipeline stage per entry of `devices` and return it ready to run.

    Args:
        model: the module to partition; its parameters are moved to the stages' devices in
            place and stay its own (an optimizer over `model.parameters()` keeps working).
        devices: one device per stage, e.g. ["cuda:0", "cuda:1"]; a device may repeat.
        example_inputs: a full batch of positional inputs (a tuple, or one tensor). Dim 0
            of the first tensor is the batch that is split into micro-batches.
        example_kwargs: keyword inputs of the same example call.
        micro_batches: how many micro-batches each call is split into (GPipe schedule).
        cost_model: what predicts node and transfer times; analytic, measured here, by default.
        plan: a Plan to run as it is (for example one saved with `Plan.to_json`), skipping planning.
        threads: run stages on worker threads; default only when there are several devices.

    Raises:
        TypeError: `model` is not an nn.Module.
        PartitionError: bad devices, micro_batches or inputs, or a model that cannot be traced;
            the model is then left exactly as it was.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    try:
        resolved = resolve_devices(devices)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise PartitionError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    kwargs = dict(example_kwargs or {})
    if not args and not kwargs:
        raise PartitionError("example_inputs is empty: pass one batch of inputs, e.g. example_inputs=(x,)")

    traced = trace(model, args, kwargs)
    gm = traced.graph_module
    flat = traced.flatten_inputs(args, kwargs)
    try:
        first_chunk = scatter(flat, micro_batches)[0]
    except ValueError as exc:
        raise PartitionError(f"example_inputs: {exc}") from None
    graph = build_graph(gm, first_chunk)
    order = [n.name for n in compute_nodes(gm)]
    if plan is None:
        plan = plan_pipeline(graph, order, resolved, cost_model or AnalyticCostModel(), micro_batches)
    elif plan.micro_batches != micro_batches:
        plan.micro_batches = micro_batches

    stages, undo = build_stages(gm, plan)
    try:
        output_node = next(n for n in gm.graph.nodes if n.op == "output")
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        constants = {n.name: _attr(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr"}
        return Pipeline(model, stages, plan, output_node, traced.flatten_inputs, traced.unflatten_outputs, placeholders, constants, threads)
    except BaseException:
        undo()
        raise


def _attr(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
