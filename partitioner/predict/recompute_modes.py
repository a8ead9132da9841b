"""A placed stage's activation recomputation: the forward each mode runs again and the bytes each holds.

cost_model/recompute_cost.py prices a stage's nodes under each mode; this module applies it to
a stage of a Plan (its replicas' devices, the micro-batches in flight under the plan's programs,
cost_model/memory.py's count of what it holds). `assemble.recount` sets the modes of a plan.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

import networkx as nx
import torch

from cost_model.interface import CostModel, forward_time
from cost_model.memory import StageMemory, stage_memory
from cost_model.recompute_cost import ModeCost, graph_nodes, recompute_costs
from partitioner.predict.counting import device_key, output_bytes
from partitioner.predict.program_run import in_flight
from runtime.plan import Plan, RecomputeMode, StagePlan

__all__ = ["by_mode", "held_micro_batches", "mode_costs", "placed_memory", "replica_devices", "set_mode"]


def by_mode(plan: Plan, graph: nx.DiGraph, cost: CostModel) -> list[tuple[dict[str, ModeCost], dict[str, int]]]:
    """Per stage: each mode's ModeCost, and the activation bytes it holds at its peak (received values included)."""
    devices = {prog.rank: torch.device(prog.device) for prog in plan.programs}
    flights = in_flight(plan.programs, len(plan.stages)) if plan.programs else held_micro_batches(plan)
    found = []
    for stage, flight in zip(plan.stages, flights):
        costs = mode_costs(graph, stage.nodes, replica_devices(cost, stage, devices), cost)
        found.append((costs, {m: placed_memory(graph, plan, stage, c, flight).activations for m, c in costs.items()}))
    return found


def held_micro_batches(plan: Plan) -> list[int]:
    """Micro-batches each stage's replica holds at once where the plan has no programs to count them from (a cluster
    plan that splits or shards): its own share of the step's (`Plan.pieces` over its replicas, not every replica's),
    all of them under GPipe, at most the stages from it to the last under 1F1B."""
    p = len(plan.stages)
    out = []
    for stage in plan.stages:
        mine = max(1, plan.pieces // stage.replicas)
        out.append(min(mine, p - stage.index) if plan.schedule == "1f1b" else mine)
    return out


def placed_memory(graph: nx.DiGraph, plan: Plan, stage: StagePlan, costs: ModeCost, flight: int,
                  optimizer: str = "adam") -> StageMemory:
    """cost_model.memory.stage_memory of a placed stage: `flight` micro-batches in flight, `costs` its mode's
    bytes; the last stage holds the model output it returns (and its loss) where other stages hold their sends."""
    last = stage.index == len(plan.stages) - 1
    out = output_bytes(graph, set(stage.nodes)) if last else stage.send_bytes
    return stage_memory(stage.param_bytes, costs.kept_bytes, stage=stage.index, stages=len(plan.stages),
                        micro_batches=plan.micro_batches, optimizer=optimizer, recv_bytes=stage.recv_bytes,
                        send_bytes=out, peak_bytes=costs.peak_bytes, flight=flight, last=last)


def set_mode(stage: StagePlan, mode: RecomputeMode, costs: Mapping[str, ModeCost]) -> None:
    """Move the forward a stage runs again from its old mode's backward to `mode`'s."""
    extra = 1e3 * (costs[mode].extra_forward_s - costs[stage.recompute].extra_forward_s)
    stage.recompute = mode
    stage.compute_ms += extra
    stage.backward_ms += extra
    stage.predicted_ms = (stage.compute_ms + stage.comm_ms) / stage.replicas


def replica_devices(cost: CostModel, stage: StagePlan, device_of: Mapping[int, torch.device]) -> list[torch.device]:
    """One device of each rate among the stage's replicas (its own device where ranks are unknown)."""
    found = [device_of[r] for r in stage.ranks if r in device_of] or [torch.device(stage.device)]
    return list({device_key(cost, d): d for d in found}.values())


def mode_costs(graph: nx.DiGraph, names: Sequence[str], devices: Sequence[torch.device], cost: CostModel | None,
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
