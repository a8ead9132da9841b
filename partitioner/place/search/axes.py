"""Search axes that change the problem a search prices, written once: both searches try every registered axis.

An axis is a choice the plan makes for every stage that changes what a search prices: full recomputation
(built in), a kernel set, a gradient mode. Each is one `AxisSpec` in this registry; the device-list and
cluster searches run once per combination of the values the space allows (`each_choice`), each on the
problem as that combination runs it (`priced`), keep the best objective (`search_choices`: the first at a
tie, so each axis's first value wins ties) and give the Plan the chosen values (`apply_choice`):

    register(AxisSpec(
        "turbo",
        values=lambda space: ("off", "on"),            # what the space allows, in order (first kept at a tie)
        price=lambda problem, value, nodes: ...,        # the problem as the value runs (unchanged: the same object)
        apply=lambda plan, value: ...,                  # what the chosen value sets in the Plan (None: nothing)
    ))

Built in: "recompute" (full recomputation or none), "gradients" (sharded stages' gradients reduced once a
step or after every micro-batch: rules.sharding, SearchSpace.gradient_syncs) and "kernels" (the kernel set the
request names, priced: search/kernels.py).

The axes a search prices otherwise (tensor degree, sharding, stages, replicas, micro-batches, schedule,
rank order) are its own: they choose where nodes and ranks go, not what a node costs.
`tests/test_search_axes.py` registers a toy axis and plans with it: nothing else names it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence, TypeVar

import networkx as nx
import numpy as np
import torch

from cost_model.interface import CostModel
from cost_model.ops import classify
from partitioner.errors import PartitionError
from partitioner.place.search.graph_costs import forward_share
from partitioner.place.search.infeasible import InfeasibleError
from partitioner.place.search.kernels import FusedFacts, fused_facts, fused_plan, fused_problem
from partitioner.place.search.problem import SearchProblem
from partitioner.place.search.recompute import (
    attention_recomputing,
    node_segments,
    op_policy_recomputing,
    recomputing,
)
from partitioner.place.search.space import SearchSpace
from rules.segments import segment_key
from rules.sharding import stage_sync
from runtime.plan import Plan

__all__ = [
    "AxisSpec", "Choice", "NodeFacts", "apply_choice", "axis_names", "each_choice", "priced", "register",
    "search_choices", "unregister",
]

Choice = dict[str, Hashable]  # axis name -> its value, for every registered axis
T = TypeVar("T")


class NodeFacts:
    """Per-node facts an axis may price with, each worked out on first use: the forward's share of each node's time
    (graph_costs.forward_share, on `device`) and each node's recomputation segment (recompute.node_segments)."""

    def __init__(self, graph: nx.DiGraph, order: Sequence[str], device: torch.device, cost: CostModel, *,
                 share: np.ndarray | None = None, segment: np.ndarray | None = None) -> None:
        self._graph, self._order, self._device, self._cost = graph, list(order), device, cost
        self._share, self._segment = share, segment
        self._fused: FusedFacts | None = None
        self._products: np.ndarray | None = None
        self._blocks: np.ndarray | None = None

    @property
    def fused(self) -> FusedFacts:
        """What the fused kernel set changes of each node (search/kernels.py)."""
        if self._fused is None:
            self._fused = fused_facts(self._graph, self._order, self._device, self._cost, self.segment)
        return self._fused

    @property
    def products(self) -> np.ndarray:
        """bool per node: a matrix product (a node counting FLOPs, cost_model.ops.classify)."""
        if self._products is None:
            self._products = np.array([classify(self._graph.nodes[x]) in ("gemm", "conv") for x in self._order],
                                      dtype=bool)
        return self._products

    @property
    def blocks(self) -> np.ndarray:
        """bool per node: owned by an indexed module ('layers.3'), a block a checkpoint wraps (rules.segments)."""
        if self._blocks is None:
            self._blocks = np.array([segment_key(str(self._graph.nodes[x].get("module", "") or "")) is not None
                                     for x in self._order], dtype=bool)
        return self._blocks

    @property
    def share(self) -> np.ndarray:
        if self._share is None:
            self._share = forward_share(self._graph, self._order, self._device, self._cost)
        return self._share

    @property
    def segment(self) -> np.ndarray:
        if self._segment is None:
            self._segment = node_segments([(x, str(self._graph.nodes[x].get("module", "") or ""))
                                           for x in self._order])
        return self._segment


@dataclass(frozen=True)
class AxisSpec:
    """One search axis (module docstring).

    Attributes:
        name: the key of its value in a `Choice`.
        values: `values(space)`, the values the space lets the searches try, in order; not empty.
        price: `price(problem, value, nodes)`, the problem as the value runs it; `problem` itself where the
            value changes nothing (the searches then reuse what they priced).
        apply: `apply(plan, value)`, what the chosen value sets in the Plan; None: nothing (the plan's
            builder counts it already, as assemble counts recomputation).
        doc: a few words for help texts.
        adjust: `adjust(plan, value, nodes)`, what the chosen value changes in the Plan's numbers that its
            builder did not count (after `apply`; the searches give it the facts they priced with).
    """

    name: str
    values: Callable[[SearchSpace], tuple[Hashable, ...]]
    price: Callable[[SearchProblem, Any, NodeFacts], SearchProblem]
    apply: Callable[[Plan, Any], None] | None = None
    doc: str = ""
    adjust: Callable[[Plan, Any, NodeFacts], None] | None = None


_REGISTRY: dict[str, AxisSpec] = {}


def register(spec: AxisSpec, *, replace: bool = False) -> AxisSpec:
    """Add `spec` to the axes both searches try (after those registered before it); returns it.

    Raises:
        ValueError: the name is taken and `replace` is False.
    """
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"search axis {spec.name!r} is registered already; pick another name, or pass replace=True")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a registered axis (tests register toys and take them away). Raises ValueError if unknown."""
    if name not in _REGISTRY:
        raise ValueError(f"no search axis {name!r}; registered: {list(_REGISTRY)}")
    del _REGISTRY[name]


def axis_names() -> tuple[str, ...]:
    """The registered axes, in registration order (the built-ins first)."""
    return tuple(_REGISTRY)


def each_choice(space: SearchSpace) -> list[Choice]:
    """Every combination of the registered axes' values `space` allows, first values first (ties keep the earlier).

    Raises:
        PartitionError: an axis allows no value.
    """
    values = {name: tuple(spec.values(space)) for name, spec in _REGISTRY.items()}
    empty = [name for name, vs in values.items() if not vs]
    if empty:
        raise PartitionError(f"search axes {empty} allow no value in {space}; their `values` must give one at least")
    return [dict(zip(values, combo)) for combo in itertools.product(*values.values())]


def priced(problem: SearchProblem, choice: Choice, nodes: NodeFacts) -> SearchProblem:
    """`problem` as `choice` runs it: each registered axis's price in turn (the same object where none changes it)."""
    for name, spec in _REGISTRY.items():
        if name in choice:
            problem = spec.price(problem, choice[name], nodes)
    return problem


def apply_choice(plan: Plan, choice: Choice, nodes: NodeFacts | None = None) -> None:
    """Give `plan` what each axis's chosen value sets in it (and, with `nodes`, changes in its numbers)."""
    for name, spec in _REGISTRY.items():
        if name in choice and spec.apply is not None:
            spec.apply(plan, choice[name])
        if name in choice and spec.adjust is not None and nodes is not None:
            spec.adjust(plan, choice[name], nodes)


def search_choices(space: SearchSpace, run: Callable[[Choice, float], tuple[T, float]]) -> tuple[T, Choice]:
    """The best of running a search once per choice (`each_choice`): `run(choice, bound)` returns what it found and
    its objective, told the best objective so far (`bound`) so that it may prune; the first is kept at a tie.

    Raises:
        InfeasibleError: no choice fits (the last choice's error).
    """
    best: tuple[T, float, Choice] | None = None
    failure: InfeasibleError | None = None
    for choice in each_choice(space):
        try:
            found, objective = run(choice, best[1] if best is not None else math.inf)
        except InfeasibleError as exc:
            failure = exc
            continue
        if best is None or objective < best[1]:
            best = (found, objective, choice)
    if best is None:
        raise failure if failure is not None else InfeasibleError("nothing fits", [])
    return best[0], best[2]


def _kernels_price(problem: SearchProblem, kernels: Any, nodes: NodeFacts) -> SearchProblem:
    return problem if kernels == "eager" else fused_problem(problem, nodes.fused)


def _kernels_adjust(plan: Plan, kernels: Any, nodes: NodeFacts) -> None:
    if kernels == "fused":
        fused_plan(plan, nodes.fused)


register(AxisSpec("kernels", lambda space: (space.kernels,), _kernels_price, adjust=_kernels_adjust,
                  doc="the kernel set priced: 'eager' (this runtime) or 'fused' (engines plans are exported to)"))


def _recompute_price(problem: SearchProblem, mode: Any, nodes: NodeFacts) -> SearchProblem:
    if mode in ("attention", "selective-op"):
        facts = nodes.fused
        if facts.scores is None or facts.core is None or problem.n != len(facts.names):
            return recomputing(problem, nodes.share, nodes.segment) if mode == "selective-op" else problem
        if mode == "selective-op":
            return op_policy_recomputing(problem, nodes.share, nodes.segment, nodes.products, facts.scores,
                                         facts.core, nodes.blocks)
        return attention_recomputing(problem, nodes.share, facts.scores, facts.core)
    return recomputing(problem, nodes.share, nodes.segment) if mode == "full" else problem


register(AxisSpec("recompute", lambda space: space.recompute_modes, _recompute_price,
                  doc="full activation recomputation for every stage, or none (per-stage modes: planning); "
                      "'attention' (Megatron-LM's selective: the attention core) and 'selective-op' (torchtitan's "
                      "op policy), priced only"))


def _gradients_price(problem: SearchProblem, sync: Any, nodes: NodeFacts) -> SearchProblem:
    return problem if sync == problem.gradient_sync else dataclasses.replace(problem, gradient_sync=str(sync))


def _gradients_apply(plan: Plan, sync: Any) -> None:
    for stage in plan.stages:  # what each stage's mode runs of it (cluster/stages.py set the same where it priced)
        ranks = stage.replicas * max(1, stage.context)  # a sharded stage's FSDP2 mesh holds its context ranks
        stage.gradient_sync = stage_sync(stage.sharding, str(sync)) if ranks > 1 else "last"


register(AxisSpec("gradients", lambda space: space.gradient_syncs(), _gradients_price, _gradients_apply,
                  doc="sharded stages' gradients: accumulated whole and reduced once a step ('last'), or "
                      "reduce-scattered after each micro-batch ('every', FULL_SHARD)"))
