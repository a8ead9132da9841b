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
from typing import Any, Sequence

import networkx as nx
import numpy as np

from cost_model.cluster_shape import Cluster, ClusterDeviceSet
from cost_model.collectives import ring_of
from cost_model.interface import CostModel
from cost_model.precision import FP32, MIXED, PURE_BF16, Precision
from partitioner.capture.shardable_groups import Shardable, ShardGroup
from partitioner.errors import PartitionError
from partitioner.place.cluster.candidate import slowest_pair
from partitioner.place.cluster.look import replica_step, second_look
from partitioner.place.cluster.prepare import prepare_search
from partitioner.place.cluster.search import search_cluster
from partitioner.place.cluster.space import Axes, ClusterSolution
from partitioner.place.cluster.stages import price_stages
from partitioner.place.search.axes import Choice, apply_choice, each_choice, search_choices
from partitioner.place.search.graph_costs import per_micro_batch
from partitioner.place.search.infeasible import InfeasibleError
from partitioner.place.search.problem import SearchProblem
from partitioner.place.search.space import ANY, PRICED_ONLY_RECOMPUTE, SearchSpace
from partitioner.place.search.tensor_split import split_graph
from partitioner.predict.assemble import assemble, predict
from partitioner.predict.counting import stage_edges
from partitioner.predict.lowering import lower_plan, replica_groups
from runtime.plan import Plan, RecomputeMode

__all__ = ["EAGER_RANKS", "EAGER_WORK", "cluster_of", "local_device", "plan_on_cluster", "solution_plan"]

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


def plan_on_cluster(
    graph: nx.DiGraph,
    order: Sequence[str],
    cluster: Cluster,
    cost: CostModel,
    *,
    space: SearchSpace = ANY,
    stages: int | None = None,
    replicate: bool = True,
    optimizer: str = "adam",
    headroom: float = 0.9,
    shardable: Shardable | None = None,
) -> tuple[Plan, ClusterSolution]:
    """Plan `order` onto every GPU of `cluster`: tensor degree, stages, replicas and their sharding, micro-batches,
    schedule and rank placement.

    Args:
        graph: annotated for one step's whole batch.
        cost: node times on the cluster's GPU (its device `cuda:0`); links and all-reduces come from `cluster`.
        space: what the search may choose (search/space.py): micro-batch counts (default:
            search.counts.cluster_counts), schedules, tensor degrees and sharding modes (default: every one worth
            trying, cluster/axes.py), the precision states are counted at (its optimizer replaces `optimizer`;
            None: every state at the model's dtype, replicas unsharded, the all-reduce after the backward), and
            the registered search axes (search/axes.py): recomputation "full" searches with every stage
            recomputing its forward in backward (it keeps only its inputs; the forward runs twice), as the final
            plan then runs (`StagePlan.recompute`); "auto" searches both ways and keeps the smaller objective.
        shardable: the model's split groups (partitioner.capture.shardable.find_shardable); None: no layer split.

    Raises:
        InfeasibleError: nothing fits; the message names the memory per GPU needed.
    """
    if space.sequence_parallel:
        raise PartitionError("sequence parallelism is priced for a configuration given whole (cluster/fixed.py); "
                             "the runtime does not run it, so a plan cannot use it: drop sequence_parallel")
    if space.recompute in PRICED_ONLY_RECOMPUTE:
        raise PartitionError(f"recompute={space.recompute!r} (Megatron-LM's or torchtitan's selective recomputation) "
                             "is priced for a configuration given whole (cluster/fixed.py); the runtime does not run "
                             "it: plan with 'none', 'full' or 'auto'")
    optimizer = space.optimizer(optimizer)
    prepared = prepare_search(graph, order, cluster, cost, space, optimizer=optimizer, headroom=headroom,
                              shardable=shardable)
    ms, cuts, nodes = prepared.micro_batches, prepared.cuts, prepared.nodes(graph, order, cost)

    def run(choice: Choice, bound: float) -> tuple[tuple[ClusterSolution, SearchProblem, Axes], float]:
        problem, axes = prepared.priced(choice, nodes)
        solution = search_cluster(problem, cluster, micro_batches=ms, schedules=space.schedules, stages=stages,
                                  replicate=replicate, cuts=cuts, axes=axes, better_than=bound)
        solution = second_look(axes, cluster, solution, prepared.share, space.schedules)
        return (solution, problem, axes), solution.step_s

    try:
        (solution, problem, axes), choice = search_choices(space, run)
    except InfeasibleError as exc:  # under the last choice (full recomputation where it is searched)
        problem, axes = prepared.priced(each_choice(space)[-1], nodes)
        raise _under_others(exc, space.precision, problem, cluster, axes, ms, space.schedules, stages, replicate,
                            cuts) from None
    solution.choice = choice
    made = solution_plan(graph, order, solution, cluster, cost, optimizer=optimizer,
                         capacity=float(problem.capacity[0]), recompute=_recompute(choice), space=axes,
                         groups=prepared.groups.get(solution.tensor, []))
    if space.precision is not None:
        made.precision = space.precision.to_dict()
    apply_choice(made, choice, nodes)
    return made, solution


def _recompute(choice: Choice) -> RecomputeMode:
    """The recomputation of every stage `choice` holds (search/axes.py's "recompute")."""
    return "full" if choice.get("recompute", "none") == "full" else "none"


def _under_others(exc: InfeasibleError, precision: Precision | None, problem: SearchProblem, cluster: Cluster,
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
    return InfeasibleError(str(exc), exc.needed_bytes, note, held=exc.held)


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
            [message.get((s - 1, s), 0.0) for s in range(p)],
            [s.allreduce_ms + s.optimizer_ms for s in plan.stages])  # the optimizer steps after the reduction
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
                 param_bytes=space.degree(t).problem.param_bytes, blocks=blocks, optimizer=optimizer,
                 gradient_sync=space.degree(t).problem.gradient_sync,
                 step_bytes_per_s=space.degree(t).problem.step_bytes_per_s)
    for stage, mode in zip(plan.stages, solution.modes):
        inside = set(stage.nodes)
        stage.tensor, stage.sharding = t, mode  # type: ignore[assignment]
        stage.tensor_groups = [g.spec() for g in groups if inside.issuperset(g.nodes)] if t > 1 else []
