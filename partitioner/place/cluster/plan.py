"""A cluster-scale plan: a traced graph and a Cluster into a count search (cluster/search.py), then a Plan.

The Plan is counted as for every planner (`assemble`), on one pipeline standing for all: with d
replicas and d | m, replica j of every stage takes micro-batches j, j + d, ..., so each replica
runs the same m / d micro-batches of the same program (see partitioner/predict/replica_fold.py). Its
numbers are then priced by where the ranks sit: messages between replica j of neighbouring
stages (the slowest pair), each stage's all-reduce over its ranks (Cluster.allreduce_time).

Stage devices are local names (`cuda:{rank % gpus_per_host}`): torch caps a device index at 127,
and a rank's GPU is its host's local one; `stages[s].ranks` hold the global positions. Plans up to
EAGER_RANKS ranks and EAGER_WORK micro-batches x stages are lowered and simulated here
(partitioner/predict/simulator.py). Larger plans keep `programs` empty and are lowered where they run
(runtime/distributed.py lowers a plan without programs; `simulate(plan)` lowers one replica of each
stage: replica_fold.py), so a 16,384-rank plan is a few hundred KB; their predicted step is replica
0's chain of stages as the runtime orders it, simulated on stage times (`replica_step`, equal to the
program simulator's: tests/test_cluster_search.py), which takes far less than lowering every rank.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, NamedTuple, Sequence

import networkx as nx
import numpy as np
import torch

from cost_model.cluster_shape import Cluster, ClusterDeviceSet
from cost_model.collectives import ring_of
from cost_model.interface import CostModel, forward_time
from cost_model.memory import optimizer_states
from cost_model.precision import FP32, MIXED, PURE_BF16, Precision
from partitioner.capture.shardable_groups import Shardable, ShardGroup
from partitioner.errors import PartitionError
from partitioner.place.cluster.axes import ANY_SPLIT, SplitChoice, cluster_axes, recomputed
from partitioner.place.cluster.look import replica_step, second_look
from partitioner.place.cluster.search import search_cluster, slowest_pair
from partitioner.place.cluster.space import Axes, ClusterSolution, tensor_degrees
from partitioner.place.cluster.stages import price_stages
from partitioner.place.search.blocks import block_cuts
from partitioner.place.search.compare import SCHEDULES
from partitioner.place.search.counts import cluster_counts, given_counts
from partitioner.place.search.graph_costs import batch_size, graph_values, node_times, per_micro_batch
from partitioner.place.search.infeasible import InfeasibleError
from partitioner.place.search.problem import HybridProblem
from partitioner.place.search.tensor_split import split_graph
from partitioner.predict.assemble import assemble, predict
from partitioner.predict.counting import stage_edges
from partitioner.predict.lowering import lower_plan, replica_groups
from rules.segments import segments
from runtime.plan import Plan, RecomputeMode

__all__ = [
    "EAGER_RANKS", "EAGER_WORK", "Prepared", "cluster_of", "cluster_problem", "forward_share", "local_device",
    "plan_on_cluster", "prepare_search", "recomputing", "replica_step", "second_look", "solution_plan",
]

EAGER_RANKS = 512  # plans on more ranks keep `programs` empty (lowered where they run)
EAGER_WORK = 20_000  # ... and plans of more micro-batches x stages


def cluster_of(cost: Any) -> Cluster | None:
    """The Cluster a cost model prices (AnalyticCostModel over a ClusterDeviceSet, possibly wrapped), or None."""
    for model in (cost, getattr(cost, "base", None), getattr(cost, "fallback", None)):
        devices = getattr(model, "device_set", None)
        if isinstance(devices, ClusterDeviceSet):
            return devices.cluster
    return None


def local_device(cluster: Cluster, rank: int) -> str:
    """The torch name of `rank`'s GPU on its own host."""
    return f"cuda:{rank % cluster.gpus_per_host}"


def cluster_problem(
    graph: nx.DiGraph, order: Sequence[str], device: torch.device, cost: CostModel, micro_batches: Sequence[int],
    *, optimizer: str = "adam", headroom: float = 0.9,
) -> HybridProblem:
    """The node arrays of a HybridProblem (search/problem.py) for one GPU type (no per-device arrays: the
    search prices links by rank), node times asked at each micro-batch size `micro_batches` make."""
    size = batch_size(graph)
    probes: set[int] = set()
    if size is not None and size > 1:
        probes = {size, size // 2}
        for m in micro_batches:
            low, extra = divmod(size, m)
            probes |= {low, low + 1} if extra else {low}
    fixed, batch, size_times = node_times(graph, order, [device], cost, probes)
    producers, consumers, sizes, params, saved = graph_values(graph, order)
    spec = getattr(cost, "spec", None)
    memory = headroom * float(spec(device).memory_bytes) if callable(spec) else 0.0
    try:
        states = optimizer_states(optimizer)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    return HybridProblem(
        fixed, batch, np.zeros(1, dtype=np.int64), np.array(producers, dtype=np.int64), consumers, np.array(sizes),
        params, saved, np.zeros((1, 1, 2)), np.zeros((1, 2, 2)), np.array([memory if memory > 0 else np.inf]), states,
        size, [str(device)], np.array([float(graph.nodes[x].get("out_bytes", 0) or 0) for x in order]),
        size_times or None,
    )


def plan_on_cluster(
    graph: nx.DiGraph,
    order: Sequence[str],
    cluster: Cluster,
    cost: CostModel,
    *,
    micro_batches: int | Sequence[int] | None = None,
    schedules: Sequence[str] = SCHEDULES,
    stages: int | None = None,
    replicate: bool = True,
    optimizer: str = "adam",
    headroom: float = 0.9,
    recompute: Literal["none", "full", "auto"] = "none",
    precision: Precision | None = None,
    shardable: Shardable | None = None,
    choice: SplitChoice = ANY_SPLIT,
) -> tuple[Plan, ClusterSolution]:
    """Plan `order` onto every GPU of `cluster`: tensor degree, stages, replicas and their sharding, micro-batches,
    schedule and rank placement.

    Args:
        graph: annotated for one step's whole batch.
        cost: node times on the cluster's GPU (its device `cuda:0`); links and all-reduces come from `cluster`.
        micro_batches: the count, or candidates (default: search.counts.cluster_counts).
        recompute: "full" searches with every stage recomputing its forward in backward (it keeps only its
            inputs; the forward runs twice), as the final plan then runs (`StagePlan.recompute`);
            "auto" searches both ways and keeps the one whose search objective is smaller (full recomputation
            where nothing fits without it, or where it lets a faster configuration fit).
        precision: the dtypes training keeps each state in (and its optimizer: it replaces `optimizer`);
            None: every state at the model's dtype, replicas unsharded, the all-reduce after the backward.
        shardable: the model's split groups (partitioner.capture.shardable.find_shardable); None: no layer split.
        choice: tensor degrees and sharding modes allowed (default: every one worth trying, cluster/axes.py).

    Raises:
        InfeasibleError: nothing fits; the message names the memory per GPU needed.
    """
    if recompute not in ("none", "full", "auto"):
        raise PartitionError(f"recompute={recompute!r}; use 'none', 'full' or 'auto'")
    if choice.sequence_parallel:
        raise PartitionError("sequence parallelism is priced for a configuration given whole (cluster/fixed.py); "
                             "the runtime does not run it, so a plan cannot use it: drop sequence_parallel")
    if precision is not None:
        optimizer = precision.optimizer
    ms, cuts, plain, share, axes, groups, segment = prepare_search(
        graph, order, cluster, cost, micro_batches, optimizer=optimizer, headroom=headroom, precision=precision,
        shardable=shardable, choice=choice)
    best: tuple[ClusterSolution, RecomputeMode, HybridProblem, Axes] | None = None
    for mode in ("none", "full") if recompute == "auto" else (recompute,):
        problem = plain if mode == "none" else recomputing(plain, share, segment)
        space = axes if mode == "none" else recomputed(axes, lambda x: recomputing(x, share, segment))
        try:
            solution = search_cluster(problem, cluster, micro_batches=ms, schedules=schedules, stages=stages,
                                      replicate=replicate, cuts=cuts, axes=space,
                                      better_than=best[0].step_s if best is not None else math.inf)
        except InfeasibleError as exc:
            if best is None and (mode == "full" or recompute != "auto"):
                raise _under_others(exc, precision, problem, cluster, space, ms, schedules, stages, replicate,
                                    cuts) from None
            continue
        solution = second_look(space, cluster, solution, share, schedules)
        if best is None or solution.step_s < best[0].step_s:
            best = (solution, mode, problem, space)
    if best is None:
        raise AssertionError("unreachable: the last mode raises or returns")
    solution, mode, problem, space = best
    made = solution_plan(graph, order, solution, cluster, cost, optimizer=optimizer,
                         capacity=float(problem.capacity[0]), recompute=mode, space=space,
                         groups=groups.get(solution.tensor, []))
    if precision is not None:
        made.precision = precision.to_dict()
    return made, solution


class Prepared(NamedTuple):
    """What a cluster search of one graph needs: micro-batch counts, cut candidates, the node arrays, each node's
    forward share, the axes (tensor degrees with their problems, sharding modes) and each degree's split groups."""

    micro_batches: list[int]
    cuts: np.ndarray | None
    plain: HybridProblem
    share: np.ndarray
    axes: Axes
    groups: dict[int, list[ShardGroup]]
    segment: np.ndarray  # [n] each node's recomputation segment (rules.segments), for `recomputing`


def prepare_search(
    graph: nx.DiGraph, order: Sequence[str], cluster: Cluster, cost: CostModel,
    micro_batches: int | Sequence[int] | None, *, optimizer: str = "adam", headroom: float = 0.9,
    precision: Precision | None = None, shardable: Shardable | None = None, choice: SplitChoice = ANY_SPLIT,
) -> Prepared:
    """The inputs of `search_cluster` for `order` on `cluster` (plan_on_cluster's arguments).

    Raises:
        PartitionError: micro-batch counts that are not positive integers, or axes the model cannot take.
    """
    device = torch.device("cuda:0")
    cuts = block_cuts([str(graph.nodes[x].get("module", "") or "") for x in order])
    limit = min(len(order), len(cuts) - 1 if cuts is not None else len(order))
    degrees = _degrees(cluster, shardable, choice)
    if micro_batches is None:
        ms = sorted({m for t in degrees for m in cluster_counts(cluster.size // t, batch_size(graph), limit)})
    else:
        ms = sorted(given_counts(micro_batches))
    ds = {cluster.size // t // p for t in degrees for p in range(1, limit + 1) if cluster.size % (t * p) == 0}
    ms = [m for m in ms if any(m % d == 0 for d in ds)] or ms  # counts no replica count divides are never tried
    plain = cluster_problem(graph, order, device, cost, ms, optimizer=optimizer, headroom=headroom)
    share = forward_share(graph, order, device, cost)
    axes, groups = cluster_axes(graph, order, cluster, cost, plain, share, cuts, precision=precision,
                                shardable=shardable, optimizer=optimizer, choice=choice)
    segment = segments((x, str(graph.nodes[x].get("module", "") or "")) for x in order)
    return Prepared(ms, cuts, plain, share, axes, groups, np.array([segment[x] for x in order], dtype=np.int64))


def _under_others(exc: InfeasibleError, precision: Precision | None, problem: HybridProblem, cluster: Cluster,
                  space: Axes, ms: Sequence[int], schedules: Sequence[str], stages: int | None, replicate: bool,
                  cuts: np.ndarray | None) -> InfeasibleError:
    """`exc`, saying under which other training precisions (cost_model.precision: pure bf16, fp32) it would fit."""
    if precision is None or space.rule is None:
        return exc
    fits = []
    for other in (PURE_BF16, MIXED, FP32):
        if other.label == precision.label:
            continue
        rule = dataclasses.replace(space.rule, precision=dataclasses.replace(other, optimizer=precision.optimizer))
        try:
            found = search_cluster(problem, cluster, micro_batches=ms, schedules=schedules, stages=stages,
                                   replicate=replicate, cuts=cuts, axes=dataclasses.replace(space, rule=rule))
        except InfeasibleError:
            continue
        fits.append(f"{other.label} ({found.stages} stages x {found.replicas} replicas"
                    + (f" x tensor {found.tensor}" if found.tensor > 1 else "")
                    + (f", {found.sharding}" if found.sharding != "none" else "") + ")")
    if not fits:
        return exc
    note = (f"Under {precision.label} nothing fits; under " + " or ".join(fits) + " it would (precision=...).")
    return InfeasibleError(str(exc), exc.needed_bytes, note)


def _degrees(cluster: Cluster, shardable: Shardable | None, choice: SplitChoice) -> list[int]:
    """The tensor degrees the search may try (cluster_axes checks them against the model)."""
    if choice.tensor is not None:
        return sorted(set(choice.tensor)) or [1]
    if shardable is None:
        return [1]
    legal = {t for g in shardable.groups for t in g.degrees}
    return tensor_degrees(cluster.size, cluster.gpus_per_host, sorted(legal))


def recomputing(problem: HybridProblem, share: np.ndarray, segment: np.ndarray | None = None) -> HybridProblem:
    """`problem` as full recomputation runs it: every node's forward once more in backward (its time x (1 +
    forward share)), and kept per micro-batch only the stage inputs (the receive bytes the search counts anyway)
    and, with `segment` (each node's recomputation segment, rules.segments), each checkpoint's input: a value a
    later segment reads. One micro-batch's backward also holds its segment's recomputed activations
    (cost_model.recompute_cost's walk): added to each node's output bytes / 3, so the backward working set the
    search counts (search.stage_costs.stage_parts: 3 x the stage's largest output) holds the stage's largest segment."""
    grow = 1.0 + share
    saved, out = np.zeros(problem.n), problem.out_bytes
    if segment is not None:
        for v, at in enumerate(problem.producers):
            if at >= 0 and any(c < problem.n and segment[c] > segment[at] for c in problem.consumers[v]):
                saved[at] += problem.value_bytes[v]  # a checkpoint's input: kept until its segment's backward
        if out is not None:
            out = out + np.bincount(segment, weights=problem.saved_bytes, minlength=int(segment.max()) + 1)[
                segment] / 3
    return dataclasses.replace(
        problem, saved_bytes=saved, out_bytes=out, fixed_times=problem.fixed_times * grow,
        batch_times=problem.batch_times * grow,
        size_times={k: v * grow for k, v in problem.size_times.items()} if problem.size_times else None)


def forward_share(graph: nx.DiGraph, order: Sequence[str], device: torch.device, cost: CostModel) -> np.ndarray:
    """[n] the forward's fraction of each node's forward + backward time (whole batch)."""
    out = np.full(len(order), 1 / 3)
    for i, name in enumerate(order):
        whole = cost.node_time(graph.nodes[name], device)
        if whole > 0:
            out[i] = forward_time(cost, graph.nodes[name], device) / whole
    return out


def solution_plan(
    graph: nx.DiGraph, order: Sequence[str], solution: ClusterSolution, cluster: Cluster, cost: CostModel, *,
    optimizer: str = "adam", capacity: float = float("inf"), recompute: RecomputeMode = "none",
    space: Axes | None = None, groups: Sequence[ShardGroup] = (),
) -> Plan:
    """The Plan of a cluster solution (module docstring): one pipeline assembled, then priced by its ranks.

    With a tensor degree t > 1 or sharded replicas (or a precision in `space`), each stage's numbers are
    cluster.stages.price_stages': stage `ranks` are each replica's first rank, `tensor` and `tensor_groups`
    (`groups` within the stage) say what its t ranks split, `sharding` how its replicas shard
    (each stage's mode: solution.modes), and a plan with a sharded stage slices every micro-batch over the
    replicas (data_split "slice": m / d micro-batches).
    Such plans keep `programs` empty (lowered where they run) and predict replica 0's pipeline.
    """
    p, d, m = solution.stages, solution.replicas, solution.micro_batches
    t, modes = solution.tensor, solution.modes
    if m % d:
        raise PartitionError(f"{m} micro-batches over {d} replicas: the cluster plan needs d | m")
    rule = space.rule if space is not None else None
    sharded = any(mode != "none" for mode in modes)
    split = t > 1 or sharded or (rule is not None and rule.precision is not None)
    bounds = solution.bounds
    stage_nodes = [list(order[a:b]) for a, b in zip(bounds, bounds[1:])]
    graph_mb = per_micro_batch(split_graph(graph, groups, t) if t > 1 else graph, m)
    cap = int(capacity) if np.isfinite(capacity) else None
    plan = assemble(graph_mb, stage_nodes, ["cuda:0"] * p, cost, micro_batches=m // d,
                    schedule=solution.schedule,
                    stage_ranks=[[s] for s in range(p)], placement="hybrid", groups=[], optimizer=optimizer,
                    capacity_bytes=[cap] * p, recompute=[recompute] * p)
    ranks = solution.ranks  # one pipeline of m / d micro-batches holds what each replica holds in flight
    message: dict[tuple[int, int], float] = {}
    for (a, b), nbytes in stage_edges(graph_mb, stage_nodes).items():
        if nbytes > 0:
            src, dst = slowest_pair(cluster, ranks[a], ranks[b])
            message[(a, b)] = message[(b, a)] = 1e3 * cluster.transfer_time(nbytes, src, dst)
    reduce: dict[tuple[int, ...], float] = {}
    for stage in plan.stages:
        s = stage.index
        stage.ranks = list(ranks[s])
        stage.device = local_device(cluster, ranks[s][0])
        stage.comm_ms = sum(t for (a, b), t in message.items() if s in (a, b))
        stage.allreduce_ms = 1e3 * cluster.allreduce_time(stage.param_bytes, stage.ranks) if d > 1 else 0.0
        stage.predicted_ms = (stage.compute_ms + stage.comm_ms) / d
        reduce[tuple(sorted(stage.ranks))] = stage.allreduce_ms
    if split and space is not None and rule is not None:
        _split_stages(plan, graph, order, solution, space, groups, cluster, optimizer)
    plan.micro_batches, plan.gpus_per_host, plan.programs = m, cluster.gpus_per_host, []
    plan.alternatives = {name: 1e3 * s for name, s in sorted(solution.tried.items(), key=lambda kv: kv[1])[:8]}
    if split or cluster.size > EAGER_RANKS or m * p > EAGER_WORK:  # replica 0's pipeline in the runtime's order
        plan.predicted_step_ms = replica_step(
            plan.schedule, m, d, [s.forward_ms for s in plan.stages], [s.backward_ms for s in plan.stages],
            [message.get((s - 1, s), 0.0) for s in range(p)], [s.allreduce_ms for s in plan.stages])
        if sharded:
            plan.micro_batches, plan.data_split = m // d, "slice"
        return plan
    devices = {r: local_device(cluster, r) for rs in ranks for r in rs}
    plan.programs = lower_plan(plan, replica_groups(plan), devices)
    predict(plan, lambda src, dst, nbytes: message.get((src, dst), 0.0),
            lambda group: reduce.get(tuple(sorted(group)), 0.0))
    return plan


def _split_stages(plan: Plan, graph: nx.DiGraph, order: Sequence[str], solution: ClusterSolution, space: Axes,
                  groups: Sequence[ShardGroup], cluster: Cluster, optimizer: str) -> None:
    """A solution's stages as its tensor ranks and sharded replicas run them (cluster.stages.price_stages)."""
    t, rule = solution.tensor, space.rule
    if rule is None:
        raise PartitionError("a split or sharded cluster plan needs the search's StateRule (cluster/axes.py)")
    blocks = space.blocks if space.blocks is not None else np.full(len(order), -1)
    price_stages(plan, graph, solution.bounds, micro_batches=solution.micro_batches, groups=groups,
                 tensor_ring=ring_of(cluster, range(t)), rule=rule, sharding=solution.modes,
                 rings=[ring_of(cluster, stage.ranks) for stage in plan.stages],
                 param_bytes=space.degree(t).problem.param_bytes, blocks=blocks, optimizer=optimizer)
    for stage, mode in zip(plan.stages, solution.modes):
        inside = set(stage.nodes)
        stage.tensor, stage.sharding = t, mode  # type: ignore[assignment]
        stage.tensor_groups = [g.spec() for g in groups if inside.issuperset(g.nodes)] if t > 1 else []
