"""A cluster plan's stages as t tensor ranks and d (sharded) replicas run them: their times, reductions and memory.

After `assemble` counted one pipeline on the split graph (search.tensor_split.split_graph: each rank's share of
the split layers), each stage gets what the search priced (search/split_costs.py), so the plan predicts what
was chosen:

    forward_ms, backward_ms   + its groups' collectives (search.tensor_split.collective_seconds: eager DTensor,
                                not overlapped) + FSDP2's gathers per micro-batch (data_parallel.gathers)
    allreduce_ms              the replicas' reduction once a step, what overlap leaves of it
                                (data_parallel.per_step: DDP's buckets, FSDP2's reduce-scatter, zero1's gather)
    optimizer_ms              the optimizer step over the weights one rank steps (its shard where sharded), at
                                HBM bandwidth (cost_model.optimizer_step), once a step after the reduction
    memory_bytes              activations and buffers as assemble counted them, plus each state at its own
                                dtype, / d where the mode shards it (cost_model.training_memory.state_bytes;
                                / d x c with c context ranks a replica, FSDP2's mesh: StateRule.data_group)
    param_bytes               the weights one rank computes with: P elements x the compute dtype's bytes
                                (the model's dtype without a precision)

P is the stage's weights on one tensor rank (`param_bytes` of the split graph / its element size), U its
largest block's (FSDP2's unit), the rest outside blocks the root's.
"""

from __future__ import annotations

from typing import Sequence

import networkx as nx
import numpy as np

from cost_model.collectives import Ring
from cost_model.data_parallel import DataParallelCost
from cost_model.memory import optimizer_states
from cost_model.optimizer_step import step_seconds
from cost_model.training_memory import state_bytes
from partitioner.capture.shardable_groups import ShardGroup
from partitioner.place.search.graph_costs import batch_size
from partitioner.place.search.states import StateRule
from partitioner.place.search.tensor_split import collective_seconds
from rules.sharding import stage_sync
from runtime.plan import Plan

__all__ = ["price_stages", "stage_units"]


def stage_units(param_bytes: np.ndarray, blocks: np.ndarray, a: int, b: int) -> tuple[float, float]:
    """(largest block's, outside blocks') weight bytes of the nodes a..b-1 (a block counted whole)."""
    ids = np.asarray(blocks)
    inside = ids >= 0
    totals = np.bincount(ids[inside], weights=param_bytes[inside]) if inside.any() else np.zeros(0)
    here = ids[a:b]
    unit = float(totals[np.unique(here[here >= 0])].max()) if np.any(here >= 0) else 0.0
    root = float(param_bytes[a:b][here < 0].sum())
    return unit, root


def price_stages(
    plan: Plan, graph: nx.DiGraph, bounds: Sequence[int], *, micro_batches: int, groups: Sequence[ShardGroup],
    tensor_ring: Ring, rule: StateRule, sharding: str | Sequence[str], rings: Sequence[Ring], param_bytes: np.ndarray,
    blocks: np.ndarray, optimizer: str, gradient_sync: str = "last", step_bytes_per_s: float = 0.0,
) -> None:
    """Give each stage of an assembled one-pipeline `plan` its split, sharded numbers (module docstring).

    Args:
        graph: the whole-batch graph (unsplit: collectives read its value bytes).
        bounds: the stage cuts, positions in the node order of `param_bytes` and `blocks`.
        micro_batches: m, micro-batches of the whole step (each of batch / m samples).
        groups: the split groups (all stages'); tensor_ring: one tensor group's all-reduce.
        sharding: the replicas' mode (rules.sharding), one for every stage or each stage's.
        rings: each stage's data-parallel all-reduce (its replicas' first ranks).
        param_bytes, blocks: per node, its weights on one tensor rank and its block (search.blocks.block_ids).
        optimizer: what assemble counted the states with ((2 + its states) x param_bytes).
        gradient_sync: "last" or "every" for the sharded stages (rules.sharding.stage_sync: what each mode runs);
            each stage's `gradient_sync` is set to what it runs.
        step_bytes_per_s: the HBM rate the optimizer step streams at (SearchProblem.step_bytes_per_s; 0: its
            `optimizer_ms` stays 0).
    """
    batch = batch_size(graph)
    size = batch / micro_batches if batch else 1.0
    precision, d = rule.states, len(plan.stages[0].ranks) if plan.stages[0].ranks else 1
    legacy = (2 + optimizer_states(optimizer))
    modes = [sharding] * len(plan.stages) if isinstance(sharding, str) else list(sharding)
    for stage, a, b, mode in zip(plan.stages, bounds, bounds[1:], modes):
        inside = set(stage.nodes)
        forward = backward = 0.0
        for group in groups:
            if inside.issuperset(group.nodes):
                f, bw = collective_seconds(graph, group, tensor_ring, size)
                forward, backward = forward + f, backward + bw + (f if stage.recompute == "full" else 0.0)
        stage.forward_ms += 1e3 * forward
        stage.backward_ms += 1e3 * backward
        unit, root = (x / rule.itemsize for x in stage_units(param_bytes, blocks, a, b))
        params = stage.param_bytes / rule.itemsize
        shards, group_ring = rule.data_group(mode, d, rings[stage.index])  # FSDP2's mesh: + context ranks
        sync = stage_sync(mode, gradient_sync) if shards > 1 else "last"
        stage.gradient_sync = sync
        dp = DataParallelCost(mode, shards, group_ring, precision.itemsize("compute"),
                              precision.itemsize("grad"), overlap=rule.precision is not None, gradient_sync=sync)
        unit = min(unit, params)
        f_s, b_s = stage.forward_ms / 1e3, stage.backward_ms / 1e3
        before, after = dp.gathers(params, unit, f_s, b_s)
        stage.forward_ms += 1e3 * before
        stage.backward_ms += 1e3 * after
        stage.compute_ms = stage.forward_ms + stage.backward_ms
        stage.allreduce_ms = 1e3 * float(dp.per_step(params, unit, f_s, b_s))
        stage.optimizer_ms = 1e3 * float(step_seconds(params, precision, step_bytes_per_s,
                                                      shards=shards if mode != "none" else 1))
        stage.predicted_ms = (stage.compute_ms + stage.comm_ms) / d
        kinds = state_bytes(params, precision, mode=mode, degree=shards, micro_batches=max(1, plan.micro_batches),
                            gradient_sync=sync, root=root, unit=unit)
        if stage.memory_bytes:
            stage.memory_bytes += int(sum(kinds)) - legacy * stage.param_bytes
        stage.param_bytes = int(params * precision.itemsize("compute"))
