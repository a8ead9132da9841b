"""partition(model, devices): trace, cost, split and return a pipelined model in one call."""

from __future__ import annotations

import operator
import os
from typing import Any, Literal, Mapping, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from cost_model.analytic import CostModel
from cost_model.devices import DeviceLike
from partitioner.arguments import (
    ClusterLike,
    PlacementChoice,
    check_arguments,
    check_staleness_argument,
    check_update,
    default_cost,
    load_plan,
    materializer,
    plan_target,
)
from partitioner.calibrate.decide import Setup, attach
from partitioner.calibrate.store import CalibrationArg, with_calibration
from partitioner.capture.describe import describe_model
from partitioner.capture.example import shaped, trace_example
from partitioner.capture.fidelity import (
    Cuts,
    InputSplitSpec,
    OutputMergeSpec,
    SplitPoint,
    SplitPoints,
    batched_outputs,
    check_fidelity_arguments,
    cuts_from,
    input_dims,
)
from partitioner.capture.meta import is_meta, on_meta
from partitioner.errors import PartitionError
from partitioner.make.modes import same_cuts
from partitioner.place.planning import (
    RecomputeChoice,
    ScheduleChoice,
    finish_plan,
    plan_traced,
    stage_ranks_for,
)
from partitioner.predict.assemble import price_update
from partitioner.show.visualizer import Plan as DrawablePlan
from runtime.async_updates import check_async_plan
from runtime.distributed import DistributedPipeline
from runtime.launch import distributed, init_process_group, joined_devices
from runtime.materialize import Init, Materializer
from runtime.pipeline import Pipeline, StageGraph
from runtime.plan import Plan, Update
from runtime.stage import build_stages, stage_io, weight_groups
from runtime.weights import Weights

__all__ = ["describe_model", "partition", "plan"]

_T = TypeVar("_T")


def plan(
    model: nn.Module,
    devices: Sequence[DeviceLike] | None = None,
    *,
    cluster: ClusterLike | None = None,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    micro_batches: int = 1,
    schedule: ScheduleChoice = "gpipe",
    placement: PlacementChoice = "pipeline",
    replicas: Sequence[int] | Literal["auto"] | None = None,
    virtual_stages: int = 2,
    cost_model: CostModel | None = None,
    processes: bool | None = None,
    input_split_spec: InputSplitSpec | None = None,
    split_points: SplitPoints = "markers",
    split_spec: Mapping[str, SplitPoint] | None = None,
    recompute: RecomputeChoice | Sequence[RecomputeChoice] = "none",
    update: Update = "sync",
    calibration: CalibrationArg = None,
) -> DrawablePlan:
    """Plan `model` onto `devices` and return the Plan; nothing is moved and nothing is built.

    The arguments mean what they mean for `partition`. `processes` says whether the plan is
    for one process per rank (torchrun; the default when running under it) or for one
    process holding every device; the plan then prices transfers between processes.
    `cluster` (instead of `devices`): a cluster described, not here: a shape such as "2x8xH100",
    a JSON/YAML file or a cost_model.Cluster (any size); every GPU is a torchrun rank
    (rank r on host r // GPUs per host: `plan.gpus_per_host`, its GPU the local cuda:{r % that}), priced by the analytic
    model at the dtypes of the model and inputs. Run it with `partition(model, devices, plan=...)`.
    `calibration`: as for `partition`.

    Raises:
        PartitionError: bad arguments, a model that cannot be traced, or a plan that cannot fit.
    """
    devices, processes, cost_model, per_host = plan_target(devices, cluster, processes, cost_model)
    resolved, args, kwargs = check_arguments(model, devices, example_inputs, example_kwargs, micro_batches, schedule,
                                              placement, replicas, virtual_stages, recompute,
                                              described=cluster is not None)
    check_fidelity_arguments(model, None, input_split_spec, split_points, split_spec)
    multi = distributed() if processes is None else processes
    stage_ranks = stage_ranks_for(len(resolved), schedule, replicas, virtual_stages, multi)
    cost_model = with_calibration(default_cost(model, cost_model), resolved, processes=multi, given=calibration)

    def planned(shapes: bool) -> DrawablePlan:
        a, k = (on_meta(args), on_meta(kwargs)) if shapes else (args, kwargs)
        traced, flat, first_chunk = shaped(model, None, trace_example, model, a, k, micro_batches,
                                            input_split_spec, shapes=shapes)
        return shaped(model, traced, plan_traced, model, traced, flat, first_chunk, resolved, stage_ranks,
                       cost_model, micro_batches, schedule, placement, replicas == "auto", multi,
                       cuts_from(split_points, split_spec), recompute, shapes=shapes)

    try:  # GPUs that are not here are priced from shapes: running a large batch for real would take minutes
        made = planned(shapes=cluster is not None)
    except PartitionError as exc:
        if not isinstance(exc.__cause__, (RuntimeError, NotImplementedError)) or cluster is None or is_meta(model):
            raise
        made = planned(shapes=False)  # forward needs values (partitioner.capture.meta.shapes_only): run it for real
    made = _with_update(update, made, planned=True)
    made.gpus_per_host = per_host
    return made


def partition(
    model: nn.Module,
    devices: Sequence[DeviceLike],
    *,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    micro_batches: int = 1,
    schedule: ScheduleChoice = "gpipe",
    placement: PlacementChoice = "pipeline",
    replicas: Sequence[int] | Literal["auto"] | None = None,
    virtual_stages: int = 2,
    cost_model: CostModel | None = None,
    plan: Plan | str | os.PathLike[str] | None = None,
    threads: bool | None = None,
    timeout: float = 300.0,
    output_merge_spec: OutputMergeSpec | None = None,
    input_split_spec: InputSplitSpec | None = None,
    split_points: SplitPoints = "markers",
    split_spec: Mapping[str, SplitPoint] | None = None,
    recompute: RecomputeChoice | Sequence[RecomputeChoice] = "none",
    weights: Weights | None = None,
    init: Init | None = None,
    update: Update = "sync",
    staleness: int = 0,
    calibrate: int = 0,
    calibration: CalibrationArg = None,
) -> Pipeline | DistributedPipeline:
    """Split `model` into pipeline stages on `devices` and return it ready to run.

    Args:
        model: the module to partition; its parameters are moved to the stages' devices in
            place and stay its own (an optimizer over `model.parameters()` keeps working).
        devices: one device per stage (one per rank under torchrun); a device may repeat.
        example_inputs: a full batch of positional inputs (a tuple, or one tensor). Dim 0
            of the first tensor is the batch that is split into micro-batches.
        example_kwargs: keyword inputs of the same example call.
        micro_batches: how many micro-batches each call is split into.
        schedule: "gpipe", "1f1b", "interleaved" (interleaved 1F1B, `virtual_stages` stages
            per device), "zb1" (zero-bubble ZB-H1: 1F1B with weight gradients deferred into the
            bubble), "zbv" (zero-bubble ZB-V: 2 stages per device in a V) or "dualpipev"
            (DeepSeek's DualPipeV on zbv's V; micro_batches >= 2 x devices). Every schedule runs
            in one process (`pipe.train_step`) and under torchrun. "auto": each schedule this
            layout can run is simulated and the fastest that fits memory is kept; the plan holds
            it (`plan.schedule`) and every candidate's predicted ms (`plan.alternatives`).
        placement: "pipeline" (contiguous stages, one per device), "branches" (parallel
            branches of fork/join regions side by side on the devices, the rest on the first)
            or "auto" (whichever the simulator predicts faster).
        replicas: torchrun only: processes per stage, e.g. [2, 1] puts stage 0 on ranks 0 and
            1 (taking micro-batches in turn) and stage 1 on rank 2. Default: one each. "auto":
            the hybrid planner chooses the stages and each stage's replicas.
        cost_model: what predicts node and transfer times; by default profiled on the devices
            present (cached on disk, see cost_model.profiler), analytic for absent ones.
        plan: a Plan to run as it is (from `partitioner.plan`, or `Plan.from_json`), or the path of one
            saved with `plan.to_json()` (`python -m partitioner plan --save`), skipping planning.
        threads: one process only: run each worker on a thread; default when there are several devices.
        timeout: torchrun only: seconds to wait for another rank before failing with an error naming it.
        output_merge_spec: how outputs without a batch dimension merge across micro-batches: one
            rule ("sum", "mean" (weighted by micro-batch size), "first", "cat", ("cat", dim)) for
            all of them, or {output path: rule} ("[1]", "['aux']"). Without a rule such an output
            is returned once if every micro-batch gave the same value, else PartitionError.
        input_split_spec: {forward argument name: dim to split along, or None to give the
            tensor whole to every micro-batch}; default: tensors whose dim 0 is the batch split.
        split_points: "markers" (default): pipe_split() calls and `split_spec` are cuts every
            plan makes; "cost": ignore them and cut by cost alone.
        split_spec: PiPPy's {module path: SplitPoint.BEGINNING or SplitPoint.END}: cut before
            the module's first node or after its last one.
        recompute: activation recomputation, for every stage or one per stage: "none", "selective"
            (keep matmul and convolution outputs, recompute element-wise ops, norms, softmax and
            dropout in backward), "full" (keep only each stage's inputs, run its forward again in
            backward) or "auto" (per stage, the cheapest that fits the device's memory). Results
            equal the run without it, dropout included. A given `plan` carries its own
            (`plan.stages[s].recompute`).
        weights: where the weights come from, read by state-dict key one tensor at a time and
            only for the stages this process holds: a .safetensors file, a folder of them (with
            or without model.safetensors.index.json), a DCP checkpoint folder, a torch.save file,
            or a Mapping[str, Tensor]. Required (or `init`) for a model on `meta`, which is then
            traced and planned from shapes (the analytic cost model unless `cost_model` is
            given) and materialized stage by stage on its devices; a model with real weights
            loads them too (strictly: every key it holds). See runtime.materialize for the rules.
        init: for a model on `meta`: a callable `init(module)` run on each module whose tensors
            a stage materializes (under a per-module seed, so the split and the rank do not change
            the values), or "reset_parameters" (each module's own); with `weights`, init runs
            first and the checkpoint overwrites what it holds.
        staleness: torchrun only: bounded-staleness data parallelism for weights held by several
            ranks (stage replicas, tied weights): each rank all-reduces its step-t gradients in the
            background and the update of step t uses the sums of step t - staleness (in the first
            `staleness` steps those weights get no gradient, so the optimizer leaves them). 0 (the
            default) is the synchronous all-reduce. Call `pipe.wait_gradients()` on every rank
            before destroy_process_group. See [Note: bounded staleness] in runtime.staleness.
        calibrate: run `pipe.calibrate(steps=calibrate)` once built (partitioner.calibrate.decide; 0: not now);
            its report is `pipe.calibration_report`.
        calibration: a calibration (or its JSON path) to price with, where `pipe.calibrate` saves; default:
            the one saved on this machine for these devices (not applied over a given `cost_model`).

    `pipe(x)` returns what `model(x)` returns and `loss.backward()` reaches the model's own
    parameters (one process); `pipe.train_step(x, y, loss_fn)` runs a whole step of the
    plan's schedule (one process and torchrun, where it is called on every rank).

    Raises:
        TypeError: `model` is not an nn.Module.
        PartitionError: bad devices, micro_batches or inputs, or a model that cannot be traced;
            the model is then left exactly as it was.
    """
    if plan is not None:
        plan = load_plan(plan)
        try:
            plan.check()
        except ValueError as exc:
            raise PartitionError(str(exc)) from None
        if not (isinstance(recompute, str) and recompute == "none"):
            raise PartitionError(f"recompute={recompute!r} with a given plan: the plan carries each stage's "
                                 "recomputation; set plan.stages[s].recompute, or plan again with recompute=...")
        schedule, virtual_stages = plan.schedule, max(plan.virtual_stages, 2)
        if micro_batches == 1 and plan.micro_batches != 1:
            micro_batches = plan.micro_batches
    planned = check_update(update, plan.schedule if plan is not None else schedule, plan is None)
    resolved, args, kwargs = check_arguments(model, devices, example_inputs, example_kwargs, micro_batches, schedule,
                                              placement, replicas, virtual_stages, recompute)
    check_fidelity_arguments(model, output_merge_spec, input_split_spec, split_points, split_spec)
    staleness = staleness or (plan.staleness if plan is not None else 0)  # a plan's own
    if update != "sync" and isinstance(staleness, int) and staleness > 0:
        raise PartitionError(f"staleness={staleness} delays the all-reduce of weights held by several ranks, and "
                             f"update={update!r} runs every weight on one rank; drop one of them")
    staleness = check_staleness_argument(staleness)
    fill = materializer(model, weights, init)
    setup = Setup(model, list(devices), args, kwargs, {
        "micro_batches": micro_batches, "schedule": schedule, "placement": placement, "replicas": replicas,
        "virtual_stages": virtual_stages, "recompute": recompute}, {
        "threads": threads, "timeout": timeout, "output_merge_spec": output_merge_spec, "split_points": split_points,
        "input_split_spec": input_split_spec, "split_spec": split_spec}, cost_model, calibration, steps=calibrate)
    cost_model = setup.planned_with = with_calibration(default_cost(model, cost_model), resolved,
                                                       processes=distributed(), given=calibration)
    if distributed():
        pipe = _partition_distributed(model, list(devices), resolved, args, kwargs, micro_batches, cost_model, plan,
                                      schedule, replicas, virtual_stages, timeout, placement,
                                      cuts_from(split_points, split_spec), input_split_spec, recompute, fill)
        pipe.staleness = staleness  # recorded in pipe.plan.staleness
        return attach(_with_update(update, pipe, planned=planned), setup)
    stage_ranks = stage_ranks_for(len(resolved), schedule, replicas, virtual_stages, False) if plan is None else []
    traced, flat, first_chunk = shaped(model, None, trace_example, model, args, kwargs, micro_batches,
                                        input_split_spec)
    gm = traced.graph_module
    dims = input_dims(model, traced, input_split_spec)
    batched = shaped(model, traced, batched_outputs, traced, flat, first_chunk, dims, micro_batches)
    if plan is None:
        plan = shaped(model, traced, plan_traced, model, traced, flat, first_chunk, resolved, stage_ranks, cost_model,
                       micro_batches, schedule, placement, False, False, cuts_from(split_points, split_spec),
                       recompute)
    elif plan.micro_batches != micro_batches:
        plan.micro_batches = micro_batches
        plan.programs = []
    stages, undo = _build(gm, plan, fill=fill)
    undos = [undo]
    try:
        finish_plan(plan, gm, model, processes=False, regenerate=False)
        other = None
        if traced.other_mode is not None:  # forward reads self.training: the other mode's graph, cut alike
            other_plan = same_cuts(traced.other_mode, plan)
            other_stages, other_undo = _build(traced.other_mode, other_plan, fill=fill)
            undos.append(other_undo)
            finish_plan(other_plan, traced.other_mode, model, processes=False, regenerate=False)
            other_output, _, other_constants = _graph_io(traced.other_mode)
            other = StageGraph(other_stages, other_output, other_constants, other_plan)
        output_node, placeholders, constants = _graph_io(gm)
        made = _with_update(update, Pipeline(
            model, StageGraph(stages, output_node, constants, plan), traced.flatten_inputs, traced.unflatten_outputs,
            placeholders, threads, traced.mutated_inputs, other, traced.other_mode_error, batched_outputs=batched,
            output_merge_spec=output_merge_spec, input_dims=dims), planned=planned)
    except BaseException:
        for u in reversed(undos):
            u()
        raise
    return attach(made, setup)


def _with_update(update: Update, made: _T, *, planned: bool) -> _T:
    """Give the plan of `made` (a Plan or a pipeline) its update rule, check it can run, and price it
    (partitioner.predict.assemble.price_update) where the plan was made here (a given plan was priced already)."""
    plan = made if isinstance(made, Plan) else made.plan  # type: ignore[attr-defined]
    if update != "sync":
        plan.update = update
    problems = check_async_plan(plan)
    if problems:
        raise PartitionError("cannot run asynchronous updates:\n" + "\n".join(f"- {p}" for p in problems))
    if planned:
        price_update(plan)
    return made


def _build(gm: torch.fx.GraphModule, plan: Plan, local: list[int] | None = None,
           device: torch.device | None = None, fill: Materializer | None = None) -> tuple[list[Any], Any]:
    """runtime.stage.build_stages, with a plan it cannot build as a PartitionError (a refused cut names itself)."""
    try:
        return build_stages(gm, plan, local=local, device=device, materialize=fill)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None


def _graph_io(gm: torch.fx.GraphModule) -> tuple[torch.fx.Node, list[str], dict[str, Any]]:
    """The graph's output node, its placeholder names, and the objects its get_attr nodes name."""
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    constants = {n.name: operator.attrgetter(str(n.target))(gm) for n in gm.graph.nodes if n.op == "get_attr"}
    return output_node, placeholders, constants


def _partition_distributed(
    model: nn.Module,
    given: list[DeviceLike],
    devices: list[torch.device],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    micro_batches: int,
    cost_model: CostModel | None,
    plan: Plan | None,
    schedule: str,
    replicas: Any,
    virtual_stages: int,
    timeout: float,
    placement: str = "pipeline",
    cuts: Cuts | None = None,
    input_split_spec: InputSplitSpec | None = None,
    recompute: Any = "none",
    fill: Materializer | None = None,
) -> DistributedPipeline:
    # each rank resolves its own entry ('cuda' is cuda:LOCAL_RANK) and every rank checks all of them
    devices = init_process_group(given, timeout) if not dist.is_initialized() else joined_devices(given)
    rank, world = dist.get_rank(), dist.get_world_size()
    stage_ranks = stage_ranks_for(world, schedule, replicas, virtual_stages, True) if plan is None else []
    traced, flat, first_chunk = shaped(model, None, trace_example, model, args, kwargs, micro_batches,
                                        input_split_spec)
    gm = traced.graph_module
    dims = input_dims(model, traced, input_split_spec)
    if plan is None:
        text: list[Any] = [None]
        failure: BaseException | None = None
        if rank == 0:  # one rank plans, so every rank runs the same plan whatever its timings
            try:
                made = shaped(model, traced, plan_traced, model, traced, flat, first_chunk, devices, stage_ranks,
                               cost_model, micro_batches, schedule, placement, replicas == "auto", True, cuts,
                               recompute)
                text = [("plan", made.to_json())]
            except Exception as exc:  # noqa: BLE001 - the others must hear of it, not wait for a plan
                failure, text = exc, [("error", f"{type(exc).__name__}: {exc}")]
        dist.broadcast_object_list(text, src=0)
        kind, payload = text[0]
        if kind == "error":
            if failure is not None:
                raise failure
            raise PartitionError(f"rank 0 could not plan: {payload}")
        plan = DrawablePlan.from_json(payload)
    elif plan.micro_batches != micro_batches:
        plan.micro_batches, plan.programs = micro_batches, []
    finish_plan(plan, gm, model, processes=True, regenerate=False)
    mine = [s.index for s in plan.stages if rank in s.ranks]
    if not mine:
        raise PartitionError(f"the plan gives rank {rank} no stage; every rank needs one")
    io = stage_io(gm, plan)
    stages, undo = _build(gm, plan, local=mine, device=devices[rank], fill=fill)
    undos = [undo]
    try:
        _, placeholders, constants = _graph_io(gm)
        groups = weight_groups(gm, plan.stage_of(), [list(s.ranks) for s in plan.stages], model)
        other = None
        if traced.other_mode is not None:  # forward reads self.training: the other mode's graph, cut alike
            other_plan = same_cuts(traced.other_mode, plan)
            finish_plan(other_plan, traced.other_mode, model, processes=True, regenerate=False)
            other_stages, other_undo = _build(traced.other_mode, other_plan, local=mine, device=devices[rank],
                                              fill=fill)
            undos.append(other_undo)
            other_output, _, other_constants = _graph_io(traced.other_mode)
            other = StageGraph(other_stages, other_output, other_constants, other_plan,
                               stage_io(traced.other_mode, other_plan))
        return DistributedPipeline(
            model, gm, plan, stages, io, traced.flatten_inputs, traced.unflatten_outputs, placeholders, constants,
            timeout, groups, traced.mutated_inputs, other, traced.other_mode_error, dims, rank_devices=devices,
        )
    except BaseException:
        for u in reversed(undos):
            u()
        raise
