"""A tensor degree, modelled once for both searches: the model as each of its t ranks runs it, and where it is cut.

    TensorDegree   one degree t: the problem as each of its t ranks runs it (tensor_split.split_problem), one
                   per distinct tensor ring; the cut positions inside a split group (`forbidden`: a stage of
                   it may not cut there) and each group's span (a split stage holds one group at least)
    Degrees        the degrees a search may give a stage, in the order it tries them (1 first: at equal
                   cost a stage stays whole)

The cluster search prices a degree on one ring (t consecutive ranks from rank 0: one problem). The
device-list search prices it on the ring of each replica's own devices, so it keeps one problem per
distinct ring and, per (first device, replicas), which one (`ring`) and the replicas' data-parallel ring
over the ranks of one tensor index (`reduce`).

Which groups a degree splits (`split_groups`) is one rule for both: t among the group's degrees, every
node in the compute order, and no cut candidate inside it (the cluster's candidates at block edges);
a search that cuts anywhere (device lists: `alone=True`) also leaves whole a group whose span holds
another group's node (a tied embedding and LM head at both ends of the model), which only a stage of
the whole span could split.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from partitioner.capture.shardable_groups import Shardable, ShardGroup
from partitioner.place.search.problem import LinkCost, SearchProblem

__all__ = ["Degrees", "TensorDegree", "crossing", "split_groups"]


@dataclass(frozen=True)
class TensorDegree:
    """One tensor degree t (module docstring); t = 1 is the model whole, with no group and no cut forbidden."""

    tensor: int
    problems: tuple[SearchProblem, ...]  # as each of t ranks runs it, one per distinct tensor ring
    forbidden: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # cuts inside a group
    spans: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))  # each group's first, last
    ring: dict[tuple[int, int], int] = field(default_factory=dict)  # device lists: (first device, replicas) -> problem
    reduce: dict[tuple[int, int], LinkCost] = field(default_factory=dict)  # ... -> data-parallel ring (None: one)

    @classmethod
    def of(cls, tensor: int, problems: Sequence[SearchProblem], groups: Sequence[ShardGroup], order: Sequence[str],
           **per_position: Any) -> TensorDegree:
        """The degree that splits `groups` (positions in `order`), priced by `problems`."""
        position = {name: i for i, name in enumerate(order)}
        spans = np.array([[min(position[n] for n in g.nodes), max(position[n] for n in g.nodes)] for g in groups],
                         dtype=np.int64).reshape(-1, 2)
        return cls(tensor, tuple(problems), crossing(groups, order), spans, **per_position)

    @property
    def problem(self) -> SearchProblem:
        """The problem of its first ring (a cluster's only one)."""
        return self.problems[0]

    def allowed(self, cuts: np.ndarray) -> np.ndarray:
        """`cuts` without the positions inside a split group."""
        return cuts[~np.isin(cuts, self.forbidden)] if len(self.forbidden) else cuts

    def holds_a_group(self, cuts: np.ndarray) -> np.ndarray | None:
        """[i, j]: whether a stage [cuts[i], cuts[j]) holds a split group (a split stage splits one at least:
        runtime.plan's check); None for t = 1."""
        if self.tensor == 1:
            return None
        first, last = self.spans[:, 0], self.spans[:, 1]
        starts = cuts[:, None, None] <= first[None, None, :]
        ends = last[None, None, :] < cuts[None, :, None]
        return np.asarray((starts & ends).any(axis=2))

    def valid(self, cuts: np.ndarray) -> np.ndarray:
        """[i, j]: whether a stage [cuts[i], cuts[j]) may split: it holds a group and no cut falls inside one."""
        inside = np.isin(cuts, self.forbidden)
        holds = self.holds_a_group(cuts)
        if holds is None:
            return np.ones((len(cuts), len(cuts)), dtype=bool)
        out: np.ndarray = holds & ~inside[:, None] & ~inside[None, :]
        return out


@dataclass(frozen=True)
class Degrees:
    """The tensor degrees a search may give a stage, in the order it tries them."""

    degrees: tuple[TensorDegree, ...]

    @property
    def tensors(self) -> tuple[int, ...]:
        """Every degree, in order."""
        return tuple(d.tensor for d in self.degrees)

    @property
    def splits(self) -> bool:
        """Whether some degree splits layers (t > 1)."""
        return any(d.tensor > 1 for d in self.degrees)

    def degree(self, t: int) -> TensorDegree:
        return next(d for d in self.degrees if d.tensor == t)

    def priced(self, redo: Callable[[SearchProblem], SearchProblem]) -> Degrees:
        """These degrees with every problem passed through `redo` (a search axis's price: search/axes.py); the
        same object where `redo` changes none."""
        made = tuple(tuple(redo(p) for p in d.problems) for d in self.degrees)
        if all(a is b for d, ps in zip(self.degrees, made) for a, b in zip(d.problems, ps)):
            return self
        return Degrees(tuple(dataclasses.replace(d, problems=ps) for d, ps in zip(self.degrees, made)))

    def __iter__(self) -> Any:
        return iter(self.degrees)


def split_groups(shardable: Shardable, t: int, order: Sequence[str], cuts: Any = None, *,
                 alone: bool = False) -> list[ShardGroup]:
    """The groups degree t splits (module docstring): t among their degrees, every node in `order`, none with a
    cut candidate (`cuts`, positions 0..n; None: no candidate) inside it; with `alone`, none whose span holds a
    node of another group of the model."""
    if t == 1:
        return []
    position = {name: i for i, name in enumerate(order)}
    groups = [g for g in shardable.groups if all(n in position for n in g.nodes)]
    span = {g.name: (min(position[n] for n in g.nodes), max(position[n] for n in g.nodes)) for g in groups}
    held = {g.name: {position[n] for n in g.nodes} for g in groups}
    marks = np.asarray(sorted(cuts) if cuts is not None else [], dtype=np.int64)
    out = []
    for group in groups:
        first, last = span[group.name]
        if t not in group.degrees or np.any((marks > first) & (marks <= last)):
            continue
        if alone and any(first <= i <= last for other in groups if other.name != group.name for i in held[other.name]):
            continue
        out.append(group)
    return out


def crossing(groups: Sequence[ShardGroup], order: Sequence[str]) -> np.ndarray:
    """Cut positions (0..n) that would fall inside a split group: a cut at c runs nodes c.. in the next stage."""
    position = {name: i for i, name in enumerate(order)}
    out: set[int] = set()
    for group in groups:
        first, last = min(position[n] for n in group.nodes), max(position[n] for n in group.nodes)
        out.update(range(first + 1, last + 1))
    return np.array(sorted(out), dtype=np.int64)
