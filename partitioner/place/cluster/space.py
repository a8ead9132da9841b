"""What the cluster search chooses among (tensor degrees, sharding modes, rank orders, micro-batches) and returns.

    GPUs = t x p x d            t tensor ranks per replica (TP innermost: consecutive ranks, one host
                                where t divides its GPUs), p stages, d replicas of each
    rank of stage s, replica j, tensor index i = t * layout(p, d, order)[s][j] + i

`Axes` is what the search prices beyond counts: the tensor degrees (search.degrees: each with the problem
as its ranks run it, on the ring of t consecutive ranks), the sharding modes of the replicas and how
states are counted (search.split_costs.StateRule; None: as plans were counted before training precision
was an input, the only way without a rule).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Hashable, Literal, NamedTuple, Sequence, get_args

import numpy as np

from partitioner.place.search.degrees import Degrees, TensorDegree
from partitioner.place.search.problem import SearchProblem
from partitioner.place.search.states import StateRule

__all__ = [
    "RANK_ORDERS", "Axes", "Candidate", "ClusterSolution", "RankOrder", "cheapest_modes", "layout",
    "tensor_degrees",
]

# Which ranks share hosts: a stage's replicas ("replicas-together": stage s on ranks s*d .. s*d+d-1, its
# all-reduce inside hosts, pipeline neighbours across them) or one pipeline's stages ("pipelines-together":
# replica j of stage s on rank j*p + s, neighbours inside a host, each all-reduce across hosts).
RankOrder = Literal["replicas-together", "pipelines-together"]
RANK_ORDERS: tuple[str, ...] = get_args(RankOrder)


class Candidate(NamedTuple):
    """A configuration the search priced: its objective (s), counts, rank order, cuts, tensor degree, sharding."""

    step: float
    m: int
    d: int
    order: RankOrder
    bounds: list[int]
    tensor: int = 1
    sharding: str = "none"


@dataclass(frozen=True)
class Axes:
    """What the search tries beyond stages, replicas and micro-batches (module docstring)."""

    degrees: Degrees
    modes: tuple[str, ...] = ("none",)
    rule: StateRule | None = None
    blocks: np.ndarray | None = None  # per node, its block (search.blocks.block_ids): the FSDP unit
    share: np.ndarray | None = None  # per node, the forward's part of its time
    expert: int = 1  # replicas a stack of experts splits over: replica counts it does not divide are not tried

    @classmethod
    def whole(cls, problem: SearchProblem) -> Axes:
        """Stages, replicas and micro-batches alone: every layer whole, replicas unsharded."""
        return cls(Degrees((TensorDegree(1, (problem,)),)))

    def degree(self, tensor: int) -> TensorDegree:
        return self.degrees.degree(tensor)

    def priced(self, redo: Callable[[SearchProblem], SearchProblem]) -> Axes:
        """These axes with every degree's problem passed through `redo` (search.degrees.Degrees.priced)."""
        degrees = self.degrees.priced(redo)
        return self if degrees is self.degrees else dataclasses.replace(self, degrees=degrees)

    def modes_for(self, d: int) -> tuple[str, ...]:
        """Sharding modes worth pricing with d replicas ("none" alone for one, unless each replica's context ranks
        share its FSDP2 mesh: StateRule.shard_degree)."""
        return self.modes if d * (self.rule.shard_degree if self.rule is not None else 1) > 1 else ("none",)


@dataclass
class ClusterSolution:
    """The chosen counts, ranks and cuts, and what the search compared."""

    bounds: list[int]  # [0, b1, ..., n]
    ranks: list[list[int]]  # per stage, its replicas' first ranks (micro-batch i on ranks[s][i % d])
    order: RankOrder
    micro_batches: int
    schedule: str
    step_s: float  # the search's objective: fill(m, p, d) * max W
    work_s: list[float]  # W per stage
    memory: list[float]  # bytes per replica of each stage
    tried: dict[str, float] = field(default_factory=dict)  # "p x d, m, order" -> objective (s), best cuts
    searched: int = 0  # configurations priced
    pruned: int = 0  # configurations skipped by a bound
    candidates: list[Candidate] = field(default_factory=list)  # the TOP best (p, d) by objective, first-pass cuts
    cuts: np.ndarray | None = None  # the first pass's cut candidates (for `refine`)
    tensor: int = 1  # ranks per replica, its layers split across them
    sharding: str = "none"  # the configuration's sharding mode (rules.sharding), the one the search compared
    virtual: int = 1  # chunks per rank, interleaved (partitioner/place/search/virtual_stages.py)
    stage_sharding: list[str] = field(default_factory=list)  # each stage's mode (cheapest_modes); empty: `sharding`
    choice: dict[str, Hashable] = field(default_factory=dict)  # each search axis's value (search/axes.py)

    @property
    def modes(self) -> list[str]:
        """Each stage's sharding mode."""
        return self.stage_sharding or [self.sharding] * self.stages

    @property
    def stages(self) -> int:
        return len(self.ranks)

    @property
    def replicas(self) -> int:
        return len(self.ranks[0])


def layout(p: int, d: int, order: RankOrder, tensor: int = 1) -> list[list[int]]:
    """The first rank of each replica of each of p stages with d replicas each, in `order` (see RankOrder); each
    replica runs on `tensor` consecutive ranks from there."""
    if order == "replicas-together":
        return [[tensor * (s * d + j) for j in range(d)] for s in range(p)]
    return [[tensor * (j * p + s) for j in range(d)] for s in range(p)]


def cheapest_modes(priced: dict[str, tuple[list[float], list[float]]], chosen: str, capacity: float) -> list[str]:
    """Each stage's sharding mode: from `priced` (mode -> (W per stage, bytes per replica of each stage), same
    cuts), the one of least W among those whose bytes fit `capacity`; `chosen` (the configuration's) unless
    another is strictly faster, so no stage's W grows and neither does the step (fill x max W). Later
    stages of 1F1B hold fewer micro-batches in flight: they may fit a mode that gathers less."""
    out = []
    for s in range(len(priced[chosen][0])):
        best = chosen
        for mode, (w, held) in priced.items():
            if held[s] <= capacity and w[s] < priced[best][0][s]:
                best = mode
        out.append(best)
    return out


def tensor_degrees(gpus: int, gpus_per_host: int, legal: Sequence[int]) -> list[int]:
    """Tensor degrees worth trying: 1 and those in `legal` (a split group's) that divide the GPUs and fit in a host,
    and twice a host (across hosts: priced on the inter-host link, kept only where it is faster)."""
    out = {1}
    for t in legal:
        if t > 1 and gpus % t == 0 and (gpus_per_host % t == 0 or t == 2 * gpus_per_host):
            out.add(t)
    return sorted(out)
