"""A stage's work and memory over a grid of cut candidates: how both searches price a stage.

devices/search.py (device lists) and cluster/search.py (counts) price a stage [cuts[i], cuts[j]) on a
window of devices (`Window`) by the formulas of devices/search.py's docstring: its work W per
step, its static memory and its memory per micro-batch in flight, for all (i, j) at once.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from partitioner.errors import PartitionError
from partitioner.place.search.boundaries import boundary_bytes
from partitioner.place.search.problem import LinkCost, SearchProblem, Window
from rules.schedules import in_flight, schedule_spec, searched_names

__all__ = [
    "Grid", "LinkCost", "Window", "cut_candidates", "range_max", "replica_in_flight", "schedule_fill", "span",
    "stage_parts",
]



class Grid:
    """Cumulative per-candidate-cut quantities for one set of cut candidates."""

    def __init__(self, problem: SearchProblem, cuts: np.ndarray) -> None:
        self.cuts = cuts
        self.recv, self.send = boundary_bytes(
            problem.producers, problem.consumers, problem.value_bytes, problem.n, cuts
        )
        self.problem = problem
        self.params, self.saved = self._prefix(problem.param_bytes), self._prefix(problem.saved_bytes)
        self.largest = range_max(problem.out_bytes, cuts) if problem.out_bytes is not None else None
        self._compute: dict[int, np.ndarray] = {}

    def _prefix(self, x: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.concatenate([np.zeros(x.shape[:-1] + (1,)), np.cumsum(x, axis=-1)], axis=-1)
        return out[..., self.cuts]

    def compute(self, m: int) -> np.ndarray:
        """[kinds, cuts] cumulative seconds of one micro-batch of m (see SearchProblem.micro_batch_times)."""
        if m not in self._compute:
            self._compute[m] = self._prefix(self.problem.micro_batch_times(m))
        return self._compute[m]


def range_max(values: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """[i, j]: the largest of values[cuts[i] : cuts[j]] (0 where empty)."""
    pieces = np.array([values[a:b].max() if b > a else 0.0 for a, b in zip(cuts[:-1], cuts[1:])])
    out = np.zeros((len(cuts), len(cuts)))
    for i in range(len(cuts) - 1):
        out[i, i + 1 :] = np.maximum.accumulate(pieces[i:])
    return out


def span(prefix: np.ndarray, rows: slice, cols: slice) -> np.ndarray:
    out: np.ndarray = prefix[..., None, cols] - prefix[..., rows, None]
    return out


def stage_parts(
    p: SearchProblem, g: Grid, window: Window, m: int, rows: slice, cols: slice
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W, static memory and memory per micro-batch in flight of stages [cuts[rows], cuts[cols]) on a window."""
    r, kinds, recv_link, send_link, reduce, _ = window
    comp = np.max(span(g.compute(m)[list(kinds)], rows, cols), axis=0)
    recv, send = g.recv[rows, cols] / m, g.send[rows, cols] / m
    t = comp
    for link, nbytes in ((recv_link, recv), (send_link, send)):
        if link is not None:
            t = t + 2 * np.where(nbytes > 0, link[0] + link[1] * nbytes, 0.0)
    params = span(g.params, rows, cols)
    work = math.ceil(m / r) * t
    if reduce is not None:
        work = work + np.where(params > 0, reduce[0] + reduce[1] * params, 0.0)
    idx = np.arange(len(g.cuts))
    work = np.where(idx[cols][None, :] > idx[rows][:, None], work, np.inf)
    static = (2 + p.optimizer_states) * params + 2 * (recv + send)
    if g.largest is not None:
        static = static + p.working_outputs * g.largest[rows, cols] / m
    flight = span(g.saved, rows, cols) / m + recv + send
    return work, static, flight


def schedule_fill(schedule: str) -> Callable[[int, int], float]:
    """The schedule's step over its slowest stage's work, `fill(m, p)` (rules.schedules; GPipe and 1F1B:
    (m + p - 1) / m). Raises PartitionError for a schedule without one: the searches cannot plan it."""
    fill = schedule_spec(schedule).fill
    if fill is None:
        raise PartitionError(f"schedule {schedule!r} has no fill; the searches plan {list(searched_names())}")
    return fill


def replica_in_flight(schedule: str, q: int, m: int, r: int) -> int:
    """Micro-batches one replica holds: the stage is q-th from the end (q = p - s).

    The schedule's closed form (rules.schedules.in_flight), for stage 0 of the q stages left: a
    schedule the searches plan (one with a `fill`) holds a number that depends on q alone.
    """
    return in_flight(schedule, 0, q, m, r)


def cut_candidates(
    problem: SearchProblem, size: int, around: Sequence[int] = (), width: int = 0, stride: int = 1
) -> np.ndarray:
    """About `size` candidates at equal node counts and equal times, plus every `stride`-th position within
    `width` of `around`."""
    n = problem.n
    if n + 1 <= size:
        return np.arange(n + 1)
    cum = np.concatenate([[0.0], np.cumsum(problem.fixed_times.mean(0) + problem.batch_times.mean(0))])
    by_time = np.searchsorted(cum, np.linspace(0, cum[-1], size // 2), side="right") - 1
    parts: list[np.ndarray] = [np.linspace(0, n, size - size // 2).round().astype(int), by_time, np.array([0, n])]
    for b in around:
        parts.append(np.arange(b - width, b + width + 1, stride))
    return np.unique(np.clip(np.concatenate(parts), 0, n)).astype(np.int64)
