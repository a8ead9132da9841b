"""A Plan into a running pipeline: stage modules cut from the traced graph, the other train/eval mode, the runtime.

    traced_call(model, args, kwargs, request, devices, timeout)  -> the job joined, the example traced
    build_pipeline(model, example, plan, request, run, fill)
      one process -> runtime.pipeline.Pipeline            (every stage here, threads or not)
      torchrun    -> runtime.distributed.DistributedPipeline (this rank's stages only)

Building moves (or materializes) weights; if anything fails after that, every move is undone, so
the model is left exactly as it was.
"""

from __future__ import annotations

import logging
import operator
import os
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from cost_model.devices import DeviceLike
from partitioner.capture.example import Example, shaped, trace_example
from partitioner.capture.fidelity import batched_outputs
from partitioner.errors import PartitionError
from partitioner.make.bind import bind
from partitioner.make.modes import same_cuts
from partitioner.place.planning import finish_plan
from partitioner.request import PlanRequest, RunOptions
from runtime.distributed import NCCL_RULES_ENV, DistributedPipeline
from runtime.launch import init_process_group, joined_devices
from runtime.layer_split import RankSplit, axis_reductions, axis_rewrite, shard_stages, split_groups, splits_layers
from runtime.materialize import Materializer
from runtime.pipeline import Pipeline, StageGraph
from runtime.plan import Plan
from runtime.stage import Rewrite, Stage, build_stages, stage_io
from runtime.stage_weights import tensor_stages, weight_groups

__all__ = ["build_pipeline", "on_devices", "traced_call"]

log = logging.getLogger(__name__)


def traced_call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], request: PlanRequest,
                given: Sequence[DeviceLike], timeout: float) -> tuple[PlanRequest, Example]:
    """The job joined and the model traced on its example. Under torchrun each rank resolves its own entry of
    the `given` devices ('cuda' is cuda:LOCAL_RANK) and every rank checks all of them: the request returned
    holds every rank's device."""
    if request.processes:
        devices = init_process_group(given, timeout) if not dist.is_initialized() else joined_devices(given)
        request = request.but(devices=tuple(devices))
    example = shaped(model, None, trace_example, model, args, kwargs, request.micro_batches, request.input_split_spec,
                     request.cross_batch)
    return request, example


def build_pipeline(
    model: nn.Module, example: Example, plan: Plan, request: PlanRequest, run: RunOptions, fill: Materializer | None,
) -> Pipeline | DistributedPipeline:
    """The pipeline that runs `plan` on `model` (traced as `example`): one process, or this rank's part under
    torchrun (`request.processes`, on the devices the job joined: `traced_call`).

    `fill` materializes a model on meta (and loads `weights=` into a real one) stage by stage.

    Raises:
        PartitionError: a plan the graph cannot be cut by, or a rank the plan gives no stage.
    """
    if plan.pieces != request.micro_batches:  # a given plan run with another micro-batch count (a step's)
        plan.micro_batches, plan.programs = _per_replica(plan, request.micro_batches), []
    bind(plan, example.graph_module)  # a plan made from another trace (on meta, say): see make.bind
    on_devices(plan, request.devices)
    if request.processes:
        return _distributed(model, example, plan, run, fill, list(request.devices))
    return _local(model, example, plan, request, run, fill)


def _per_replica(plan: Plan, micro_batches: int) -> int:
    """What `plan.micro_batches` becomes for a step of `micro_batches` (Plan.pieces): each replica of a sliced
    plan runs every one of its micro-batches on a slice, so they divide among the replicas.

    Raises:
        PartitionError: a sliced plan's replicas do not divide `micro_batches`.
    """
    replicas = plan.pieces // plan.micro_batches
    if micro_batches % replicas:
        raise PartitionError(f"micro_batches={micro_batches} with a plan that slices each micro-batch over "
                             f"{replicas} replicas: use a multiple of {replicas} (the step's micro-batches, "
                             f"{micro_batches // replicas or 1} x {replicas} say), or leave micro_batches out to run "
                             f"the plan's {plan.pieces}")
    return micro_batches // replicas


def on_devices(plan: Plan, devices: Sequence[torch.device]) -> None:
    """Run `plan` on `devices` (one per rank, as given to partition): a plan made for other devices (say,
    plan(cluster="1x2xH100") run on ["cpu", "cpu"]) is mapped rank for rank, with a log line; its predicted
    times stay those of the devices it was planned for.

    Raises:
        PartitionError: the plan runs on another number of ranks than `devices` names.
    """
    planned = _rank_devices(plan)
    given = [str(d) for d in devices]
    if len(planned) != len(given):
        raise PartitionError(f"the plan runs on {len(planned)} ranks ({', '.join(planned)}) but devices= names "
                             f"{len(given)} ({', '.join(given)}); pass one device per rank of the plan, or plan again "
                             "for these devices")
    if planned == given:
        return
    log.info("the plan was made for %s and runs on %s as given, rank for rank; its predicted times are those of the "
             "devices it was planned for", ", ".join(planned), ", ".join(given))
    for stage in plan.stages:
        stage.device = given[stage.ranks[0] if stage.ranks else stage.index]
    for program in plan.programs:
        program.device = given[program.rank]


def _rank_devices(plan: Plan) -> list[str]:
    """The device of each rank of `plan`: its program's, else that of its first stage."""
    if plan.programs:
        return [p.device for p in sorted(plan.programs, key=lambda p: p.rank)]
    found: dict[int, str] = {}
    for stage in plan.stages:
        for r in stage.all_ranks or [stage.index]:
            found.setdefault(r, stage.device)
    return [found[r] for r in sorted(found)]


def _local(model: nn.Module, example: Example, plan: Plan, request: PlanRequest, run: RunOptions,
           fill: Materializer | None) -> Pipeline:
    traced, gm = example.traced, example.graph_module
    if splits_layers(plan):
        raise PartitionError("the plan splits layers across tensor ranks, experts or a sequence, or shards weights "
                             f"over replicas (tensor {[s.tensor for s in plan.stages]}, sharding "
                             f"{[s.sharding for s in plan.stages]}, expert {[s.expert for s in plan.stages]}, "
                             f"context {[s.context for s in plan.stages]}), which runs one process per rank: "
                             "launch with "
                             "torchrun --nproc_per_node="
                             f"{plan.ranks}, or use a plan with tensor=1 and sharding='none' on every stage")
    batched = shaped(model, traced, batched_outputs, traced, example.flat, example.first_chunk, example.dims,
                     request.micro_batches)
    stages, undo = _build(gm, plan, fill=fill)
    undos = [undo]
    try:
        finish_plan(plan, gm, model, processes=False, regenerate=False)
        other = None
        if traced.other_mode is not None:  # forward reads self.training: the other mode's graph, cut alike
            other_plan = same_cuts(traced.other_mode, plan, gm)
            other_stages, other_undo = _build(traced.other_mode, other_plan, fill=fill)
            undos.append(other_undo)
            finish_plan(other_plan, traced.other_mode, model, processes=False, regenerate=False)
            other_output, _, other_constants = _graph_io(traced.other_mode)
            other = StageGraph(other_stages, other_output, other_constants, other_plan)
        output_node, placeholders, constants = _graph_io(gm)
        return Pipeline(
            model, StageGraph(stages, output_node, constants, plan), traced.flatten_inputs, traced.unflatten_outputs,
            placeholders, run.threads, traced.mutated_inputs, other, traced.other_mode_error, batched_outputs=batched,
            output_merge_spec=run.output_merge_spec, input_dims=example.dims)
    except BaseException:
        for u in reversed(undos):
            u()
        raise


def _distributed(model: nn.Module, example: Example, plan: Plan, run: RunOptions, fill: Materializer | None,
                 devices: list[torch.device]) -> DistributedPipeline:
    traced, gm = example.traced, example.graph_module
    rank = dist.get_rank()
    finish_plan(plan, gm, model, processes=True, regenerate=False)
    mine = [s.index for s in plan.stages if rank in s.all_ranks]
    if not mine:
        raise PartitionError(f"the plan gives rank {rank} no stage; every rank needs one")
    io = stage_io(gm, plan)
    split = split_groups(plan, devices[rank].type, run.timeout, checked=os.environ.get(NCCL_RULES_ENV) == "1") \
        if splits_layers(plan) else RankSplit()  # every rank makes every group, before any stage uses one
    owners = [model] + ([traced.other_mode] if traced.other_mode is not None else [])
    stages, undo = _build(gm, plan, local=mine, device=devices[rank], fill=fill, tensor_mesh=split.tensor_mesh,
                          owners=owners, rewrite=axis_rewrite(plan, split, gm, model))
    undos = [undo]
    try:
        other: StageGraph | None = None
        other_stages: list[Stage] = []
        if traced.other_mode is not None:  # forward reads self.training: the other mode's graph, cut alike
            other_plan = same_cuts(traced.other_mode, plan, gm)
            finish_plan(other_plan, traced.other_mode, model, processes=True, regenerate=False)
            other_stages, other_undo = _build(traced.other_mode, other_plan, local=mine, device=devices[rank],
                                              fill=fill, tensor_mesh=split.tensor_mesh, owners=[model, gm],
                                              rewrite=axis_rewrite(other_plan, split, traced.other_mode, model))
            undos.append(other_undo)
            other_output, _, other_constants = _graph_io(traced.other_mode)
            other = StageGraph(other_stages, other_output, other_constants, other_plan,
                               stage_io(traced.other_mode, other_plan))
        # both modes' stages shard as one: see [Note: sharding both modes of a stage] (runtime.mode_units)
        readers = tensor_stages(gm, plan.stage_of())
        shard_stages(stages, plan, split, model, readers, owners=owners[1:] + [gm], others=other_stages)
        _, placeholders, constants = _graph_io(gm)
        groups = weight_groups(gm, plan.stage_of(), [list(s.ranks) for s in plan.stages], model)
        return DistributedPipeline(
            model, gm, plan, stages, io, traced.flatten_inputs, traced.unflatten_outputs, placeholders, constants,
            run.timeout, groups, traced.mutated_inputs, other, traced.other_mode_error, example.dims,
            rank_devices=devices, axes=axis_reductions(stages, plan, split, readers),
        )
    except BaseException:
        for u in reversed(undos):
            u()
        raise


def _build(gm: torch.fx.GraphModule, plan: Plan, local: list[int] | None = None,
           device: torch.device | None = None, fill: Materializer | None = None, tensor_mesh: Any = None,
           owners: Sequence[nn.Module] = (), rewrite: Rewrite | None = None) -> tuple[list[Stage], Callable[[], None]]:
    """runtime.stage.build_stages, with a plan it cannot build as a PartitionError (a refused cut names itself)."""
    try:
        return build_stages(gm, plan, local=local, device=device, materialize=fill, tensor_mesh=tensor_mesh,
                            owners=owners, rewrite=rewrite if splits_layers(plan) else None)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None


def _graph_io(gm: torch.fx.GraphModule) -> tuple[torch.fx.Node, list[str], dict[str, Any]]:
    """The graph's output node, its placeholder names, and the objects its get_attr nodes name."""
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    constants = {n.name: operator.attrgetter(str(n.target))(gm) for n in gm.graph.nodes if n.op == "get_attr"}
    return output_node, placeholders, constants
