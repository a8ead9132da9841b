"""Expert and context degrees chosen with the cluster search's other axes (search/experts_context.py prices them).

    search_split(graph, order, cluster, cost, facts, ...) -> Split (the solution, its expert and context degrees)

For each context degree c the graph's sequence splits into (1, and those that put a replica's t x c ranks
inside a host or on whole hosts) and each expert degree e its stacks split into (1, and those that divide
the GPUs), the cluster search runs on the cluster as one rank of a context group sees it: `views(cluster,
c)`, each of its GPUs c consecutive ranks (a replica's t x c ranks, tensor innermost, as
runtime/plan_axes.py lays them out), so stages, replicas, tensor degree, sharding, micro-batches and cuts are
searched as for any plan, on the problem one rank runs (search.experts_context.split_problem). Replica
counts e does not divide are skipped (Axes.expert), and with e > 1 only "replicas-together" is tried: an
expert group is e consecutive replicas of a stage, its all-to-all priced on their ranks (0, w, .., (e - 1) w,
w = t x c). The smallest objective wins; at a tie the smaller degrees (tried first). A graph with neither
splits nothing here: (1, 1) alone, the search as it was.

A Plan of the chosen configuration is made as any cluster solution's (cluster.plan.solution_plan on `view`, by
place/replicated.py: plan_split), then `split_made` gives it what the split changes:

    ranks               r x c on the real cluster: replica j of a stage on t x c consecutive ranks from there
    context, context_attention   every stage (the same degree), the causal attentions among its nodes
    expert, expert_layers        the stages holding a stack of experts (e of their consecutive replicas)
    forward_ms, backward_ms      scaled by the stage's time as one rank of the groups runs it over its time whole
    param_bytes, memory_bytes, activation_bytes  the search's count (expert weights and states / e, activations / c)
    data_split "slice", m / d micro-batches per replica, programs lowered where they run; the step is replica 0's
    pipeline in the runtime's order (cluster.look.replica_step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import networkx as nx
import numpy as np

from cost_model.all_to_all import NodeLimited, all_to_all_affine
from cost_model.cluster_shape import Cluster
from cost_model.collectives import ring_of
from cost_model.interface import CostModel
from cost_model.precision import Precision
from cost_model.training_memory import state_bytes
from partitioner.capture.experts import find_experts
from partitioner.capture.sequence import find_sequence_split
from partitioner.capture.shardable_groups import Shardable, ShardGroup
from partitioner.errors import PartitionError
from partitioner.place.cluster.axes import param_itemsize
from partitioner.place.cluster.candidate import slowest_pair
from partitioner.place.cluster.look import replica_step
from partitioner.place.cluster.prepare import Prepared, prepare_search
from partitioner.place.cluster.search import search_cluster
from partitioner.place.cluster.space import Axes, ClusterSolution
from partitioner.place.search.axes import Choice, NodeFacts, search_choices
from partitioner.place.search.degrees import Degrees
from partitioner.place.search.experts_context import SplitFacts, split_problem
from partitioner.place.search.graph_costs import per_micro_batch
from partitioner.place.search.infeasible import InfeasibleError
from partitioner.place.search.problem import SearchProblem
from partitioner.place.search.space import SearchSpace
from partitioner.predict.counting import stage_edges
from runtime.plan import Plan

__all__ = ["Split", "degree_options", "found_splits", "memory_kinds", "search_split", "split_made", "views"]


@dataclass
class Split:
    """The cluster search's solution with its expert and context degrees, and what a Plan of it is made from."""

    solution: ClusterSolution  # its ranks on `view`: rank r there is ranks r x context .. of the real cluster
    expert: int
    context: int
    choice: Choice
    tried: dict[tuple[int, int], float]  # (expert, context) -> objective (s), inf where nothing fit
    kinds: list[dict[str, float]]  # per stage, bytes per GPU by kind (weights, grads, master, optimizer, activations)
    view: Cluster  # the cluster as one rank of its context group sees it (`views`)
    axes: Axes  # the winning search's axes, each degree's problem as one rank runs it (split_problem)
    plain: SearchProblem  # the chosen tensor degree's problem before split_problem (the Plan's numbers are its)
    groups: list[ShardGroup]  # the tensor groups the chosen degree splits

    @property
    def ranks(self) -> list[list[int]]:
        """Each stage's replicas' first ranks on the real cluster."""
        return [[r * self.context for r in replicas] for replicas in self.solution.ranks]


def views(cluster: Cluster, context: int) -> list[tuple[Cluster, tuple[int, ...] | None]]:
    """The clusters one rank of a context group of `context` sees (each GPU there: c ranks; a replica's first rank r
    there is r x c here), with the tensor degrees each prices right (None: any it allows). A replica's t x c ranks
    inside a host: hosts of g / c GPUs. Spread over hosts (t x c > g, tensor inside a host, context ranks on
    other hosts): hosts of g GPUs, each c hosts here, for t dividing g with t x c > g."""
    if context == 1:
        return [(cluster, None)]
    g, out = cluster.gpus_per_host, list[tuple[Cluster, tuple[int, ...] | None]]()
    if g % context == 0:
        out.append((dataclasses.replace(cluster, gpus_per_host=g // context), None))
    if cluster.size % (context * g) == 0:
        spread = tuple(t for t in range(1, g + 1) if g % t == 0 and t * context > g)
        out.append((dataclasses.replace(cluster, hosts=cluster.size // (context * g)), spread))
    return out


def degree_options(facts: SplitFacts, cluster: Cluster, *, expert: int | None = None,
                   context: int | None = None, most: int = 64) -> tuple[list[int], list[int]]:
    """(expert degrees, context degrees) worth searching on `cluster`: 1, and the finders' degrees that fit
    (up to `most`); `expert`/`context` given: that one alone."""
    size = cluster.size
    es = [e for e in facts.expert_degrees if e <= most and size % e == 0] if facts.has_experts else [1]
    cs = [c for c in facts.context_degrees if c <= most and views(cluster, c)] if facts.has_context else [1]
    if expert is not None:
        es = [expert]
    if context is not None:
        cs = [context]
    return sorted(set(es) | ({1} if expert is None else set())), sorted(set(cs) | ({1} if context is None else set()))


def search_split(
    graph: nx.DiGraph, order: Sequence[str], cluster: Cluster, cost: CostModel, facts: SplitFacts, *,
    space: SearchSpace | None = None, precision: Precision | None = None, shardable: Shardable | None = None,
    skew: float = 1.0, expert: int | None = None, context: int | None = None, headroom: float = 0.9,
    optimizer: str = "adam", stages: int | None = None, max_nodes: int | None = None,
    bounds: Sequence[int] | None = None, virtual: int = 1,
) -> Split:
    """The best plan counts over expert and context degrees and every other axis the cluster search prices
    (module docstring). `expert`/`context`/`stages`: force that degree or stage count (the space: the tensor degree
    and sharding). `max_nodes`: node-limited routing, each token's experts on at most that many hosts and sent
    once a host (cost_model.all_to_all.NodeLimited; DeepSeek-V3: 4). `bounds`: a run's own stage boundaries (positions
    in `order`, 0 and len(order) included): the stages are those, not searched. `virtual`: chunks per rank,
    interleaved 1F1B as Megatron-LM runs it (priced only: the runtime interleaves no stage with replicas). Raises
    InfeasibleError where nothing fits."""
    if bounds is not None:
        stages = len(bounds) - 1
    routing = NodeLimited(max_nodes, facts.top_k) if max_nodes is not None else None
    space = space if space is not None else SearchSpace(recompute="auto", precision=precision)
    optimizer = space.optimizer(optimizer)
    es, cs = degree_options(facts, cluster, expert=expert, context=context)
    held = param_itemsize(graph)
    scale = (space.precision.itemsize("grad") if space.precision is not None else held) / held
    best: tuple[float, ClusterSolution, int, int, Choice, Prepared, Cluster, SearchSpace] | None = None
    tried: dict[tuple[int, int], float] = {}
    failure: InfeasibleError | None = None
    for c in cs:
        for view, spread in views(cluster, c):
            try:  # spread over hosts: only the tensor degrees it prices right, of those the space allows
                allowed = space if spread is None else space.but(tensor=tuple(space.tensor_degrees(spread, view.shape)))
                prepared = prepare_search(graph, order, view, cost, allowed, optimizer=optimizer, headroom=headroom,
                                          shardable=shardable)
            except PartitionError:  # a tensor degree the model, this view or the space does not take
                continue
            nodes = prepared.nodes(graph, order, cost)
            for e in es:
                try:
                    found, choice = search_choices(allowed, _Pair(prepared, nodes, view, cluster, facts, allowed, e, c,
                                                                  skew, scale, stages, routing, bounds, virtual))
                except InfeasibleError as exc:
                    failure = exc
                    tried.setdefault((e, c), float("inf"))
                    continue
                tried[e, c] = min(tried.get((e, c), float("inf")), found.step_s)
                if best is None or found.step_s < best[0]:
                    best = (found.step_s, found, e, c, choice, prepared, view, allowed)
    if best is None:
        raise failure if failure is not None else InfeasibleError("nothing fits", [])
    _, found, e, c, choice, prepared, view, space = best
    found.choice = choice
    nodes = prepared.nodes(graph, order, cost)
    problem, axes = prepared.priced(choice, nodes)
    chosen = _Pair(prepared, nodes, view, cluster, facts, space, e, c, skew, scale, stages, routing,
                   bounds, virtual).axes(choice)
    plain = axes.degree(found.tensor).problem
    return Split(found, e, c, choice, tried, memory_kinds(found, graph, order, facts, e, c, space.precision), view,
                 chosen, plain, prepared.groups.get(found.tensor, []))


class _Pair:
    """The cluster search of one (expert, context) degree pair on `view` (one of views(cluster, c)): a `run` for
    search_choices, and the axes it prices under a choice."""

    def __init__(self, prepared: Prepared, nodes: NodeFacts, view: Cluster, cluster: Cluster, facts: SplitFacts,
                 space: SearchSpace, e: int, c: int, skew: float, scale: float, stages: int | None = None,
                 routing: NodeLimited | None = None, bounds: Sequence[int] | None = None, virtual: int = 1) -> None:
        self.prepared, self.nodes, self.view, self.facts, self.space = prepared, nodes, view, facts, space
        self.virtual = virtual
        # errors name the caller's cluster, not the view one context rank sees
        self.named = cluster.shape if view.shape == cluster.shape else f"{cluster.shape} (its sequence split {c} ways)"
        self.bounds = np.asarray(bounds, dtype=np.int64) if bounds is not None else None
        self.e, self.c, self.skew, self.scale, self.size, self.stages = e, c, skew, scale, cluster.size, stages
        tensors = [t for t in prepared.axes.degrees.tensors if e * t * c <= cluster.size]
        self.gather = {t: ring_of(cluster, [k * t for k in range(c)]) for t in tensors}  # a replica's context ranks
        self.a2a = {t: all_to_all_affine(cluster, [k * t * c for k in range(e)], routing) for t in tensors}

    def axes(self, choice: Choice) -> Axes:
        """The axes under `choice`, each tensor degree's problem as one rank of the groups runs it."""
        whole, axes = self.prepared.priced(choice, self.nodes)
        e, c = self.e, self.c
        rate = self.facts.rate(whole) if len(self.facts.expert_pos) else None  # before the tensor split
        degrees = Degrees(tuple(dataclasses.replace(d, problems=tuple(
            split_problem(p, self.facts, expert=e, context=c, tensor=d.tensor, all_to_all=self.a2a[d.tensor],
                          gather=self.gather[d.tensor], skew=self.skew, grad_scale=self.scale,
                          sequence=self.space.sequence_parallel, rate=rate) for p in d.problems))
            for d in axes.degrees if d.tensor in self.a2a))
        if not degrees.degrees:
            raise InfeasibleError(f"expert {e} x context {c} groups need more than {self.size} GPUs", [])
        # FSDP2 shards over d x c ranks; their ring: the context ranks' (the slowest of the tensor degrees' spacings)
        ring = (max(r[0] for r in self.gather.values()), max(r[1] for r in self.gather.values()))
        rule = dataclasses.replace(axes.rule, shard_degree=c, shard_ring=ring) if axes.rule is not None and c > 1 \
            else axes.rule
        return dataclasses.replace(axes, degrees=degrees, expert=e, rule=rule)  # FSDP2 shards over d x c ranks

    def __call__(self, choice: Choice, bound: float) -> tuple[ClusterSolution, float]:
        axes = self.axes(choice)
        found = search_cluster(axes.degrees.degrees[0].problem, self.view, micro_batches=self.prepared.micro_batches,
                               schedules=self.space.schedules, axes=axes, better_than=bound, stages=self.stages,
                               cuts=self.prepared.cuts if self.bounds is None else self.bounds,
                               refine_cuts=self.bounds is None, virtual=self.virtual, named=self.named,
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
            w, m, g, o = state_bytes(elements, precision, mode=mode, degree=solution.replicas * context,
                                     micro_batches=1, root=0.0, unit=0.0)[:4]
            kinds = {"weights": float(w), "master": float(m), "grads": float(g), "optimizer": float(o)}
        total = float(solution.memory[s])
        kinds["activations"] = max(0.0, total - sum(kinds.values()))
        out.append(kinds)
    return out


def split_made(made: Plan, split: Split, graph: nx.DiGraph, order: Sequence[str], cluster: Cluster,
               facts: SplitFacts, precision: Precision | None) -> Plan:
    """`made`, the Plan of `split.solution` on `split.view` (cluster.plan.solution_plan), given what the split
    changes (module docstring) and checked."""
    found, c, e = split.solution, split.context, split.expert
    if precision is not None:
        made.precision = precision.to_dict()
    m, d = found.micro_batches, found.replicas
    rank_one = split.axes.degree(found.tensor).problem.micro_batch_times(m)[0]
    whole = split.plain.micro_batch_times(m)[0]
    split_params = split.axes.degree(found.tensor).problem.param_bytes
    expert_at = {order[i]: path for i, path in zip(facts.expert_pos, facts.expert_paths)}
    attention_at = {order[i]: path for i, path in zip(facts.attention_pos, facts.attention_paths)}
    for stage, a, b, ranks in zip(made.stages, found.bounds, found.bounds[1:], split.ranks):
        before = float(whole[a:b].sum())
        scale = float(rank_one[a:b].sum()) / before if before > 0 else 1.0
        stage.forward_ms *= scale
        stage.backward_ms *= scale
        stage.compute_ms = stage.forward_ms + stage.backward_ms
        stage.predicted_ms = (stage.compute_ms + stage.comm_ms) / d  # as cluster/plan.py: over its replicas
        held, own = float(split.plain.param_bytes[a:b].sum()), float(split_params[a:b].sum())  # experts / e
        stage.param_bytes = int(stage.param_bytes * own / held) if held > 0 else stage.param_bytes
        stage.memory_bytes = int(found.memory[stage.index])
        stage.activation_bytes = int(split.kinds[stage.index].get("activations", 0.0))
        stage.ranks, stage.device = list(ranks), f"cuda:{ranks[0] % cluster.gpus_per_host}"
        stage.context = c
        stage.context_attention = list(dict.fromkeys(attention_at[n] for n in stage.nodes if n in attention_at)) \
            if c > 1 else []
        layers = list(dict.fromkeys(expert_at[n] for n in stage.nodes if n in expert_at)) if e > 1 else []
        stage.expert, stage.expert_layers = (e, layers) if layers else (1, [])
    stage_nodes = [list(s.nodes) for s in made.stages]
    message = [0.0] * len(made.stages)
    for (a, b), nbytes in stage_edges(per_micro_batch(graph, m), stage_nodes).items():
        if nbytes > 0 and b == a + 1:
            src, dst = slowest_pair(cluster, made.stages[a].ranks, made.stages[b].ranks)
            message[b] = max(message[b], 1e3 * cluster.transfer_time(nbytes, src, dst))
    made.predicted_step_ms = replica_step(made.schedule, m, d, [s.forward_ms for s in made.stages],
                                          [s.backward_ms for s in made.stages], message,
                                          [s.allreduce_ms for s in made.stages])
    made.micro_batches, made.data_split, made.programs = m // d, "slice", []
    made.gpus_per_host = cluster.gpus_per_host
    made.alternatives = {f"expert {x} x context {y}": 1e3 * step for (x, y), step in sorted(split.tried.items())
                         if np.isfinite(step)}
    made.check()
    return made


def found_splits(gm: Any, model: Any, graph: nx.DiGraph, order: Sequence[str]) -> SplitFacts:
    """What of `gm` (traced from `model`) splits over expert and context ranks (capture.experts, capture.sequence)."""
    return SplitFacts.of(graph, order, find_experts(gm, model), find_sequence_split(gm), gm)
