"""partition(model, devices): trace, cost, split and return a pipelined model in one call."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Literal, Mapping, Sequence, cast, get_args

import torch
import torch.distributed as dist
from torch import nn

from cost_model import default_cost_model
from cost_model.analytic import CostModel
from cost_model.devices import DeviceLike, host_memory, resolve_devices
from cost_model.processes import BetweenProcesses
from partitioner.assemble import finish
from partitioner.branches import plan_branches
from partitioner.errors import PartitionError
from partitioner.fidelity import (
    InputSplitSpec,
    OutputMergeSpec,
    SplitPoint,
    SplitPoints,
    _batched_outputs,
    _check_fidelity_arguments,
    _Cuts,
    _cuts,
    _input_dims,
    _shape_graph,
    forced_cuts,
)
from partitioner.graph import build_graph, compute_nodes
from partitioner.hybrid_plan import plan_hybrid
from partitioner.planner import plan_pipeline
from partitioner.trace import Traced, trace
from partitioner.visualizer import Plan as DrawablePlan, with_graph
from runtime.distributed import DistributedPipeline
from runtime.interpreter import Routes
from runtime.launch import distributed, init_process_group, stage_layout
from runtime.microbatch import batch_size, scatter
from runtime.pipeline import Pipeline, StageGraph
from runtime.plan import Plan, Schedule
from runtime.stage import build_stages, stage_io, weight_groups

__all__ = ["describe_model", "partition", "plan"]

PlacementChoice = Literal["pipeline", "branches", "auto"]
_SCHEDULES: tuple[str, ...] = get_args(Schedule)
_PLACEMENTS: tuple[str, ...] = get_args(PlacementChoice)


def plan(
    model: nn.Module,
    devices: Sequence[DeviceLike],
    *,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    micro_batches: int = 1,
    schedule: Schedule = "gpipe",
    placement: PlacementChoice = "pipeline",
    replicas: Sequence[int] | Literal["auto"] | None = None,
    virtual_stages: int = 2,
    cost_model: CostModel | None = None,
    processes: bool | None = None,
    input_split_spec: InputSplitSpec | None = None,
    split_points: SplitPoints = "markers",
    split_spec: Mapping[str, SplitPoint] | None = None,
) -> DrawablePlan:
    """Plan `model` onto `devices` and return the Plan; nothing is moved and nothing is built.

    The arguments mean what they mean for `partition`. `processes` says whether the plan is
    for one process per rank (torchrun; the default when running under it) or for one
    process holding every device; the plan then prices transfers between processes.

    Raises:
        PartitionError: bad arguments, a model that cannot be traced, or a plan that cannot fit.
    """
    resolved, args, kwargs = _check_arguments(model, devices, example_inputs, example_kwargs, micro_batches, schedule,
                                              placement, replicas, virtual_stages)
    _check_fidelity_arguments(model, None, input_split_spec, split_points, split_spec)
    multi = distributed() if processes is None else processes
    layout = _layout(len(resolved), schedule, replicas, virtual_stages, multi)
    traced, flat, first_chunk = _trace_example(model, args, kwargs, micro_batches, input_split_spec)
    return _plan_traced(model, traced, flat, first_chunk, resolved, layout, cost_model, micro_batches, schedule,
                        placement, replicas == "auto", multi, _cuts(split_points, split_spec))


def partition(
    model: nn.Module,
    devices: Sequence[DeviceLike],
    *,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    micro_batches: int = 1,
    schedule: Schedule = "gpipe",
    placement: PlacementChoice = "pipeline",
    replicas: Sequence[int] | Literal["auto"] | None = None,
    virtual_stages: int = 2,
    cost_model: CostModel | None = None,
    plan: Plan | None = None,
    threads: bool | None = None,
    timeout: float = 300.0,
    output_merge_spec: OutputMergeSpec | None = None,
    input_split_spec: InputSplitSpec | None = None,
    split_points: SplitPoints = "markers",
    split_spec: Mapping[str, SplitPoint] | None = None,
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
        schedule: "gpipe", "1f1b" or "interleaved" (interleaved 1F1B, `virtual_stages` stages
            per device). Every schedule runs in one process (`pipe.train_step`) and under torchrun.
        placement: "pipeline" (contiguous stages, one per device), "branches" (parallel
            branches of fork/join regions side by side on the devices, the rest on the first)
            or "auto" (whichever the simulator predicts faster).
        replicas: torchrun only: processes per stage, e.g. [2, 1] puts stage 0 on ranks 0 and
            1 (taking micro-batches in turn) and stage 1 on rank 2. Default: one each. "auto":
            the hybrid planner chooses the stages and each stage's replicas.
        cost_model: what predicts node and transfer times; by default profiled on the devices
            present (cached on disk, see cost_model.profiler), analytic for absent ones.
        plan: a Plan to run as it is (from `partitioner.plan`, or `Plan.from_json`), skipping planning.
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

    `pipe(x)` returns what `model(x)` returns and `loss.backward()` reaches the model's own
    parameters (one process); `pipe.train_step(x, y, loss_fn)` runs a whole step of the
    plan's schedule (one process and torchrun, where it is called on every rank).

    Raises:
        TypeError: `model` is not an nn.Module.
        PartitionError: bad devices, micro_batches or inputs, or a model that cannot be traced;
            the model is then left exactly as it was.
    """
    if plan is not None:
        try:
            plan.check()
        except ValueError as exc:
            raise PartitionError(str(exc)) from None
        schedule, virtual_stages = plan.schedule, max(plan.virtual_stages, 2)
        if micro_batches == 1 and plan.micro_batches != 1:
            micro_batches = plan.micro_batches
    resolved, args, kwargs = _check_arguments(model, devices, example_inputs, example_kwargs, micro_batches, schedule,
                                              placement, replicas, virtual_stages)
    _check_fidelity_arguments(model, output_merge_spec, input_split_spec, split_points, split_spec)
    if distributed():
        if input_split_spec is not None:
            raise PartitionError("input_split_spec is not supported under torchrun yet; split the inputs yourself")
        return _partition_distributed(model, resolved, args, kwargs, micro_batches, cost_model, plan, schedule,
                                      replicas, virtual_stages, timeout, placement, _cuts(split_points, split_spec))
    layout = _layout(len(resolved), schedule, replicas, virtual_stages, False) if plan is None else []
    traced, flat, first_chunk = _trace_example(model, args, kwargs, micro_batches, input_split_spec)
    gm = traced.graph_module
    dims = _input_dims(model, traced, input_split_spec)
    batched = _batched_outputs(traced, flat, first_chunk, dims, micro_batches)
    if plan is None:
        plan = _plan_traced(model, traced, flat, first_chunk, resolved, layout, cost_model, micro_batches, schedule,
                            placement, False, False, _cuts(split_points, split_spec))
    elif plan.micro_batches != micro_batches:
        plan.micro_batches = micro_batches
        plan.programs = []
    stages, undo = build_stages(gm, plan)
    undos = [undo]
    try:
        _finish(plan, gm, model, processes=False, regenerate=False)
        other = None
        if traced.other_mode is not None:  # forward reads self.training: the other mode's graph, cut alike
            other_plan = _same_cuts(traced.other_mode, plan)
            other_stages, other_undo = build_stages(traced.other_mode, other_plan)
            undos.append(other_undo)
            _finish(other_plan, traced.other_mode, model, processes=False, regenerate=False)
            other_output, _, other_constants = _graph_io(traced.other_mode)
            other = StageGraph(other_stages, other_output, other_constants, other_plan)
        output_node, placeholders, constants = _graph_io(gm)
        return Pipeline(model, StageGraph(stages, output_node, constants, plan), traced.flatten_inputs,
                        traced.unflatten_outputs, placeholders, threads, traced.mutated_inputs, other,
                        traced.other_mode_error, batched_outputs=batched, output_merge_spec=output_merge_spec,
                        input_dims=dims)
    except BaseException:
        for u in reversed(undos):
            u()
        raise


def _same_cuts(gm: torch.fx.GraphModule, plan: Plan) -> Plan:
    """`plan` for another graph of the same model (the other train/eval mode): nodes it shares stay
    in their stage; a node of its own joins the stage of its latest input."""
    stage_of = plan.stage_of()
    assigned: dict[str, int] = {}
    for node in compute_nodes(gm):
        s = stage_of.get(node.name)
        if s is None:
            s = max((assigned.get(p.name, 0) for p in node.all_input_nodes), default=0)
        assigned[node.name] = s
    stages = [
        dataclasses.replace(st, nodes=[n for n, s in assigned.items() if s == st.index], reads_from=[])
        for st in plan.stages
    ]
    other = dataclasses.replace(plan, stages=stages, programs=[], graph=None)
    try:
        stage_io(gm, other)
    except ValueError as exc:
        raise PartitionError(f"the model's graph in its other train/eval mode cannot be cut where this one is: {exc}; "
                             "partition the model in the mode you run it in") from None
    return other


def _check_arguments(
    model: nn.Module,
    devices: Sequence[DeviceLike],
    example_inputs: Any,
    example_kwargs: Mapping[str, Any] | None,
    micro_batches: int,
    schedule: str,
    placement: str,
    replicas: Any,
    virtual_stages: int,
) -> tuple[list[torch.device], tuple[Any, ...], dict[str, Any]]:
    """Every argument check of plan() and partition(), before anything is traced or moved."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    try:
        resolved = resolve_devices(devices)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise PartitionError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
    if placement not in _PLACEMENTS:
        raise PartitionError(f"placement={placement!r}; use one of {', '.join(map(repr, _PLACEMENTS))}")
    if schedule not in _SCHEDULES:
        raise PartitionError(f"schedule={schedule!r}; use one of {', '.join(map(repr, _SCHEDULES))}")
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise PartitionError(f"virtual_stages must be an integer >= 1, got {virtual_stages!r}")
    if isinstance(replicas, str) and replicas != "auto":
        raise PartitionError(f"replicas={replicas!r}; use 'auto' or a list of counts such as [2, 1]")
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    kwargs = dict(example_kwargs or {})
    if not args and not kwargs:
        raise PartitionError("example_inputs is empty: pass one batch of inputs, e.g. example_inputs=(x,)")
    if placement != "pipeline" and (replicas is not None or schedule != "gpipe"):
        raise PartitionError(f"placement={placement!r} runs the GPipe schedule without replicas")
    if replicas == "auto" and schedule == "interleaved":
        raise PartitionError("replicas='auto' plans a pipeline of replicated stages: use schedule 'gpipe' or '1f1b'")
    return resolved, args, kwargs


def _layout(ranks: int, schedule: str, replicas: Any, virtual_stages: int, processes: bool) -> list[list[int]]:
    if replicas is not None and not processes:
        raise PartitionError(
            "replicas need one process per stage replica: launch with torchrun (or initialize torch.distributed)"
        )
    if replicas == "auto":
        return [[r] for r in range(ranks)]
    try:
        return stage_layout(ranks, schedule, replicas, virtual_stages)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None


def _plan_traced(
    model: nn.Module,
    traced: Traced,
    flat: list[Any],
    first_chunk: list[Any],
    devices: list[torch.device],
    layout: list[list[int]],
    cost_model: CostModel | None,
    micro_batches: int,
    schedule: str,
    placement: str,
    auto: bool,
    processes: bool,
    cuts: _Cuts | None = None,
) -> DrawablePlan:
    """The plan for a traced model: chosen, with exact stage DAG, programs and predictions."""
    gm = traced.graph_module
    if micro_batches < max(len(r) for r in layout):
        raise PartitionError(f"micro_batches={micro_batches} leaves a replica idle; use at least "
                             f"{max(len(r) for r in layout)}")
    graph = _shape_graph(traced, first_chunk)
    order = [n.name for n in compute_nodes(gm)]
    forced = forced_cuts(graph, order, cuts or _Cuts("markers", {}))
    if forced and (auto or placement != "pipeline"):
        raise PartitionError(f"the model has pipe_split() markers (or a split_spec), which placement={placement!r}"
                             f"{' with replicas=auto' if auto else ''} cannot keep; use placement='pipeline', or "
                             "split_points='cost' to ignore them")
    cost = _prepared(cost_model, gm, first_chunk)
    if processes:  # every stage replica is a process: ranks on one device still pay for transfers
        cost = BetweenProcesses(cost)
    if auto:  # the hybrid planner wants the whole batch's shapes and chooses the layout
        made = plan_hybrid(build_graph(gm, flat), order, devices, cost, micro_batches=micro_batches,
                           schedules=(schedule,))
    elif placement == "pipeline":
        stage_devices = [devices[r[0]] for r in layout]
        made = plan_pipeline(graph, order, stage_devices, cost, micro_batches, [len(r) for r in layout],
                             cast(Schedule, schedule), forced=forced)
        for stage, ranks in zip(made.stages, layout):
            stage.ranks = ranks
        if not processes and not forced:  # the memory-aware fallback knows no markers
            made = _within_memory(made, lambda: build_graph(gm, flat), order, devices, cost, micro_batches)
            for stage, ranks in zip(made.stages, layout):
                stage.ranks = ranks
    else:
        made = _choose(graph, order, devices, cost, micro_batches, placement)
        if made.placement != "branches":
            for stage, ranks in zip(made.stages, layout):
                stage.ranks = ranks
    made.schedule = schedule  # type: ignore[assignment]
    made.virtual_stages = virtual_stages_of(made)
    _finish(made, gm, model, processes=processes, regenerate=True)
    return with_graph(made, graph, cost)


def virtual_stages_of(plan: Plan) -> int:
    ranks = {r for s in plan.stages for r in s.ranks}
    return max(1, len(plan.stages) // max(1, len(ranks))) if plan.schedule == "interleaved" else 1


def _finish(plan: Plan, gm: torch.fx.GraphModule, model: nn.Module, *, processes: bool, regenerate: bool) -> None:
    """Give `plan` its exact stage DAG (from the traced graph) and all-reduce groups, then its
    programs and predictions (partitioner.assemble.finish); a given plan keeps its programs
    when nothing they depend on changed."""
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    producers = Routes.of(stage_io(gm, plan), output_node).producers()
    changed = regenerate or not plan.programs
    for stage, reads in zip(plan.stages, producers):
        if not stage.ranks:
            stage.ranks, changed = [stage.index], True
        if stage.reads_from != reads:
            stage.reads_from, changed = reads, True
    if not changed:
        return
    stage_ranks = [list(s.ranks) for s in plan.stages]
    groups = weight_groups(gm, plan.stage_of(), stage_ranks, model) if processes else []
    finish(plan, [(list(r), st) for r, st in groups])


def _trace_example(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], micro_batches: int,
    input_split_spec: InputSplitSpec | None = None,
) -> tuple[Traced, list[Any], list[Any]]:
    """Trace the model; return it, the example's placeholder values and its first micro-batch."""
    traced = trace(model, args, kwargs)
    # Shape propagation and profiling run the model: on copies, so the caller's tensors stay as they are.
    flat = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in traced.flatten_inputs(args, kwargs)]
    dims = _input_dims(model, traced, input_split_spec)
    try:
        batch_size([v for v, d in zip(flat, dims or ["auto"] * len(flat)) if d == "auto"] or flat)
        first_chunk = scatter(flat, micro_batches, dims)[0]
    except ValueError as exc:
        raise PartitionError(f"example_inputs: {exc}") from None
    return traced, flat, first_chunk


def _graph_io(gm: torch.fx.GraphModule) -> tuple[torch.fx.Node, list[str], dict[str, Any]]:
    """The graph's output node, its placeholder names, and the objects its get_attr nodes name."""
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    constants = {n.name: operator.attrgetter(str(n.target))(gm) for n in gm.graph.nodes if n.op == "get_attr"}
    return output_node, placeholders, constants


def describe_model(model: nn.Module, example_inputs: Any, example_kwargs: Mapping[str, Any] | None = None) -> str:
    """A printable report of the model's structure: fork/join regions (parallel branches,
    nested), the critical path and the cheapest cut points. The model is left untouched."""
    from partitioner.analysis import describe

    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    traced = trace(model, args, dict(example_kwargs or {}))
    return describe(build_graph(traced.graph_module, traced.flatten_inputs(args, dict(example_kwargs or {}))))


def _choose(
    graph: Any, order: list[str], devices: list[torch.device], cost: CostModel, micro_batches: int, placement: str
) -> Plan:
    """The plan for `placement`; for "auto", the faster of pipeline and branches as simulated."""
    if placement == "pipeline":
        return plan_pipeline(graph, order, devices, cost, micro_batches)
    min_gain = 0.0 if placement == "branches" else 0.05
    branches = plan_branches(graph, order, devices, cost, micro_batches, min_gain=min_gain)
    if placement == "branches":
        return branches
    chain = plan_pipeline(graph, order, devices, cost, micro_batches)
    times = {"pipeline": chain.predicted_step_ms, "branches": branches.predicted_step_ms}
    best = branches if branches.placement == "branches" and times["branches"] < times["pipeline"] else chain
    best.alternatives = times
    return best


def device_capacity(cost: CostModel, device: torch.device) -> int:
    """Bytes a device holds: the cost model's (possibly hand-described) spec, else what is there."""
    for model in (cost, getattr(cost, "fallback", None)):
        spec = getattr(model, "spec", None)
        if callable(spec):
            memory = int(spec(device).memory_bytes)
            if memory > 0:
                return memory
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return host_memory()[0]


def _within_memory(
    plan: Plan, whole_graph: Any, order: list[str], devices: list[torch.device], cost: CostModel, micro_batches: int
) -> Plan:
    """`plan` if every device holds its stages (weights, gradients, activations in flight), else a
    memory-aware split from the hybrid planner; InfeasibleError names what each device would need."""
    need: dict[str, int] = {}
    for stage in plan.stages:
        need[stage.device] = need.get(stage.device, 0) + 2 * stage.param_bytes + stage.activation_bytes
    capacity = {d: device_capacity(cost, torch.device(d)) for d in need}
    if all(n <= capacity[d] for d, n in need.items()):
        return plan
    shares = {d: sum(1 for x in devices if str(x) == d) for d in need}  # stages sharing one device split it
    limits = [capacity[str(d)] / shares[str(d)] for d in devices]
    return plan_hybrid(
        whole_graph(), order, devices, cost, micro_batches=micro_batches, schedules=("gpipe",),
        replicate=False, stages=len(devices), memory_bytes=limits, optimizer="sgd",
    )


def _prepared(cost_model: CostModel | None, gm: torch.fx.GraphModule, flat_inputs: list[Any]) -> CostModel:
    """The cost model to plan with (profiled where the device is here, by default), shown the graph."""
    cost = cost_model if cost_model is not None else default_cost_model()
    prepare = getattr(cost, "prepare", None)  # optional: see cost_model.interface
    if callable(prepare):
        prepare(gm, flat_inputs)
    return cost


def _partition_distributed(
    model: nn.Module,
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
    cuts: _Cuts | None = None,
) -> DistributedPipeline:
    if not dist.is_initialized():
        init_process_group(devices, timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(devices) != world:
        raise PartitionError(f"devices lists {len(devices)} devices but the job has {world} ranks; "
                             "pass one device per rank")
    if devices[rank].type == "cuda":
        torch.cuda.set_device(devices[rank])
    layout = _layout(world, schedule, replicas, virtual_stages, True) if plan is None else []
    traced, flat, first_chunk = _trace_example(model, args, kwargs, micro_batches)
    gm = traced.graph_module
    if plan is None:
        text: list[Any] = [None]
        failure: BaseException | None = None
        if rank == 0:  # one rank plans, so every rank runs the same plan whatever its timings
            try:
                made = _plan_traced(model, traced, flat, first_chunk, devices, layout, cost_model, micro_batches,
                                    schedule, placement, replicas == "auto", True, cuts)
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
    _finish(plan, gm, model, processes=True, regenerate=False)
    mine = [s.index for s in plan.stages if rank in s.ranks]
    if not mine:
        raise PartitionError(f"the plan gives rank {rank} no stage; every rank needs one")
    io = stage_io(gm, plan)
    stages, undo = build_stages(gm, plan, local=mine)
    undos = [undo]
    try:
        _, placeholders, constants = _graph_io(gm)
        groups = weight_groups(gm, plan.stage_of(), [list(s.ranks) for s in plan.stages], model)
        other = None
        if traced.other_mode is not None:  # forward reads self.training: the other mode's graph, cut alike
            other_plan = _same_cuts(traced.other_mode, plan)
            _finish(other_plan, traced.other_mode, model, processes=True, regenerate=False)
            other_stages, other_undo = build_stages(traced.other_mode, other_plan, local=mine)
            undos.append(other_undo)
            other_output, _, other_constants = _graph_io(traced.other_mode)
            other = StageGraph(other_stages, other_output, other_constants, other_plan,
                               stage_io(traced.other_mode, other_plan))
        return DistributedPipeline(
            model, gm, plan, stages, io, traced.flatten_inputs, traced.unflatten_outputs, placeholders, constants,
            timeout, groups, traced.mutated_inputs, other, traced.other_mode_error,
        )
    except BaseException:
        for u in reversed(undos):
            u()
        raise
