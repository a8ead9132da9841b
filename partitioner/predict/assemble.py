"""Placement -> Plan: the one function that counts a stage's numbers, for every planner.

The chain, branch and hybrid planners decide only where nodes go (which nodes form each
stage, on which device, run by which ranks). `assemble` turns that into a Plan: per-stage
times and bytes by one set of rules, the per-rank programs of the schedule, and the
simulator's predicted times of every op, all-reduces included. `finish` lowers and
simulates an existing plan again (other weight groups, micro-batches or schedule).

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

from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

import networkx as nx
import torch

from cost_model.interface import CostModel, forward_time
from cost_model.memory import StageMemory, stage_memory
from cost_model.recompute_cost import ModeCost, graph_nodes, recompute_costs
from cost_model.update_cost import version_bytes
from partitioner.errors import PartitionError
from partitioner.predict.simulator import (
    group_price,
    in_flight,
    message_price,
    replica_groups,
    simulate,
    steady_step_ms,
)
from partitioner.predict.timeline import Timeline
from runtime.plan import RECOMPUTE_MODES, Placement, Plan, RecomputeMode, Schedule, StagePlan
from runtime.program import Program, plan_programs

__all__ = [
    "Groups", "allreduce_seconds", "assemble", "device_key", "finish", "lower_plan", "merge_groups", "predict",
    "recompute_memory", "price_update", "recount", "stage_edges",
]

Groups = Sequence[tuple[Sequence[int], Sequence[int]]]  # (ranks, stages) of weights held by several ranks


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
        schedule: "gpipe", "1f1b", "interleaved" (stages round robin over the ranks), "zb1" or
            "zbv" (zero-bubble; zbv: stages in a V over the ranks, see runtime.schedule).
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
    stages, message = _count(graph, stage_nodes, [str(torch.device(d)) for d in stage_devices], ranks, device_of, cost)
    for stage, mode in zip(stages, modes):
        if mode != "none":
            _set_mode(stage, mode, _mode_costs(graph, stage.nodes, _replica_devices(cost, stage, device_of), cost))
    for stage, capacity in zip(stages, capacity_bytes or [None] * p):
        stage.capacity_bytes = capacity
    per_rank = max(sum(r in rs for rs in ranks) for r in device_of)
    plan = Plan(stages=stages, micro_batches=micro_batches, schedule=schedule, placement=placement,
                virtual_stages=per_rank if schedule in ("interleaved", "zbv", "dualpipev") else 1)
    weights = _weight_groups(graph, plan) if groups is None else []
    reduce_ms = {tuple(sorted(set(s.ranks))): s.allreduce_ms for s in plan.stages if len(set(s.ranks)) > 1}
    for group_ranks, _, nbytes in weights:
        key = tuple(sorted(set(group_ranks)))
        reduce_ms[key] = reduce_ms.get(key, 0.0) + 1e3 * allreduce_seconds(cost, nbytes, [device_of[r] for r in key])
    chosen = [*replica_groups(plan), *((r, st) for r, st, _ in weights)] if groups is None else groups
    plan.programs = lower_plan(plan, merge_groups(chosen), {r: str(d) for r, d in device_of.items()})
    for stage, flight in zip(plan.stages, in_flight(plan.programs, p)):
        costs = _mode_costs(graph, stage.nodes, [torch.device(stage.device)], cost, timed=False)
        memory = _stage_memory(graph, plan, stage, costs[stage.recompute], flight, optimizer)
        stage.activation_bytes, stage.memory_bytes = memory.activations, memory.total
    predict(plan, lambda src, dst, nbytes: message.get((src, dst), 0.0), group_price(plan, [], reduce_ms, None))
    return plan


def _count(
    graph: nx.DiGraph, stage_nodes: Sequence[Sequence[str]], stage_devices: Sequence[str], ranks: list[list[int]],
    device_of: Mapping[int, torch.device], cost: CostModel,
) -> tuple[list[StagePlan], dict[tuple[int, int], float]]:
    """Each stage's times and bytes (memory aside), and the ms of one message per (src, dst) stage."""
    devices = [list(dict.fromkeys(device_of[r] for r in rs)) for rs in ranks]
    edges = stage_edges(graph, stage_nodes)
    message = {(a, b): _message_ms(cost, nbytes, devices[a], devices[b]) for (a, b), nbytes in edges.items()}
    message.update({(b, a): _message_ms(cost, nbytes, devices[b], devices[a]) for (a, b), nbytes in edges.items()})
    params = _param_bytes(graph, stage_nodes)
    stages = []
    for s, names in enumerate(stage_nodes):
        same = {device_key(cost, d): d for d in devices[s]}  # replicas on devices of equal rates: time one
        compute, fwd = max(_times(graph, names, d, cost) for d in same.values())
        comm = sum(t for (a, b), t in message.items() if s in (a, b))
        reduce = allreduce_seconds(cost, params[s], [device_of[r] for r in ranks[s]]) * 1e3
        stages.append(StagePlan(
            index=s, device=stage_devices[s], nodes=list(names), predicted_ms=(compute + comm) / len(ranks[s]),
            compute_ms=compute, forward_ms=fwd, backward_ms=compute - fwd, comm_ms=comm, allreduce_ms=reduce,
            param_bytes=params[s], recv_bytes=sum(n for (a, b), n in edges.items() if b == s),
            send_bytes=sum(n for (a, b), n in edges.items() if a == s), ranks=ranks[s],
            reads_from=sorted(a for a, b in edges if b == s),
        ))
    return stages, message


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
    for stage, mode, (costs, held) in zip(plan.stages, modes, _by_mode(plan, graph, cost)):
        _set_mode(stage, mode, costs)
        if stage.memory_bytes:
            stage.memory_bytes += held[mode] - stage.activation_bytes
        stage.activation_bytes = held[mode]


def recompute_memory(plan: Plan, graph: nx.DiGraph, cost: CostModel) -> list[dict[str, int]]:
    """Each stage's predicted `memory_bytes` under each recomputation mode (what `recount` would make it)."""
    return [{m: s.memory_bytes - s.activation_bytes + h for m, h in held.items()}
            for s, (_, held) in zip(plan.stages, _by_mode(plan, graph, cost))]


def _by_mode(plan: Plan, graph: nx.DiGraph, cost: CostModel) -> list[tuple[dict[str, ModeCost], dict[str, int]]]:
    """Per stage: each mode's ModeCost, and the activation bytes it holds at its peak (received values included)."""
    devices = {prog.rank: torch.device(prog.device) for prog in plan.programs}
    flights = in_flight(plan.programs, len(plan.stages)) if plan.programs else [plan.micro_batches] * len(plan.stages)
    found = []
    for stage, flight in zip(plan.stages, flights):
        costs = _mode_costs(graph, stage.nodes, _replica_devices(cost, stage, devices), cost)
        found.append((costs, {m: _stage_memory(graph, plan, stage, c, flight).activations for m, c in costs.items()}))
    return found


def _stage_memory(graph: nx.DiGraph, plan: Plan, stage: StagePlan, costs: ModeCost, flight: int,
                  optimizer: str = "adam") -> StageMemory:
    """cost_model.memory.stage_memory of a placed stage: `flight` micro-batches in flight, `costs` its mode's
    bytes; the last stage holds the model output it returns (and its loss) where other stages hold their sends."""
    last = stage.index == len(plan.stages) - 1
    names = set(stage.nodes)
    out = sum(int(graph.nodes[u].get("out_bytes", 0) or 0) for n, a in graph.nodes(data=True) if a.get("op") == "output"
              for u in graph.predecessors(n) if u in names) if last else stage.send_bytes
    return stage_memory(stage.param_bytes, costs.kept_bytes, stage=stage.index, stages=len(plan.stages),
                        micro_batches=plan.micro_batches, optimizer=optimizer, recv_bytes=stage.recv_bytes,
                        send_bytes=out, peak_bytes=costs.peak_bytes, flight=flight, last=last)


def _set_mode(stage: StagePlan, mode: RecomputeMode, costs: Mapping[str, ModeCost]) -> None:
    """Move the forward a stage runs again from its old mode's backward to `mode`'s."""
    extra = 1e3 * (costs[mode].extra_forward_s - costs[stage.recompute].extra_forward_s)
    stage.recompute = mode
    stage.compute_ms += extra
    stage.backward_ms += extra
    stage.predicted_ms = (stage.compute_ms + stage.comm_ms) / stage.replicas


def _replica_devices(cost: CostModel, stage: StagePlan, device_of: Mapping[int, torch.device]) -> list[torch.device]:
    """One device of each rate among the stage's replicas (its own device where ranks are unknown)."""
    found = [device_of[r] for r in stage.ranks if r in device_of] or [torch.device(stage.device)]
    return list({device_key(cost, d): d for d in found}.values())


def _mode_costs(graph: nx.DiGraph, names: Sequence[str], devices: Sequence[torch.device], cost: CostModel | None,
                timed: bool = True) -> dict[str, ModeCost]:
    """cost_model.recompute_cost for a stage: bytes kept, and its slowest replica's forward run again
    (untimed, or without devices: bytes only, as on the CPU)."""
    found: list[dict[str, ModeCost]] = []
    for device in devices or [torch.device("cpu")]:
        timer = cost if timed else None
        nodes = [{**node, "forward_s": forward_time(timer, graph.nodes[n], device) if timer is not None else 0.0}
                 for n, node in zip(names, graph_nodes(graph, names))]
        found.append(recompute_costs(nodes, device.type))
    return {m: replace(found[0][m], extra_forward_s=max(c[m].extra_forward_s for c in found)) for m in found[0]}


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
    old programs recorded (see partitioner.predict.simulator), unless `transfer_ms` ((src stage, dst
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
    devices = {r: s.device for s in plan.stages for r in s.ranks or [s.index]}
    runs = {r: {s.index for s in plan.stages if r in (s.ranks or [s.index])} for r in devices}
    for prog in old:  # a rank that runs what it ran keeps its own device (replicas may differ from the stage's)
        if runs.get(prog.rank, set()) == {op.stage for op in prog.ops if op.is_compute}:
            devices[prog.rank] = prog.device
    if groups is None:
        groups = _reduced(plan) if old else replica_groups(plan)
    plan.programs = lower_plan(plan, merge_groups(groups), devices)
    if before is not None:
        for stage, was, now in zip(plan.stages, before, in_flight(plan.programs, len(plan.stages))):
            if graph is not None:  # the static terms cancel: only what the flight changes moves
                costs = _mode_costs(graph, stage.nodes, [], None, timed=False)[stage.recompute]
                old_mem, new_mem = (_stage_memory(graph, plan, stage, costs, f) for f in (was, now))
                stage.activation_bytes += new_mem.activations - old_mem.activations
                moved = new_mem.activations + new_mem.buffers - old_mem.activations - old_mem.buffers
                stage.memory_bytes += moved if stage.memory_bytes else 0
            elif was > 0:
                grown = stage.activation_bytes // was * now - stage.activation_bytes
                stage.activation_bytes += grown
                stage.memory_bytes += grown if stage.memory_bytes else 0
    return predict(plan, lambda src, dst, nbytes: message(src, dst), price)


def stage_edges(graph: nx.DiGraph, stage_nodes: Sequence[Sequence[str]]) -> dict[tuple[int, int], int]:
    """Bytes per micro-batch each stage reads from each earlier one: {(producer, reader): bytes}.

    Raises:
        PartitionError: a stage reads a value made by a later stage.
    """
    stage_of = {n: s for s, names in enumerate(stage_nodes) for n in names}
    last = len(stage_nodes) - 1
    edges: dict[tuple[int, int], int] = {}
    seen: set[tuple[str, int]] = set()

    def read(value: str, reader: int) -> None:
        producer = stage_of.get(value)
        if producer is None or producer == reader or (value, reader) in seen:
            return
        if producer > reader:
            raise PartitionError(f"stage {reader} reads {value!r} made by the later stage {producer}; "
                                 "number stages in topological order")
        seen.add((value, reader))
        edges[(producer, reader)] = edges.get((producer, reader), 0) + int(graph.nodes[value].get("out_bytes", 0) or 0)

    for s, names in enumerate(stage_nodes):
        for n in names:
            for u in graph.predecessors(n):
                read(u, s)
    for n, attrs in graph.nodes(data=True):
        if attrs.get("op") == "output":
            for u in graph.predecessors(n):
                read(u, last)
    return edges


def merge_groups(groups: Groups) -> list[tuple[list[int], list[int]]]:
    """One group per set of ranks (the runtime all-reduces the weights held by exactly those ranks together)."""
    merged: dict[tuple[int, ...], set[int]] = {}
    for ranks, stages in groups:
        key = tuple(sorted(set(ranks)))
        if len(key) > 1:
            merged.setdefault(key, set()).update(stages)
    return [(list(k), sorted(v)) for k, v in sorted(merged.items())]


def allreduce_seconds(cost: Any, nbytes: float, devices: Sequence[torch.device]) -> float:
    """All-reduce of `nbytes` over `devices`: the cost model's `allreduce_time`, else a ring of its transfers.

    The ring: 2 (n - 1) steps, each moving nbytes / n over every hop, paced by the slowest hop.
    """
    n = len(devices)
    if n < 2 or nbytes <= 0:
        return 0.0
    method = getattr(cost, "allreduce_time", None)
    if callable(method):
        return float(method(nbytes, list(devices)))
    hop = max(cost.transfer_time(nbytes / n, devices[i], devices[(i + 1) % n]) for i in range(n))
    return 2 * (n - 1) * float(hop)


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


def device_key(cost: Any, device: torch.device) -> Any:
    """Devices with equal keys take equal node times: the cost model's rates where it has them, else the name."""
    spec = getattr(cost, "spec", None)
    if callable(spec):
        r = spec(device)
        return (r.flops_per_s, r.bytes_per_s, r.op_overhead_s, r.kind or device.type)
    return str(device)


def _times(graph: nx.DiGraph, names: Sequence[str], device: torch.device, cost: CostModel) -> tuple[float, float]:
    """(forward + backward, forward) ms of one micro-batch of `names` on `device`."""
    total = sum(cost.node_time(graph.nodes[n], device) for n in names)
    return float(total) * 1e3, float(sum(forward_time(cost, graph.nodes[n], device) for n in names)) * 1e3


def _message_ms(cost: CostModel, nbytes: int, src: Sequence[torch.device], dst: Sequence[torch.device]) -> float:
    """Ms of one message between two stages: the slowest pair of their replicas' devices."""
    if nbytes <= 0:
        return 0.0
    return 1e3 * max((float(cost.transfer_time(nbytes, a, b)) for a in src for b in dst), default=0.0)


def _param_bytes(graph: nx.DiGraph, stage_nodes: Sequence[Sequence[str]]) -> list[int]:
    """Each stage's weights: its nodes' own, plus each weight node (get_attr) in its first reading stage."""
    stage_of = {n: s for s, names in enumerate(stage_nodes) for n in names}
    out = [int(sum(graph.nodes[n].get("param_bytes", 0) or 0 for n in names)) for names in stage_nodes]
    for n, attrs in graph.nodes(data=True):
        readers = [stage_of[u] for u in graph.successors(n) if u in stage_of]
        if attrs.get("op") == "get_attr" and readers:
            out[min(readers)] += int(attrs.get("param_bytes", 0) or 0)
    return out


def _weight_groups(graph: nx.DiGraph, plan: Plan) -> list[tuple[list[int], list[int], int]]:
    """(ranks, stages, bytes) of each weight node (get_attr) read by stages on several ranks."""
    stage_of = plan.stage_of()
    out = []
    for n, attrs in graph.nodes(data=True):
        stages = sorted({stage_of[u] for u in graph.successors(n) if u in stage_of})
        ranks = sorted({r for s in stages for r in plan.stages[s].ranks})
        if attrs.get("op") == "get_attr" and len(ranks) > 1 and len(stages) > 1 and attrs.get("param_bytes"):
            out.append((ranks, stages, int(attrs["param_bytes"])))
    return out


def _reduced(plan: Plan) -> Groups:
    """(ranks, stages) of the all-reduces the plan's programs already run: each group with the stages on its ranks."""
    groups = sorted({op.group for program in plan.programs for op in program.ops if op.kind == "AR"})
    return [
        (list(g), [s.index for s in plan.stages if set(s.ranks or [s.index]) & set(g)])
        for g in groups
    ]


def lower_plan(plan: Plan, groups: Groups, devices: Mapping[int, str] | None = None) -> list[Program]:
    """`runtime.program.plan_programs`, with a schedule that cannot run this layout as a PartitionError."""
    try:
        return plan_programs(plan, groups, devices=devices)
    except ValueError as exc:
        raise PartitionError(f"the plan cannot run its schedule {plan.schedule!r}: {exc}") from None


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
