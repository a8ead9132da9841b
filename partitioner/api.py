"""partition(model, devices): trace, cost, split and return a pipelined model in one call."""

from __future__ import annotations

import datetime
import operator
import os
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from cost_model import default_cost_model
from cost_model.devices import host_memory
from cost_model.processes import BetweenProcesses
from cost_model.analytic import CostModel
from cost_model.devices import DeviceLike, resolve_devices
from partitioner.errors import PartitionError
from partitioner.graph import build_graph, compute_nodes
from partitioner.branches import plan_branches, stage_producers
from partitioner.hybrid_plan import plan_hybrid
from partitioner.planner import plan_pipeline
from partitioner.simulator import simulate
from partitioner.trace import Traced, trace
from partitioner.visualizer import Plan as DrawablePlan
from partitioner.visualizer import with_graph
from runtime.distributed import DistributedPipeline
from runtime.microbatch import batch_size, scatter
from runtime.pipeline import Pipeline
from runtime.plan import Plan
from runtime.schedule import Action, dag_gpipe, dag_levels, interleaved_one_f_one_b, one_f_one_b
from runtime.stage import build_stages, stage_io

__all__ = ["describe_model", "partition"]


def partition(
    model: nn.Module,
    devices: Sequence[DeviceLike],
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    micro_batches: int = 1,
    cost_model: CostModel | None = None,
    plan: Plan | None = None,
    threads: bool | None = None,
    schedule: str = "gpipe",
    replicas: Sequence[int] | str | None = None,
    virtual_stages: int = 2,
    timeout: float = 300.0,
    placement: str = "pipeline",
) -> Pipeline | DistributedPipeline:
    """Split `model` into one pipeline stage per entry of `devices` and return it ready to run.

    Args:
        model: the module to partition; its parameters are moved to the stages' devices in
            place and stay its own (an optimizer over `model.parameters()` keeps working).
        devices: one device per stage, e.g. ["cuda:0", "cuda:1"]; a device may repeat.
        example_inputs: a full batch of positional inputs (a tuple, or one tensor). Dim 0
            of the first tensor is the batch that is split into micro-batches.
        example_kwargs: keyword inputs of the same example call.
        micro_batches: how many micro-batches each call is split into (GPipe schedule).
        cost_model: what predicts node and transfer times; by default profiled on the devices
            present (cached on disk, see cost_model.profiler), analytic for absent ones.
        plan: a Plan to run as it is (for example one saved with `Plan.to_json`), skipping planning.
        threads: run stages on worker threads; default only when there are several devices.
        schedule: "gpipe", "1f1b" or "interleaved" (interleaved 1F1B, `virtual_stages` stages
            per rank). One process runs GPipe (backward is autograd's); the others need
            several processes.
        replicas: multi-process only: processes per stage, e.g. [2, 1] puts stage 0 on ranks
            0 and 1 (taking micro-batches in turn) and stage 1 on rank 2. Default: one each.
            "auto": the hybrid planner chooses the number of stages and each stage's replicas
            (all-reduce and memory included) for the given micro-batches and schedule.
        timeout: multi-process only: seconds to wait for another rank before failing with
            an error that names it.
        placement: "pipeline" (contiguous stages, one per device), "branches" (parallel
            branches of fork/join regions side by side on the devices, the rest on the first)
            or "auto" (whichever the simulator predicts faster).

    Under torchrun (WORLD_SIZE > 1, or torch.distributed already initialized) `devices`
    lists the device of every rank, and the result is this rank's DistributedPipeline:
    train with `pipe.train_step(inputs, targets, loss_fn)` on every rank.

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
    if replicas == "auto" and not _distributed():
        raise PartitionError("replicas='auto' needs one process per replica: launch with torchrun")
    if not args and not kwargs:
        raise PartitionError("example_inputs is empty: pass one batch of inputs, e.g. example_inputs=(x,)")

    if placement not in ("pipeline", "branches", "auto"):
        raise PartitionError(f"placement={placement!r}; use 'pipeline', 'branches' or 'auto'")
    if schedule not in ("gpipe", "1f1b", "interleaved"):
        raise PartitionError(f"schedule={schedule!r}; use 'gpipe', '1f1b' or 'interleaved'")
    if _distributed():
        return _partition_distributed(
            model, resolved, args, kwargs, micro_batches, cost_model, plan, schedule, replicas, virtual_stages, timeout,
            placement,
        )
    if schedule != "gpipe" or replicas is not None:
        raise PartitionError(
            f"schedule={schedule!r} and replicas need one process per stage replica: launch with "
            "torchrun (or initialize torch.distributed) and call pipe.train_step; one process runs 'gpipe'"
        )

    traced, flat, first_chunk = _trace_example(model, args, kwargs, micro_batches)
    gm = traced.graph_module
    graph = build_graph(gm, first_chunk)
    order = [n.name for n in compute_nodes(gm)]
    cost = _prepared(cost_model, gm, first_chunk) if plan is None else cost_model
    if plan is None:
        plan = _choose(graph, order, resolved, cost, micro_batches, placement)
        plan = _within_memory(plan, lambda: build_graph(gm, flat), order, resolved, cost, micro_batches)
    elif plan.micro_batches != micro_batches:
        plan.micro_batches = micro_batches
    plan = with_graph(plan, graph, cost)  # drawable, with the times it was planned with

    stages, undo = build_stages(gm, plan)
    try:
        output_node, placeholders, constants = _graph_io(gm)
        return Pipeline(model, stages, plan, output_node, traced.flatten_inputs, traced.unflatten_outputs, placeholders, constants, threads)
    except BaseException:
        undo()
        raise


def _trace_example(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], micro_batches: int
) -> tuple[Traced, list[Any], list[Any]]:
    """Trace the model; return it, the example's placeholder values and its first micro-batch."""
    traced = trace(model, args, kwargs)
    flat = traced.flatten_inputs(args, kwargs)
    try:
        batch_size(flat)
        first_chunk = scatter(flat, micro_batches)[0]
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
    """The plan for `placement`; for "auto", the faster of pipeline and branches by simulation."""
    if placement == "pipeline":
        return plan_pipeline(graph, order, devices, cost, micro_batches)
    branches = plan_branches(graph, order, devices, cost, micro_batches, min_gain=0.0 if placement == "branches" else 0.05)
    if placement == "branches":
        return branches
    chain = plan_pipeline(graph, order, devices, cost, micro_batches)
    times = {}
    for name, candidate in (("pipeline", chain), ("branches", branches)):
        producers = stage_producers(graph, candidate)
        owners = [s.ranks[0] if s.ranks else s.index for s in candidate.stages]
        lists = dag_gpipe(micro_batches, dag_levels(producers), owners)
        times[name] = simulate(candidate, lists, producers=producers).makespan_ms
    best = branches if times["branches"] < times["pipeline"] else chain
    best.notes["predicted_ms"] = times
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


def _distributed() -> bool:
    return dist.is_available() and (dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1)


def _init_process_group(devices: list[torch.device], timeout: float) -> None:
    """Join the job from torchrun's environment, in a store namespace of this restart attempt.

    After `torchrun --max-restarts` restarts the workers, keys written by the previous
    attempt (peer addresses) can still be in the store; a fresh prefix keeps them apart.
    """
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    backend = "nccl" if rank < len(devices) and devices[rank].type == "cuda" else "gloo"
    wait = datetime.timedelta(seconds=timeout)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")),
        world, is_master=rank == 0 and not agent, timeout=wait,
    )
    prefixed = dist.PrefixStore(f"partitioner/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=wait)


def _layout(world: int, schedule: str, replicas: Sequence[int] | None, virtual_stages: int) -> list[list[int]]:
    """Ranks of each stage: stage by stage for replicas; round robin for interleaved."""
    if schedule == "interleaved":
        if replicas is not None and any(r != 1 for r in replicas):
            raise PartitionError("schedule='interleaved' runs one replica per stage; drop replicas or use '1f1b'")
        if virtual_stages < 2:
            raise PartitionError(f"virtual_stages={virtual_stages}; interleaving needs 2 or more stages per rank")
        return [[s % world] for s in range(world * virtual_stages)]
    counts = list(replicas) if replicas is not None else [1] * world
    if any(not isinstance(r, int) or r < 1 for r in counts) or sum(counts) != world:
        raise PartitionError(f"replicas={counts} must be positive integers adding up to the {world} ranks of the job")
    starts = [sum(counts[:s]) for s in range(len(counts))]
    return [list(range(a, a + r)) for a, r in zip(starts, counts)]


def _partition_distributed(
    model: nn.Module,
    devices: list[torch.device],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    micro_batches: int,
    cost_model: CostModel | None,
    plan: Plan | None,
    schedule: str,
    replicas: Sequence[int] | str | None,
    virtual_stages: int,
    timeout: float,
    placement: str = "pipeline",
) -> DistributedPipeline:
    if not dist.is_initialized():
        _init_process_group(devices, timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(devices) != world:
        raise PartitionError(f"devices lists {len(devices)} devices but the job has {world} ranks; pass one device per rank")
    if devices[rank].type == "cuda":
        torch.cuda.set_device(devices[rank])
    auto = replicas == "auto"
    if auto and (schedule == "interleaved" or placement != "pipeline"):
        raise PartitionError("replicas='auto' plans a pipeline of replicated stages: use schedule 'gpipe' or '1f1b'")
    if placement != "pipeline" and (replicas is not None or schedule != "gpipe"):
        raise PartitionError(f"placement={placement!r} runs the GPipe schedule without replicas")
    layout = [[r] for r in range(world)] if auto else _layout(world, schedule, replicas, virtual_stages)  # type: ignore[arg-type]
    if micro_batches < max(len(r) for r in layout):
        raise PartitionError(f"micro_batches={micro_batches} leaves a replica idle; use at least {max(len(r) for r in layout)}")

    traced, flat, first_chunk = _trace_example(model, args, kwargs, micro_batches)
    gm = traced.graph_module
    if plan is None:
        text: list[Any] = [None]
        failure: BaseException | None = None
        if rank == 0:  # one rank plans, so every rank runs the same plan whatever its timings
            try:
                text = [("plan", _plan_for_ranks(gm, flat, first_chunk, devices, layout, cost_model, micro_batches,
                                                 schedule, auto, placement))]
            except Exception as exc:  # noqa: BLE001 - the others must hear of it, not wait for a plan
                failure, text = exc, [("error", f"{type(exc).__name__}: {exc}")]
        dist.broadcast_object_list(text, src=0)
        kind, payload = text[0]
        if kind == "error":
            if failure is not None:
                raise failure
            raise PartitionError(f"rank 0 could not plan: {payload}")
        plan = DrawablePlan.from_json(payload)
    plan.micro_batches = micro_batches
    if any(not s.ranks for s in plan.stages):
        for stage, ranks in zip(plan.stages, layout):
            stage.ranks = stage.ranks or ranks
    mine = [s.index for s in plan.stages if rank in s.ranks]
    if not mine:
        raise PartitionError(f"the plan gives rank {rank} no stage; every rank needs one")
    io = stage_io(gm, plan)
    lists = _schedule_lists(plan, io, schedule, world)
    stages, undo = build_stages(gm, plan, local=mine)
    try:
        _, placeholders, constants = _graph_io(gm)
        return DistributedPipeline(
            model, gm, plan, stages, io, lists,
            traced.flatten_inputs, traced.unflatten_outputs, placeholders, constants, timeout,
        )
    except BaseException:
        undo()
        raise


def _plan_for_ranks(
    gm: torch.fx.GraphModule,
    flat: list[Any],
    first_chunk: list[Any],
    devices: list[torch.device],
    layout: list[list[int]],
    cost_model: CostModel | None,
    micro_batches: int,
    schedule: str,
    auto: bool,
    placement: str,
) -> str:
    """Rank 0's plan for the whole job, as JSON with ranks filled and the graph attached."""
    graph = build_graph(gm, first_chunk)
    order = [n.name for n in compute_nodes(gm)]
    # every stage replica is a process: ranks on one device still pay for transfers
    cost = BetweenProcesses(_prepared(cost_model, gm, first_chunk))
    if auto:  # the hybrid planner wants the whole batch's shapes and chooses the layout
        made = plan_hybrid(build_graph(gm, flat), order, devices, cost, micro_batches=micro_batches, schedules=(schedule,))
    elif placement == "pipeline":
        stage_devices = [devices[r[0]] for r in layout]
        made = plan_pipeline(graph, order, stage_devices, cost, micro_batches, [len(r) for r in layout], schedule)
        for stage, ranks in zip(made.stages, layout):
            stage.ranks = ranks
    else:
        made = _choose(graph, order, devices, cost, micro_batches, placement)
        if made.notes.get("placement") != "branches":
            for stage, ranks in zip(made.stages, layout):
                stage.ranks = ranks
    return with_graph(made, graph, cost).to_json()


def _schedule_lists(plan: Plan, io: list[tuple[list[str], list[str]]], schedule: str, world: int) -> list[list[Action]]:
    """Action lists for the plan: GPipe for any DAG of stages; 1F1B and interleaved for chains."""
    producer = {name: s for s, (_, outs) in enumerate(io) for name in outs}
    levels = dag_levels([sorted({producer[n] for n in ins if n in producer}) for ins, _ in io])
    p, m = len(plan.stages), plan.micro_batches
    chain = levels == list(range(p))
    if schedule != "gpipe" and not chain:
        raise PartitionError(f"schedule={schedule!r} needs a chain of stages; this plan places branches side by side, use 'gpipe'")
    if schedule == "interleaved":
        return interleaved_one_f_one_b(m, world, p // world)
    if schedule == "1f1b":
        return one_f_one_b(m, p)
    single = all(len(s.ranks) == 1 for s in plan.stages)
    return dag_gpipe(m, levels, [s.ranks[0] for s in plan.stages] if single else list(range(p)))
