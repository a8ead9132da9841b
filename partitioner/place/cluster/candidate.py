"""One configuration of the cluster search priced: its stage windows, its values over a grid of cuts, its DP, its cuts.

A candidate (cluster/space.py: counts, rank order, cuts, tensor degree, sharding) is priced on the windows
its ranks give each stage (`windows`: links to its neighbours and all-reduce, by where they sit), over a
grid of cut candidates (`Pricer`: W and memory of every stage [cuts[i], cuts[j]) at once, search/stage_costs.py
or, sharded, search/split_costs.py), and its cuts are the DP's (`dp`: the smallest max W over stages).
`refine` zooms in around chosen cuts, `solve_candidate` turns a candidate into a ClusterSolution, and
`evaluate_cluster` prices given cuts: what cluster/search.py's loop, cluster/look.py's second look and
cluster/fixed.py call. The step is fill(m, p, d) * max W (`fill`: cluster/search.py's docstring).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from cost_model.cluster_shape import Cluster
from partitioner.place.cluster.space import (
    Axes,
    Candidate,
    ClusterSolution,
    cheapest_modes,
    layout,
)
from partitioner.place.search.compare import SCHEDULES, kept_schedule
from partitioner.place.search.degrees import TensorDegree
from partitioner.place.search.graph_costs import affine
from partitioner.place.search.infeasible import Held
from partitioner.place.search.problem import SearchProblem, Window
from partitioner.place.search.split_costs import SplitGrid, split_parts
from partitioner.place.search.stage_costs import Grid, replica_in_flight, schedule_fill, stage_parts
from partitioner.place.search.virtual_stages import interleaved_chunks, scaled_windows
from rules.generators import interleaved_fill

__all__ = [
    "Pricer", "dp", "evaluate_cluster", "fill", "refine", "slowest_pair", "solve_candidate", "space_of", "windows",
]

ROOM = 400  # extra cut candidates per refinement


def slowest_pair(cluster: Cluster, src: Sequence[int], dst: Sequence[int]) -> tuple[int, int]:
    """The pair (src[j], dst[j]) on the slowest link: one across hosts where there is one."""
    a, b = np.asarray(src), np.asarray(dst)
    cross = np.flatnonzero(a // cluster.gpus_per_host != b // cluster.gpus_per_host)
    j = int(cross[0]) if len(cross) else 0
    return int(a[j]), int(b[j])


def _link(cluster: Cluster, src: Sequence[int], dst: Sequence[int]) -> tuple[float, ...]:
    return affine(cluster.transfer_time, *slowest_pair(cluster, src, dst))


def windows(cluster: Cluster, ranks: Sequence[Sequence[int]], capacity: float) -> list[Window]:
    """Each stage's Window (devices/windows.py) on `ranks`: links to its neighbours, all-reduce, by where they sit."""
    p, out = len(ranks), list[Window]()
    for s, own in enumerate(ranks):
        recv = _link(cluster, ranks[s - 1], own) if s > 0 else None
        send = _link(cluster, own, ranks[s + 1]) if s + 1 < p else None
        reduce = affine(cluster.allreduce_time, list(own)) if len(own) > 1 else None
        out.append((len(own), (0,), recv, send, reduce, capacity))
    return out


class Pricer:
    """Stage value matrices on one cut grid, cached by window, micro-batches and sharding (equal keys, equal costs)."""

    def __init__(self, problem: SearchProblem, cuts: np.ndarray, space: Axes | None = None,
                 split: TensorDegree | None = None) -> None:
        self.problem, self.cuts, self.space = problem, cuts, space
        self.holds = split.holds_a_group(cuts) if split is not None else None
        if space is None or space.rule is None:
            self.grid: Grid = Grid(problem, cuts)
        else:
            blocks = space.blocks if space.blocks is not None else np.full(problem.n, -1)
            share = space.share if space.share is not None else np.full(problem.n, 1 / 3)
            self.grid = SplitGrid(problem, cuts, blocks, share)
        self.K = len(cuts)
        self._parts: dict[tuple[Window, int, str], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def parts(self, window: Window, m: int, sharding: str = "none") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if (key := (window, m, sharding)) not in self._parts:
            full = slice(0, self.K)
            if isinstance(self.grid, SplitGrid) and self.space is not None and self.space.rule is not None:
                self._parts[key] = split_parts(self.problem, self.grid, window, m, full, full, sharding,
                                               self.space.rule)
            else:
                self._parts[key] = stage_parts(self.problem, self.grid, window, m, full, full)
            if self.holds is not None:  # a stage of a split plan splits a group at least
                work, static, flight = self._parts[key]
                self._parts[key] = (np.where(self.holds, work, np.inf), static, flight)
        return self._parts[key]

    def values(self, wins: Sequence[Window], m: int, schedule: str, memory: bool = False,
               sharding: str = "none", virtual: int = 1) -> list[np.ndarray]:
        """Per stage, W (or, with `memory`, bytes per replica) of [cuts[i], cuts[j]); inf where it does not fit.
        `virtual` > 1: v chunks per rank, interleaved (search/virtual_stages.py; `wins` already scaled)."""
        p, out = len(wins), []
        made: dict[tuple[Window, int], np.ndarray] = {}  # stages alike in window and micro-batches held
        io = self._io(m) if virtual > 1 else 0.0
        for s, window in enumerate(wins):
            count = self._in_flight(s, p, window, m, schedule, virtual)
            if (window, count) not in made:
                work, static, flight = self.parts(window, m, sharding)
                used = static + self._activations(flight, io, count, virtual)
                if memory:
                    made[window, count] = np.where(np.isfinite(work), used, np.inf)
                else:
                    made[window, count] = np.where(used <= window[-1], work, np.inf)
            out.append(made[window, count])
        return out

    def held(self, wins: Sequence[Window], m: int, schedule: str, idx: Sequence[int], sharding: str = "none",
             virtual: int = 1) -> list[Held]:
        """What each stage [cuts[idx[s]], cuts[idx[s + 1]]) holds per GPU, by kind (the parts `values` adds)."""
        out, io = [], self._io(m)
        for s, window in enumerate(wins):
            count = self._in_flight(s, len(wins), window, m, schedule, virtual)
            _, static, flight = self.parts(window, m, sharding)
            i, j = idx[s], idx[s + 1]
            activations = self._activations(flight[i, j], io[i, j], count, virtual)
            out.append(Held(s, float(static[i, j]), float(activations), count, virtual))
        return out

    @staticmethod
    def _in_flight(s: int, p: int, window: Window, m: int, schedule: str, virtual: int) -> int:
        """Micro-batches (chunks, interleaved) stage s of p holds at its peak."""
        if virtual > 1:
            return interleaved_chunks(p - s, p, m // window[0], virtual)
        return replica_in_flight(schedule, p - s, m, window[0])

    def _io(self, m: int) -> np.ndarray:
        """Boundary bytes (received and sent) one micro-batch of m holds, per stage [cuts[i], cuts[j])."""
        out: np.ndarray = (self.grid.recv + self.grid.send) / m
        return out

    @staticmethod
    def _activations(flight: Any, io: Any, count: int, virtual: int) -> Any:
        """Bytes `count` micro-batches in flight hold (`flight` each, `io` of it boundary values; arrays or numbers);
        interleaved, a chunk saves 1/v of the stage's activations and its own boundary values."""
        if virtual > 1:
            return count / virtual * (flight - io) + count * io
        return count * flight


def fill(m: int, p: int, d: int, schedule: str = "1f1b", virtual: int = 1) -> float:
    """Step / max W for p stages of d equal replicas each over m micro-batches (module docstring): the
    schedule's `fill` (rules.schedules) for one pipeline of m / d micro-batches; with v = `virtual` chunks
    per rank, interleaved 1F1B's (search/virtual_stages.py)."""
    if virtual > 1:
        return interleaved_fill(max(1, m // d), p, virtual)
    return schedule_fill(schedule)(max(1, m // d), p)


def dp(values: Sequence[np.ndarray]) -> tuple[float, list[int]]:
    """min over cuts of max over stages of values[s][i, j]; stage 0 starts at cut 0, the last ends at cut K - 1."""
    K = values[0].shape[0]
    f, back = values[0][0].copy(), []
    cols = np.arange(K)
    for v in values[1:]:
        cand = np.maximum(f[:, None], v)
        j = cand.argmin(axis=0)
        back.append(j)
        f = cand[j, cols]
    idx = [K - 1]
    for j in reversed(back):
        idx.append(int(j[idx[-1]]))
    idx.append(0)
    return float(f[K - 1]), idx[::-1]


def solve_candidate(space: Axes | SearchProblem, cluster: Cluster, candidate: Candidate,
                    schedules: Sequence[str] = SCHEDULES, virtual: int = 1) -> ClusterSolution:
    """The ClusterSolution of one candidate: its schedule as search.compare keeps one (interleaved 1F1B with `virtual`
    > 1 chunks per rank); each stage's sharding mode: cluster.space.cheapest_modes."""
    space = space_of(space)
    m, d, order, bounds, t, sharding = candidate[1:]
    ranks = layout(len(bounds) - 1, d, order, t)
    problem = space.degree(t).problem
    wins = scaled_windows(windows(cluster, ranks, float(problem.capacity.min())), virtual)
    schedule = "interleaved" if virtual > 1 else kept_schedule(
        schedules, lambda name: evaluate_cluster(space, wins, bounds, m, name, t, sharding)[0::2])
    priced = {x: evaluate_cluster(space, wins, bounds, m, schedule, t, x, virtual) for x in space.modes_for(d)}
    modes = cheapest_modes({x: found[1:] for x, found in priced.items()}, sharding, float(problem.capacity.min()))
    final, work, memory = (priced[sharding] if all(x == sharding for x in modes)  # the configuration's: not redone
                           else evaluate_cluster(space, wins, bounds, m, schedule, t, modes, virtual))
    return ClusterSolution(list(bounds), ranks, order, m, schedule, final, work, memory, tensor=t, sharding=sharding,
                           virtual=virtual, stage_sharding=modes)


def refine(space: Axes | SearchProblem, cluster: Cluster, best: Candidate, coarse: np.ndarray,
           mode: str, virtual: int = 1) -> Candidate:
    """Zoom in around the chosen cuts (every `finer`-th position within `stride` of each), for the chosen counts."""
    space = space_of(space)
    step, m, d, order, bounds, t, sharding = best
    split = space.degree(t)
    capacity = float(split.problem.capacity.min())
    wins = scaled_windows(windows(cluster, layout(len(bounds) - 1, d, order, t), capacity), virtual)
    stride = int(np.diff(coarse).max()) if len(coarse) > 1 else 1
    while stride > 1:
        finer = max(1, math.ceil(2 * stride * len(bounds) / ROOM))
        if finer >= stride:
            break
        around = [np.arange(b - stride, b + stride + 1, finer) for b in bounds]
        cuts = split.allowed(np.unique(np.clip(np.concatenate([coarse, *around]), 0, split.problem.n)).astype(np.int64))
        value, idx = dp(Pricer(split.problem, cuts, space, split).values(wins, m, mode, sharding=sharding,
                                                                            virtual=virtual))
        found = fill(m, len(bounds) - 1, d, mode, virtual) * value
        if found < step:
            step, bounds = found, [int(cuts[i]) for i in idx]
        coarse, stride = cuts, finer
    return Candidate(step, m, d, order, bounds, t, sharding)


def evaluate_cluster(
    space: Axes | SearchProblem, wins: Sequence[Window], bounds: Sequence[int], m: int, schedule: str,
    tensor: int = 1, sharding: str | Sequence[str] = "none", virtual: int = 1,
) -> tuple[float, list[float], list[float]]:
    """Objective (s), W per stage and bytes per replica of given cuts on given windows (as devices.search.evaluate;
    `sharding`: one mode, or each stage's; `virtual` > 1: interleaved, the windows already scaled)."""
    space = space_of(space)
    cuts = np.asarray(bounds, dtype=np.int64)
    split = space.degree(tensor)
    pricer, p = Pricer(split.problem, cuts, space, split), len(wins)
    work, memory = [], []
    for s, window in enumerate(wins):
        mode = sharding if isinstance(sharding, str) else sharding[s]
        wk, static, flight = (x[s, s + 1] for x in pricer.parts(window, m, mode))
        work.append(float(wk))
        io = float(pricer.grid.recv[s, s + 1] + pricer.grid.send[s, s + 1]) / m  # a chunk's boundary values
        chunks = interleaved_chunks(p - s, p, m // window[0], virtual) if virtual > 1 else 0
        memory.append(float(static + chunks / virtual * (flight - io) + chunks * io) if virtual > 1 else
                      float(static + replica_in_flight(schedule, p - s, m, window[0]) * flight))
    return fill(m, p, wins[0][0], schedule, virtual) * max(work), work, memory


def space_of(space: Axes | SearchProblem) -> Axes:
    """`space` itself, or a problem's Axes with every layer whole."""
    return space if isinstance(space, Axes) else Axes.whole(space)


