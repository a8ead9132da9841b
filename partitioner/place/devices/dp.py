"""The dynamic program of the device-list search (search.py): stages, replicas and tensor degrees over D devices.

A suffix DP over (devices left k, class of the stage before, stages left q, first cut i): a stage
takes r replicas of t devices each (t = 1 unless its Degrees give split ones:
devices/tensor.py), the next r t devices, and a next cut j; its value is devices/search.py's W (or, for the
error that names what would fit, its memory over its capacity). `_walk` reads the chosen cuts,
replicas and degrees back.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from partitioner.place.devices.tensor import TensorPricer
from partitioner.place.devices.windows import Classes, Windows
from partitioner.place.search.problem import SearchProblem, Window
from partitioner.place.search.stage_costs import Grid, replica_in_flight, stage_parts

__all__: list[str] = []

# By devices left, per class of the stage before: (replicas, next cut, tensor degree) per (stages, cut).
Choice = dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]

# (first device, replicas, tensor degree, devices of the stage before, rows, cols, micro-batches held) -> values
Matrix = Callable[[int, int, int, int, slice, slice, np.ndarray], np.ndarray]


def dp(
    D: int, K: int, qmax: int, rmax: int, matrix: Matrix, schedule: str, m: int, classes: Classes,
    limit: Callable[[int], float] | None = None, exact_stages: bool = False, degrees: Sequence[int] = (1,),
) -> tuple[np.ndarray, Choice]:
    """Suffix DP: f[k][c, q, i] = smallest max stage value covering cuts[i].. with q stages on the last k
    devices, after a stage of as many devices as class c of `classes[k]`.

    `matrix(w, r, t, before, rows, cols, needs)` gives the value of a stage [cuts[i], cuts[j]) of r replicas of t
    devices from device w, after a stage of `before` devices, holding needs[x] micro-batches in flight: shape
    (1 or len(needs), rows, cols). A state is dropped when one with fewer stages is no worse (fewer stages never
    hold more in flight), or when its value reaches `limit(stages)` (already beaten: exact pruning). Degrees are
    tried in order, and a later one wins only where it is strictly better.
    """
    f: dict[int, np.ndarray] = {}
    alive: dict[int, np.ndarray] = {}
    choice: Choice = {}
    held = {r: np.array([replica_in_flight(schedule, q, m, r) for q in range(1, qmax + 1)])  # by q - 1
            for r in range(1, min(D, rmax) + 1)}
    for k in range(1, D + 1):
        rows = slice(0, 1) if k == D else slice(1, K - 1)
        reps, _, groups = classes[k]
        fk = np.full((len(reps), qmax + 1, K), np.inf)
        best_r = np.zeros(fk.shape, dtype=np.int32)
        best_j = np.zeros(fk.shape, dtype=np.int32)
        best_t = np.ones(fk.shape, dtype=np.int32)
        for t in degrees:
            for r in range(1, min(k // t, rmax) + 1):
                rest = k - r * t
                if rest == 0:
                    cols, qs, base = slice(K - 1, K), np.array([1]), np.zeros((1, 1))
                else:
                    after = classes[rest][1][r * t]  # the next stage comes after this one's r t devices
                    cols = slice(1, K - 1)
                    qs = np.flatnonzero(alive[rest][after, 1:qmax]) + 2  # q - 1 >= 1 stages after this one
                    if not len(qs):
                        continue
                    base = f[rest][after, qs - 1, cols]
                flight = held[r][qs - 1]
                for group in groups[r * t]:  # classes pricing this stage alike share one matrix
                    cand = np.maximum(matrix(D - k, r, t, reps[group[0]], rows, cols, flight), base[:, None, :])
                    j = cand.argmin(axis=2)
                    val = np.take_along_axis(cand, j[:, :, None], axis=2)[:, :, 0]
                    for c in group:
                        cur = fk[c, qs, rows]
                        better = val < cur
                        fk[c, qs, rows] = np.where(better, val, cur)
                        best_r[c, qs, rows] = np.where(better, r, best_r[c, qs, rows])
                        best_j[c, qs, rows] = np.where(better, j + cols.start, best_j[c, qs, rows])
                        best_t[c, qs, rows] = np.where(better, t, best_t[c, qs, rows])
        if not exact_stages:
            fewer = np.minimum.accumulate(fk, axis=1)
            fk[:, 1:][fewer[:, :-1] <= fk[:, 1:]] = np.inf
        if limit is not None:
            fk[fk >= np.array([limit(q + (k < D)) for q in range(qmax + 1)])[None, :, None]] = np.inf
        f[k], alive[k] = fk, np.isfinite(fk).any(axis=2)
        choice[k] = (best_r, best_j, best_t)
    return f[D][0, :, 0], choice


def run_pass(
    problem: SearchProblem, grid: Grid, windows: Windows, classes: Classes, m: int, qmax: int, rmax: int, mode: str,
    exact_stages: bool, limit: Callable[[int], float] | None = None, ratio: bool = False,
    tensor: TensorPricer | None = None,
) -> tuple[np.ndarray, Choice]:
    """One DP on `grid` for m micro-batches: max W with memory as a limit, or (ratio) max memory / capacity;
    with `tensor` (its pricer on the same cuts), stages may also split over its degrees."""
    cache: dict[tuple[int, int, Window, int, int], tuple[np.ndarray, ...]] = {}

    def matrix(w: int, r: int, t: int, before: int, rows: slice, cols: slice, needs: np.ndarray) -> np.ndarray:
        if t == 1:
            window, index = windows[w, r, before], 0
        else:
            assert tensor is not None  # degrees > 1 come from it
            window, index = tensor.window(t, w, r, windows[w, r * t, before])
        key = (t, index, window, rows.start, cols.start)
        if key not in cache:
            if t == 1:
                work, static, flight = stage_parts(problem, grid, window, m, rows, cols)
            else:
                assert tensor is not None
                work, static, flight = tensor.parts(t, index, window, m, rows, cols)
            fits = not ratio and bool((static + math.ceil(m / r) * flight <= window[-1]).all())
            cache[key] = (work,) if fits else (work, static, flight)
        if len(cache[key]) == 1:
            return cache[key][0][None]
        work, static, flight = cache[key]
        used = static[None] + needs[:, None, None] * flight[None]
        if ratio:
            with np.errstate(divide="ignore", invalid="ignore"):
                return np.where(np.isfinite(work)[None], np.nan_to_num(used / window[-1], nan=np.inf), np.inf)
        return np.where(used <= window[-1], work[None], np.inf)

    degrees = tensor.space.tensors if tensor is not None else (1,)
    return dp(problem.devices, len(grid.cuts), qmax, rmax, matrix, mode, m, classes, limit, exact_stages, degrees)


def walk(choice: Choice, classes: Classes, D: int, q: int) -> tuple[list[int], list[int], list[int]]:
    """Cut indices, replicas and tensor degrees of the best suffix from (D devices, q stages, cut 0)."""
    idx, reps, tensors, k, i, c = [0], [], [], D, 0, 0
    while k > 0:
        r, j, t = (int(x[c, q, i]) for x in choice[k])
        reps.append(r)
        tensors.append(t)
        idx.append(j)
        k, q, i = k - r * t, q - 1, j
        c = classes[k][1][r * t] if k > 0 else 0
    return idx, reps, tensors


def units(windows: Windows, qmax: int, rmax: int, degrees: Sequence[int] = (1,)) -> int:
    """DP cost of one pass in units of K^2: q values per (devices left, replicas, degree), plus stage matrices
    (counted for a stage after one device, so the grid is that of a DP without classes; the classes add their
    share)."""
    D = max(w for w, _, _ in windows) + 1
    loops = sum(max(1, min(k - r * t, qmax - 1)) for t in degrees for k in range(1, D + 1)
                for r in range(1, min(k // t, rmax) + 1))
    stages = len({v for (w, r, before), v in windows.items() if r <= rmax and before <= 1})
    split = sum(1 for t in degrees[1:] for (w, r, before) in windows if r % t == 0 and r // t <= rmax and before <= 1)
    return loops + 12 * (stages + split)
