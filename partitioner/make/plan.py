"""A request into a Plan: trace the example, place it, price its update rule; under torchrun one rank plans for all.

    plan_model(model, args, kwargs, request)        plan(): nothing moves, nothing is built
    plan_counts(model, args, kwargs, request, ms)   plans(): one plan per micro-batch count, the model traced once
    plan_example(model, example, request, cost)     partition(): the example is traced once, for the plan and the build
    plan_on_rank0(model, example, request, cost)    torchrun: rank 0 plans, every rank runs the same plan
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterator, Sequence

import torch.distributed as dist
from torch import nn

from cost_model.analytic import AnalyticCostModel, CostModel
from cost_model.calibration_store import with_calibration
from partitioner.capture.example import Example, shaped, trace_example
from partitioner.capture.meta import is_meta, on_meta
from partitioner.capture.trace import Traced
from partitioner.errors import PartitionError
from partitioner.make.bind import structure
from partitioner.make.modes import same_cuts
from partitioner.place.planning import plan_traced
from partitioner.predict.assemble import price_update
from partitioner.request import PlanRequest
from runtime.async_updates import check_async_plan
from runtime.microbatch import batch_size
from runtime.plan import Plan

__all__ = ["plan_counts", "plan_example", "plan_model", "plan_on_rank0", "planning_cost", "with_update"]


def planning_cost(model: nn.Module, request: PlanRequest) -> CostModel | None:
    """What prices the plan: the request's cost model (for a model on meta by default the analytic one:
    profiling needs values), calibrated by the request's calibration or this machine's saved one."""
    given = request.cost_model
    if given is None and is_meta(model):
        given = AnalyticCostModel()
    try:
        return with_calibration(given, request.devices, processes=request.processes, given=request.calibration)
    except ValueError as exc:  # a calibration file that cannot be read
        raise PartitionError(str(exc)) from None


def plan_example(model: nn.Module, example: Example, request: PlanRequest, cost: CostModel | None,
                 *, shapes: bool = False) -> Plan:
    """The plan for a traced example (on meta tensors for a model on meta, or with `shapes`).

    Raises:
        PartitionError: as plan_traced, and where a layer that computes statistics over the batch (BatchNorm
            in training mode) gets one sample per micro-batch, which the whole batch gives it more of.
    """
    try:
        made = shaped(model, example.traced, plan_traced, model, example, request, cost, shapes=shapes)
        made.node_keys = structure(example.graph_module)  # what it binds to where it runs (make.bind)
        if example.traced.other_mode is not None:  # refused now, not by partition on every rank after tracing
            same_cuts(example.traced.other_mode, made, example.graph_module)
        return made
    except (RuntimeError, ValueError) as exc:
        if _PER_BATCH_STATISTICS not in str(exc):
            raise
        samples = batch_size(example.flat) if example.flat else 0
        raise PartitionError(
            f"micro_batches={request.micro_batches} splits the batch of {samples} into micro-batches of one sample, "
            f"and a layer that normalizes over the batch in training mode needs more ({str(exc).splitlines()[0]}); "
            f"use micro_batches <= {max(1, samples // 2)} (2 samples or more each), or a larger batch") from None


_PER_BATCH_STATISTICS = "Expected more than 1 value per channel when training"  # torch's BatchNorm message


def plan_model(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], request: PlanRequest) -> Plan:
    """plan(): trace, place and price `model` on its example; nothing is moved and nothing is built.

    A described cluster's GPUs are not here, so its plan is made from shapes alone (running a large
    batch for real would take minutes); a forward that needs values falls back to running it.
    """
    for _, made in plan_counts(model, args, kwargs, request, [request.micro_batches]):
        if isinstance(made, PartitionError):
            raise made
        return made
    raise AssertionError("plan_counts yields one plan per count")  # pragma: no cover


def plan_counts(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], request: PlanRequest,
                counts: Sequence[int]) -> Iterator[tuple[int, Plan | PartitionError]]:
    """plan_model for each micro-batch count of `counts`, in order, as each is made: (count, its plan, or the
    PartitionError that count met, such as memory or a cross-batch operation). The model is traced once: a
    trace is made on the whole example whatever the count (capture.example.trace_example).

    Raises:
        PartitionError: the model cannot be traced (no count can be planned).
    """
    cost = planning_cost(model, request)
    shapes = request.cluster
    traced: Traced | None = None
    for m in counts:
        each = replace(request, micro_batches=m)
        while True:
            try:
                if traced is None:  # the trace alone (one micro-batch: nothing of a count can fail it)
                    traced = _example(model, args, kwargs, request, 1, None, shapes).traced
                made: Plan | PartitionError = _planned(model, _example(model, args, kwargs, request, m, traced, shapes),
                                                       each, cost, shapes)
            except PartitionError as exc:
                if shapes and _needs_values(exc, model):  # forward needs values (capture.meta.shapes_only):
                    shapes, traced = False, None  # trace and plan it for real, from this count on
                    continue
                if traced is None:
                    raise  # the model cannot be traced: no count can be planned
                made = exc
            break
        yield m, made


def _example(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], request: PlanRequest,
             micro_batches: int, traced: Traced | None, shapes: bool) -> Example:
    """The example cut into `micro_batches`: traced now, or on `traced` (on meta tensors with `shapes`)."""
    a, k = (on_meta(args), on_meta(kwargs)) if shapes else (args, kwargs)
    return shaped(model, traced, trace_example, model, a, k, micro_batches, request.input_split_spec,
                  request.cross_batch, traced, shapes=shapes)


def _planned(model: nn.Module, example: Example, request: PlanRequest, cost: CostModel | None, shapes: bool) -> Plan:
    made = with_update(plan_example(model, example, request, cost, shapes=shapes), request, priced=True)
    made.gpus_per_host = request.gpus_per_host
    return made


def _needs_values(exc: PartitionError, model: nn.Module) -> bool:
    """Whether planning from shapes failed because forward needs tensor values (and running it for real may not)."""
    return isinstance(exc.__cause__, (RuntimeError, NotImplementedError)) and not is_meta(model)


def plan_on_rank0(model: nn.Module, example: Example, request: PlanRequest, cost: CostModel | None) -> Plan:
    """torchrun: rank 0 plans (so every rank runs the same plan, whatever its own timings) and sends it to
    the others as JSON; a failure on rank 0 is raised on every rank, not waited for."""
    text: list[Any] = [None]
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            text = [("plan", plan_example(model, example, request, cost).to_json())]
        except Exception as exc:  # noqa: BLE001 - the others must hear of it, not wait for a plan
            failure, text = exc, [("error", f"{type(exc).__name__}: {exc}")]
    dist.broadcast_object_list(text, src=0)
    kind, payload = text[0]
    if kind == "error":
        if failure is not None:
            raise failure
        raise PartitionError(f"rank 0 could not plan: {payload}")
    return Plan.from_json(payload)


def with_update(plan: Plan, request: PlanRequest, *, priced: bool) -> Plan:
    """`plan` with the request's update rule, checked to run; priced (partitioner.predict.assemble.price_update)
    where the plan was made here (a given plan was priced already)."""
    if request.update != "sync":
        plan.update = request.update
    problems = check_async_plan(plan)
    if problems:
        raise PartitionError("cannot run asynchronous updates:\n" + "\n".join(f"- {p}" for p in problems))
    if priced:
        price_update(plan)
    return plan
