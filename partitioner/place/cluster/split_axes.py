"""Expert and context degrees chosen with the cluster search's other axes (search/experts_context.py prices them).

    search_split(graph, order, cluster, cost, facts, ...) -> Split (the solution, its expert and context degrees)

For each context degree c the graph's sequence splits into (1, and those that put a replica's t x c ranks
inside a host or on whole hosts) and each expert degree e its stacks split into (1, and those that divide
the GPUs), the cluster search runs on the cluster as one rank of a context group sees it: `coarse(cluster,
c)`, each of its GPUs c consecutive ranks (a replica's t x c ranks, tensor innermost, as
runtime/plan_axes.py lays them out), so stages, replicas, tensor degree, sharding, micro-batches and cuts are
searched as for any plan, on the problem one rank runs (search.experts_context.split_problem). Replica
counts e does not divide are skipped (Axes.expert), and with e > 1 only "replicas-together" is tried: an
expert group is e consecutive replicas of a stage, its all-to-all priced on their ranks (0, w, .., (e - 1) w,
w = t x c). The smallest objective wins; at a tie the smaller degrees (tried first). A graph with neither
splits nothing here: (1, 1) alone, the search as it was.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import networkx as nx
import numpy as np

from cost_model.all_to_all import all_to_all_affine
from cost_model.cluster_shape import Cluster
from cost_model.collectives import ring_of
from cost_model.interface import CostModel
from cost_model.precision import Precision
from cost_model.training_memory import state_bytes
from partitioner.capture.shardable_groups import Shardable, ShardGroup
from partitioner.place.cluster.axes import param_itemsize
from partitioner.place.cluster.prepare import Prepared, prepare_search
from partitioner.place.cluster.search import search_cluster
from partitioner.place.cluster.space import Axes, ClusterSolution
from partitioner.place.search.axes import Choice, NodeFacts, search_choices
from partitioner.place.search.degrees import Degrees
from partitioner.place.search.experts_context import SplitFacts, split_problem
from partitioner.place.search.infeasible import InfeasibleError
from partitioner.place.search.problem import SearchProblem
from partitioner.place.search.space import SearchSpace

__all__ = ["Split", "coarse", "degree_options", "memory_kinds", "search_split"]


@dataclass
class Split:
    """The cluster search's solution with its expert and context degrees, and what a Plan of it is made from."""

    solution: ClusterSolution  # its ranks on `view`: rank r there is ranks r x context .. of the real cluster
    expert: int
    context: int
    choice: Choice
    tried: dict[tuple[int, int], float]  # (expert, context) -> objective (s), inf where nothing fit
    kinds: list[dict[str, float]]  # per stage, bytes per GPU by kind (weights, grads, master, optimizer, activations)
    view: Cluster  # coarse(cluster, context)
    axes: Axes  # the winning search's axes, each degree's problem as one rank runs it (split_problem)
    plain: SearchProblem  # the chosen tensor degree's problem before split_problem (the Plan's numbers are its)
    groups: list[ShardGroup]  # the tensor groups the chosen degree splits

    @property
    def ranks(self) -> list[list[int]]:
        """Each stage's replicas' first ranks on the real cluster."""
        return [[r * self.context for r in replicas] for replicas in self.solution.ranks]


def coarse(cluster: Cluster, context: int) -> Cluster:
    """`cluster` with each group of `context` consecutive ranks as one GPU (inside a host, or whole hosts)."""
    if context == 1:
        return cluster
    g = cluster.gpus_per_host
    if g % context == 0:
        return dataclasses.replace(cluster, gpus_per_host=g // context)
    if context % g == 0 and cluster.hosts % (context // g) == 0:
        return dataclasses.replace(cluster, hosts=cluster.hosts // (context // g), gpus_per_host=1)
    raise ValueError(f"context={context} on {cluster.shape}: use a divisor or a multiple of {g} GPUs per host")


def degree_options(facts: SplitFacts, cluster: Cluster, *, expert: int | None = None,
                   context: int | None = None, most: int = 64) -> tuple[list[int], list[int]]:
    """(expert degrees, context degrees) worth searching on `cluster`: 1, and the finders' degrees that fit
    (up to `most`); `expert`/`context` given: that one alone."""
    g, size = cluster.gpus_per_host, cluster.size
    es = [e for e in facts.expert_degrees if e <= most and size % e == 0] if facts.has_experts else [1]
    cs = [c for c in facts.context_degrees if c <= most and size % c == 0
          and (g % c == 0 or (c % g == 0 and cluster.hosts % (c // g) == 0))] if facts.has_context else [1]
    if expert is not None:
        es = [expert]
    if context is not None:
        cs = [context]
    return sorted(set(es) | ({1} if expert is None else set())), sorted(set(cs) | ({1} if context is None else set()))


def search_split(
    graph: nx.DiGraph, order: Sequence[str], cluster: Cluster, cost: CostModel, facts: SplitFacts, *,
    space: SearchSpace | None = None, precision: Precision | None = None, shardable: Shardable | None = None,
    skew: float = 1.0, expert: int | None = None, context: int | None = None, headroom: float = 0.9,
    optimizer: str = "adam",
) -> Split:
    """The best plan counts over expert and context degrees and every other axis the cluster search prices
    (module docstring). `expert`/`context`: force that degree. Raises InfeasibleError where nothing fits."""
    space = space if space is not None else SearchSpace(recompute="auto", precision=precision)
    optimizer = space.optimizer(optimizer)
    es, cs = degree_options(facts, cluster, expert=expert, context=context)
    held = param_itemsize(graph)
    scale = (space.precision.itemsize("grad") if space.precision is not None else held) / held
    best: tuple[float, ClusterSolution, int, int, Choice, Prepared, Cluster] | None = None
    tried: dict[tuple[int, int], float] = {}
    failure: InfeasibleError | None = None
    for c in cs:
        view = coarse(cluster, c)
        prepared = prepare_search(graph, order, view, cost, space, optimizer=optimizer, headroom=headroom,
                                  shardable=shardable)
        nodes = prepared.nodes(graph, order, cost)
        for e in es:
            try:
                found, choice = search_choices(space, _Pair(prepared, nodes, view, cluster, facts, space, e, c,
                                                            skew, scale))
            except InfeasibleError as exc:
                tried[e, c], failure = float("inf"), exc
                continue
            tried[e, c] = found.step_s
            if best is None or found.step_s < best[0]:
                best = (found.step_s, found, e, c, choice, prepared, view)
    if best is None:
        raise failure if failure is not None else InfeasibleError("nothing fits", [])
    _, found, e, c, choice, prepared, view = best
    found.choice = choice
    nodes = prepared.nodes(graph, order, cost)
    problem, axes = prepared.priced(choice, nodes)
    chosen = _Pair(prepared, nodes, view, cluster, facts, space, e, c, skew, scale).axes(choice)
    plain = axes.degree(found.tensor).problem
    return Split(found, e, c, choice, tried, memory_kinds(found, graph, order, facts, e, c, space.precision), view,
                 chosen, plain, prepared.groups.get(found.tensor, []))


class _Pair:
    """The cluster search of one (expert, context) degree pair on `view` (coarse(cluster, c)): a `run` for
    search_choices, and the axes it prices under a choice."""

    def __init__(self, prepared: Prepared, nodes: NodeFacts, view: Cluster, cluster: Cluster, facts: SplitFacts,
                 space: SearchSpace, e: int, c: int, skew: float, scale: float) -> None:
        self.prepared, self.nodes, self.view, self.facts, self.space = prepared, nodes, view, facts, space
        self.e, self.c, self.skew, self.scale, self.size = e, c, skew, scale, cluster.size
        tensors = [t for t in prepared.axes.degrees.tensors if e * t * c <= cluster.size]
        self.gather = {t: ring_of(cluster, [k * t for k in range(c)]) for t in tensors}  # a replica's context ranks
        self.a2a = {t: all_to_all_affine(cluster, [k * t * c for k in range(e)]) for t in tensors}  # e replicas

    def axes(self, choice: Choice) -> Axes:
        """The axes under `choice`, each tensor degree's problem as one rank of the groups runs it."""
        _, axes = self.prepared.priced(choice, self.nodes)
        e, c = self.e, self.c
        degrees = Degrees(tuple(dataclasses.replace(d, problems=tuple(
            split_problem(p, self.facts, expert=e, context=c, tensor=d.tensor, all_to_all=self.a2a[d.tensor],
                          gather=self.gather[d.tensor], skew=self.skew, grad_scale=self.scale) for p in d.problems))
            for d in axes.degrees if d.tensor in self.a2a))
        if not degrees.degrees:
            raise InfeasibleError(f"expert {e} x context {c} groups need more than {self.size} GPUs", [])
        return dataclasses.replace(axes, degrees=degrees, expert=e)

    def __call__(self, choice: Choice, bound: float) -> tuple[ClusterSolution, float]:
        axes = self.axes(choice)
        found = search_cluster(axes.degrees.degrees[0].problem, self.view, micro_batches=self.prepared.micro_batches,
                               schedules=self.space.schedules, cuts=self.prepared.cuts, axes=axes, better_than=bound,
                               orders=("replicas-together",) if self.e > 1 else
                               ("replicas-together", "pipelines-together"))
        return found, found.step_s


def memory_kinds(solution: ClusterSolution, graph: nx.DiGraph, order: Sequence[str], facts: SplitFacts,
                 expert: int, context: int, precision: Precision | None) -> list[dict[str, float]]:
    """Per stage, bytes per GPU by kind: each state at its precision's dtype (cost_model.training_memory, / d where
    the stage's mode shards it; expert weights / e), weights / t where split; activations the rest of what the
    search counted (already / c)."""
    params = np.array([float(graph.nodes[x].get("param_bytes", 0) or 0) for x in order])
    for name, attrs in graph.nodes(data=True):
        if attrs["op"] == "get_attr":
            users = [order.index(u) for u in graph.successors(name) if u in set(order)]
            if users:
                params[min(users)] += float(attrs.get("param_bytes", 0) or 0)
    if len(facts.expert_pos) and expert > 1:
        params[facts.expert_pos] -= np.minimum(params[facts.expert_pos], facts.expert_bytes) * (1 - 1 / expert)
    out = []
    itemsize = param_itemsize(graph)
    for s, (a, b) in enumerate(zip(solution.bounds, solution.bounds[1:])):
        mode = solution.modes[s]
        elements = float(params[a:b].sum()) / itemsize / solution.tensor
        kinds: dict[str, float] = {}
        if precision is not None:
            w, m, g, o = state_bytes(elements, precision, mode=mode, degree=solution.replicas, micro_batches=1,
                                     root=0.0, unit=0.0)[:4]
            kinds = {"weights": float(w), "master": float(m), "grads": float(g), "optimizer": float(o)}
        total = float(solution.memory[s])
        kinds["activations"] = max(0.0, total - sum(kinds.values()))
        out.append(kinds)
    return out
