"""Placement -> Plan: the one function that counts a stage's numbers, for every planner.

The chain, branch and hybrid planners decide only where nodes go (which nodes form each
stage, on which device, run by which ranks). `assemble` turns that into a Plan: per-stage
times and bytes by one set of rules, the per-rank programs of the schedule, and the
simulator's predicted times of every op, all-reduces included. `finish` lowers and
simulates an existing plan again (other weight groups, micro-batches or schedule).
The rules live beside it: times, messages and bytes in counting.py, recomputation and memory
in recompute_modes.py, programs in lowering.py, prices of a plan simulated again in prices.py.

[Note: stage counting rules]
- Times: a node's forward + backward (`cost.node_time`, split by `forward_time`) on each
  device running a replica; a stage takes its slowest replica's.
- Messages: a value made in stage p and read by stage s > p travels p -> s once per
  micro-batch (activations) and s -> p (its gradient). A value only the model output reads
  counts as read by the last stage, which assembles the output. Graph inputs and weights
  are not messages (every rank gets the inputs; weights live where they are read).
  recv_bytes / send_bytes sum the values into / out of a stage over all its edges;
  comm_ms sums the message times of both directions (slowest pair of replica devices).
- param_bytes: each weight once, in the first stage (lowest index) reading it, so the
  stages add up to the model; a weight read by several stages is all-reduced between them
  (a weight group).
- activation_bytes: what the stage holds at its peak, one micro-batch's backward: the bytes its
  nodes keep under its `recompute` mode for each other micro-batch in flight (the most one rank
  holds under the plan's programs), the most that backward holds (kept, recomputed, gradients),
  and the received inputs of each (cost_model/recompute_cost.py, cost_model/memory.py).
- recompute: "selective" and "full" add the forward they run again to `backward_ms` (and
  `compute_ms`); `recount` sets the modes of a placed plan.
- memory_bytes: (2 + optimizer states) x param_bytes + activation_bytes + the outputs held per
  micro-batch in flight and their gradient (cost_model/memory.py, `stage_memory`).
- allreduce_ms: ring all-reduce of param_bytes over the replicas' devices (0 for one).
- predicted_ms: (compute_ms + comm_ms) / replicas; predicted_step_ms: the simulated step.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import networkx as nx
import torch

from cost_model.interface import CostModel
from cost_model.update_cost import version_bytes
from partitioner.errors import PartitionError
from partitioner.predict.counting import allreduce_seconds, count_stages, weight_groups
from partitioner.predict.lowering import Groups, lower_plan, merge_groups, reduced_groups, replica_groups
from partitioner.predict.prices import group_price, message_price
from partitioner.predict.program_run import in_flight
from partitioner.predict.recompute_modes import by_mode, mode_costs, placed_memory, replica_devices, set_mode
from partitioner.predict.simulator import simulate, steady_step_ms
from partitioner.predict.timeline import Timeline
from rules.schedules import virtual_stages
from runtime.plan import RECOMPUTE_MODES, Placement, Plan, RecomputeMode, Schedule, StagePlan

__all__ = ["assemble", "counted_per_rank", "finish", "predict", "price_update", "recompute_memory", "recount"]


def assemble(
    graph: nx.DiGraph,
    stage_nodes: Sequence[Sequence[str]],
    stage_devices: Sequence[torch.device | str],
    cost: CostModel,
    *,
    micro_batches: int,
    schedule: Schedule = "gpipe",
    stage_ranks: Sequence[Sequence[int]] | None = None,
    rank_devices: Sequence[torch.device | str] | None = None,
    placement: Placement = "pipeline",
    groups: Groups | None = None,
    optimizer: str = "adam",
    capacity_bytes: Sequence[int | None] | None = None,
    recompute: Sequence[RecomputeMode] | None = None,
) -> Plan:
    """The Plan of a placement, counted by the rules of [Note: stage counting rules].

    Args:
        graph: from `build_graph`, annotated for one micro-batch.
        stage_nodes: each stage's compute nodes, stages in topological order.
        stage_devices: the device of each stage.
        cost: node and transfer times (and all-reduce, when it has `allreduce_time`).
        micro_batches: per step.
        schedule: a registered schedule's name (rules.schedules): "gpipe", "1f1b", "interleaved"
            (stages round robin over the ranks), "zb1", "zbv" or "dualpipev" (stages in a V), ...
        stage_ranks: the ranks running a replica of each stage (default: stage s on rank s).
        rank_devices: the device of each rank (default: its stage's device).
        placement: what kind of placement this is, for the reader.
        groups: (ranks, stages) of weights held by several ranks, all-reduced after their
            last backward (default: each replicated stage, and each weight read by several
            stages in the graph).
        optimizer: for memory_bytes: "sgd", "momentum", "adam", ...
        capacity_bytes: usable bytes of each stage's device, where known.
        recompute: each stage's activation recomputation (default: none).

    Raises:
        PartitionError: a node in two stages or not in the graph, a stage reading a later
            one, mismatched lengths, or a schedule that cannot run this layout.
    """
    p = len(stage_nodes)
    ranks = [list(r) for r in stage_ranks] if stage_ranks is not None else [[s] for s in range(p)]
    modes: list[RecomputeMode] = list(recompute) if recompute is not None else ["none"] * p
    _check(graph, stage_nodes, stage_devices, ranks, micro_batches, capacity_bytes, modes)
    device_of = {r: torch.device(stage_devices[s]) for s in range(p) for r in ranks[s]}
    device_of.update({r: torch.device(d) for r, d in enumerate(rank_devices or [])})
    names = [str(torch.device(d)) for d in stage_devices]
    stages, message = count_stages(graph, stage_nodes, names, ranks, device_of, cost)
    for stage, mode in zip(stages, modes):
        if mode != "none":
            set_mode(stage, mode, mode_costs(graph, stage.nodes, replica_devices(cost, stage, device_of), cost))
    for stage, capacity in zip(stages, capacity_bytes or [None] * p):
        stage.capacity_bytes = capacity
    plan = Plan(stages=stages, micro_batches=micro_batches, schedule=schedule, placement=placement,
                virtual_stages=virtual_stages(schedule, ranks))
    weights = weight_groups(graph, plan) if groups is None else []
    reduce_ms = {tuple(sorted(set(s.ranks))): s.allreduce_ms for s in plan.stages if len(set(s.ranks)) > 1}
    for group_ranks, _, nbytes in weights:
        key = tuple(sorted(set(group_ranks)))
        reduce_ms[key] = reduce_ms.get(key, 0.0) + 1e3 * allreduce_seconds(cost, nbytes, [device_of[r] for r in key])
    chosen = [*replica_groups(plan), *((r, st) for r, st, _ in weights)] if groups is None else groups
    plan.programs = lower_plan(plan, merge_groups(chosen), {r: str(d) for r, d in device_of.items()})
    for stage, flight in zip(plan.stages, in_flight(plan.programs, p)):
        costs = mode_costs(graph, stage.nodes, [torch.device(stage.device)], cost, timed=False)
        memory = placed_memory(graph, plan, stage, costs[stage.recompute], flight, optimizer)
        stage.activation_bytes, stage.memory_bytes = memory.activations, memory.total
    predict(plan, lambda src, dst, nbytes: message.get((src, dst), 0.0), group_price(plan, [], reduce_ms, None))
    return plan


def recount(plan: Plan, graph: nx.DiGraph, cost: CostModel, modes: Sequence[RecomputeMode]) -> None:
    """Give a placed plan's stages their activation recomputation, and recount what it changes.

    Each stage's `recompute`, `compute_ms`, `backward_ms` and `predicted_ms` (the forward run
    again), `activation_bytes` (what it keeps, times the micro-batches in flight under the plan's
    programs) and `memory_bytes` (by as much). Run `finish` next to simulate the plan again.

    Raises:
        PartitionError: not one mode per stage, or a mode that is not one of RECOMPUTE_MODES.
    """
    if len(modes) != len(plan.stages) or any(m not in RECOMPUTE_MODES for m in modes):
        raise PartitionError(f"recompute modes {list(modes)} for {len(plan.stages)} stages: give one per stage, "
                             f"each one of {', '.join(RECOMPUTE_MODES)}")
    for stage, mode, (costs, held) in zip(plan.stages, modes, by_mode(plan, graph, cost)):
        if mode == stage.recompute and counted_per_rank(stage):
            continue
        set_mode(stage, mode, costs)
        if stage.memory_bytes:
            stage.memory_bytes += held[mode] - stage.activation_bytes
        stage.activation_bytes = held[mode]


def counted_per_rank(stage: StagePlan) -> bool:
    """Whether the cluster search counted `stage` on each rank's share (split over tensor or context ranks, or
    sharded: place/cluster/stages.py), where this module's counts are of the whole graph."""
    return stage.width > 1 or stage.sharding != "none"


def recompute_memory(plan: Plan, graph: nx.DiGraph, cost: CostModel) -> list[dict[str, int]]:
    """Each stage's predicted `memory_bytes` under each recomputation mode (what `recount` would make it)."""
    return [{m: s.memory_bytes - s.activation_bytes + h for m, h in held.items()}
            for s, (_, held) in zip(plan.stages, by_mode(plan, graph, cost))]


def finish(
    plan: Plan,
    groups: Groups | None = None,
    *,
    transfer_ms: Callable[[int, int, int], float] | None = None,
    group_ms: Mapping[tuple[int, ...], float] | None = None,
    graph: nx.DiGraph | None = None,
) -> Timeline:
    """Lower `plan`'s schedule into programs again and simulate them; returns the timeline.

    For a plan whose ranks, groups, micro-batches or schedule changed. Fills `programs` (with
    their predicted times), `predicted_step_ms` and, scaled to the new micro-batches in
    flight, `activation_bytes` and `memory_bytes`. Messages and all-reduces are priced as the
    old programs recorded (see partitioner/predict/prices.py), unless `transfer_ms` ((src stage, dst
    stage, bytes) -> ms) or `group_ms` (group ranks -> ms) say otherwise.

    Args:
        groups: (ranks, stages) of weights held by several ranks. Default: the groups the
            old programs all-reduce (after the last backward of the stages on their ranks),
            else the replicated stages; pass [] where replicas share their weights (one process).
        graph: the plan's graph, to count `activation_bytes` and `memory_bytes` again for the new
            micro-batches in flight; without it they are scaled in proportion (which also scales
            the one backward's peak: an approximation).

    Raises:
        PartitionError: the schedule cannot run this layout.
    """
    old = plan.programs
    message = message_price(plan, old, transfer_ms)
    price = group_price(plan, old, group_ms, None)
    before = in_flight(old, len(plan.stages)) if old else None
    devices = {r: _rank_device(plan, s, r) for s in plan.stages for r in s.ranks or [s.index]}
    runs = {r: {s.index for s in plan.stages if r in (s.ranks or [s.index])} for r in devices}
    for prog in old:  # a rank that runs what it ran keeps its own device (replicas may differ from the stage's)
        if runs.get(prog.rank, set()) == {op.stage for op in prog.ops if op.is_compute}:
            devices[prog.rank] = prog.device
    if groups is None:
        groups = reduced_groups(plan) if old else replica_groups(plan)
    plan.programs = lower_plan(plan, merge_groups(groups), devices)
    if before is not None:
        for stage, was, now in zip(plan.stages, before, in_flight(plan.programs, len(plan.stages))):
            if graph is not None:  # the static terms cancel: only what the flight changes moves
                costs = mode_costs(graph, stage.nodes, [], None, timed=False)[stage.recompute]
                old_mem, new_mem = (placed_memory(graph, plan, stage, costs, f) for f in (was, now))
                stage.activation_bytes += new_mem.activations - old_mem.activations
                moved = new_mem.activations + new_mem.buffers - old_mem.activations - old_mem.buffers
                stage.memory_bytes += moved if stage.memory_bytes else 0
            elif was > 0:
                grown = stage.activation_bytes // was * now - stage.activation_bytes
                stage.activation_bytes += grown
                stage.memory_bytes += grown if stage.memory_bytes else 0
    return predict(plan, lambda src, dst, nbytes: message(src, dst), price)


def _rank_device(plan: Plan, stage: StagePlan, rank: int) -> str:
    """The device of `rank`, a rank of `stage`: its host's own GPU `cuda:{rank % gpus_per_host}` where the plan
    names GPUs so (a cluster plan: `gpus_per_host` > 0 and the stage on its first rank's local GPU), else the
    stage's device. Naming every replica by the stage's device put a cluster stage's replicas on one GPU, and
    `fits_memory` summed their memory there ("(over memory)" on candidates that fit)."""
    per_host = plan.gpus_per_host
    local = per_host > 0 and bool(stage.ranks) and stage.device == f"cuda:{stage.ranks[0] % per_host}"
    return f"cuda:{rank % per_host}" if local else stage.device


def _check(
    graph: nx.DiGraph, stage_nodes: Sequence[Sequence[str]], stage_devices: Sequence[Any],
    ranks: list[list[int]], micro_batches: int, capacity: Sequence[Any] | None, modes: Sequence[str],
) -> None:
    p, problems = len(stage_nodes), []
    if (p < 1 or len(stage_devices) != p or len(ranks) != p or (capacity is not None and len(capacity) != p)
            or len(modes) != p):
        problems.append(f"{p} stages, {len(stage_devices)} devices, {len(ranks)} rank lists"
                        f"{'' if capacity is None else f', {len(capacity)} capacities'}, {len(modes)} recompute modes: "
                        "give one of each per stage")
    if any(m not in RECOMPUTE_MODES for m in modes):
        problems.append(f"recompute modes {list(modes)}: use {', '.join(RECOMPUTE_MODES)}")
    if any(not r or min(r) < 0 for r in ranks):
        problems.append(f"stage ranks {ranks}: every stage needs one or more ranks >= 0")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        problems.append(f"micro_batches={micro_batches!r}: use an integer >= 1")
    counts: dict[str, int] = {}
    for names in stage_nodes:
        for n in names:
            counts[n] = counts.get(n, 0) + 1
    unknown = [n for n in counts if n not in graph]
    twice = [n for n, c in counts.items() if c > 1]
    if unknown:
        problems.append(f"nodes not in the graph: {unknown[:5]}")
    if twice:
        problems.append(f"nodes in several stages: {twice[:5]}; put each node in one stage")
    if problems:
        raise PartitionError("cannot assemble the plan:\n" + "\n".join(f"- {x}" for x in problems))


def predict(
    plan: Plan, transfer_ms: Callable[[int, int, int], float], group_ms: Callable[[tuple[int, ...]], float]
) -> Timeline:
    """Simulate the plan's programs; store each op's (start, end) and the step's length in the plan."""
    timeline = simulate(plan, transfer_ms=transfer_ms, group_ms=group_ms)
    for program, times in zip(plan.programs, timeline.predicted):
        program.predicted = list(times)
    plan.predicted_step_ms = timeline.makespan_ms
    return timeline


def price_update(plan: Plan) -> None:
    """Price `plan.update` once, after planning: an asynchronous plan ("2bw", "stash") predicts the stream's
    steady-state batch (partitioner.predict.simulator.steady_step_ms, no flush), and each predicted `memory_bytes`
    adds the stage's weight versions (cost_model/update_cost.py). Sync plans are left as they are."""
    if plan.update == "sync":
        return
    plan.predicted_step_ms = steady_step_ms(plan)
    for stage in plan.stages:
        if stage.memory_bytes:
            stage.memory_bytes += version_bytes(plan.update, param_bytes=stage.param_bytes, stage=stage.index,
                                                stages=len(plan.stages))
