"""Hybrid planning, the numbers: stages, replicas per stage, micro-batches and schedule for D devices.

(partitioner/place/graph_costs.py turns a graph and a cost model into these numbers, HybridProblem in hybrid_problem.py;
partitioner/place/hybrid_plan.py turns the result into a Plan; stage_costs.py prices one stage.)

Devices are an ordered list; a stage with r replicas takes the next r of them (ranks are
device positions). For m micro-batches a stage [a, b) on devices w .. w+r-1 has, per step:

    T   = max over its devices of compute(a, b; m) + 2 * (recv + send)      one micro-batch
    W   = ceil(m / r) * T + allreduce(param bytes of [a, b) over its r devices)
    mem = (2 + k) * P + f * (A + R + S) + 2 * (R + S) + 3 * O      per replica;
          f = ceil(m / r) (GPipe) or min(p - s, ceil(m / r)) (1F1B: each replica runs its own with
          equal replica counts; an upper bound on the dealt list otherwise) micro-batches in flight,
          O = the largest node output of the stage for one micro-batch: an upper bound on what
          one backward holds beyond the kept activations (its gradients, the loss of the last
          stage), so a plan that fits here fits cost_model/memory.py's finer count (assemble)

    step = (m + p - 1) / m * max over stages of W

f and the step's factor are the schedule's closed forms (`in_flight` and `fill` of its
ScheduleSpec, rules.schedules); the searches plan the schedules that have a `fill`.

compute(a, b; m) = fixed + whole-batch / m per node: the graph describes one step's whole
batch, and each node's time is fitted as overhead plus a part that splits with the batch.
R, S, A (bytes received, sent, saved) are whole-batch bytes / m; A is what autograd saves
(cost_model.recompute_cost.saved_bytes_per_node), not every node's output.

Transfers into a stage are priced per sender and receiver (partitioner/place/hybrid_windows.py): on
the slowest pair of its devices and the stage before's, as the simulator prices a message, so a
stage on one host receiving from replicas on two hosts pays the link between them; out of it, on
the slowest link to the next stage's first device. The stage before's replica count, grouped into
the classes that price the receive alike (one on a host, two or three over hosts), is part of the
DP state.

A dynamic program over (devices left k, class before, stages left q, first cut a) finds, for every stage
count, the split and replicas with the smallest max W whose every stage fits its devices'
memory (the smallest capacity among its replicas); m and p then minimize the step. At the
same predicted time 1F1B never holds more than GPipe, so GPipe is kept only where it holds
as little. Cut candidates are compressed to a work budget, then refined around the chosen cuts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from partitioner.errors import PartitionError
from partitioner.place.hybrid_problem import HybridProblem
from partitioner.place.hybrid_windows import (
    Classes,
    Window,
    Windows,
    all_windows,
    receive_classes,
    restrict,
    stage_window,
)
from partitioner.place.stage_costs import Grid, cut_candidates, replica_in_flight, schedule_fill, stage_parts
from rules.schedules import searched_names

__all__ = [
    "SCHEDULES", "HybridSolution", "InfeasibleError", "evaluate", "micro_batch_counts", "solve_hybrid",
]

SCHEDULES = searched_names()  # the default: the built-ins with a `fill` (rules.schedules); checks read the registry
PER_DEVICE = 4  # default micro-batch counts go up to this many per device (and multiples of replica counts)
WORK_BUDGET = 1e8  # DP work of the first pass over all micro-batch counts; sets how many cut candidates fit


class InfeasibleError(PartitionError):
    """No split of the devices keeps every stage within its devices' memory."""

    def __init__(self, message: str, needed_bytes: list[int], note: str = "") -> None:
        super().__init__(f"{message} {note}" if note else message)
        self.needed_bytes = needed_bytes  # per device, under the split that needs the least
        self.note = note  # what else would fit (another training precision), or ""


@dataclass
class HybridSolution:
    """A chosen configuration and its predicted costs."""

    bounds: list[int]  # [0, b1, ..., n]
    replicas: list[int]
    micro_batches: int
    schedule: str
    step_s: float
    work_s: list[float]  # W per stage
    memory: list[float]  # bytes per replica of each stage


# By devices left, per class of the stage before: (replicas, next cut) per (stages, cut).
Choice = dict[int, tuple[np.ndarray, np.ndarray]]


Matrix = Callable[[int, int, int, slice, slice, np.ndarray], np.ndarray]


def _dp(
    D: int, K: int, qmax: int, rmax: int, matrix: Matrix, schedule: str, m: int, classes: Classes,
    limit: Callable[[int], float] | None = None, exact_stages: bool = False,
) -> tuple[np.ndarray, Choice]:
    """Suffix DP: f[k][c, q, i] = smallest max stage value covering cuts[i].. with q stages on the last k
    devices, after a stage whose replica count is of class c (`classes[k]`).

    `matrix(w, r, before, rows, cols, needs)` gives the value of a stage [cuts[i], cuts[j]) on devices
    w .. w+r-1 after a stage of `before` replicas, holding needs[x] micro-batches in flight: shape
    (1 or len(needs), rows, cols). A state is dropped when one with fewer stages is no worse (fewer
    stages never hold more in flight), or when its value reaches `limit(stages)` (already beaten:
    exact pruning).
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
        for r in range(1, min(k, rmax) + 1):
            rest = k - r
            if rest == 0:
                cols, qs, base = slice(K - 1, K), np.array([1]), np.zeros((1, 1))
            else:
                after = classes[rest][1][r]  # the next stage comes after this one's r replicas
                cols = slice(1, K - 1)
                qs = np.flatnonzero(alive[rest][after, 1:qmax]) + 2  # q - 1 >= 1 stages after this one
                if not len(qs):
                    continue
                base = f[rest][after, qs - 1, cols]
            flight = held[r][qs - 1]
            for group in groups[r]:  # classes pricing this stage alike share one matrix
                cand = np.maximum(matrix(D - k, r, reps[group[0]], rows, cols, flight), base[:, None, :])
                j = cand.argmin(axis=2)
                val = np.take_along_axis(cand, j[:, :, None], axis=2)[:, :, 0]
                for c in group:
                    cur = fk[c, qs, rows]
                    better = val < cur
                    fk[c, qs, rows] = np.where(better, val, cur)
                    best_r[c, qs, rows] = np.where(better, r, best_r[c, qs, rows])
                    best_j[c, qs, rows] = np.where(better, j + cols.start, best_j[c, qs, rows])
        if not exact_stages:
            fewer = np.minimum.accumulate(fk, axis=1)
            fk[:, 1:][fewer[:, :-1] <= fk[:, 1:]] = np.inf
        if limit is not None:
            fk[fk >= np.array([limit(q + (k < D)) for q in range(qmax + 1)])[None, :, None]] = np.inf
        f[k], alive[k] = fk, np.isfinite(fk).any(axis=2)
        choice[k] = (best_r, best_j)
    return f[D][0, :, 0], choice


def _pass(
    problem: HybridProblem, grid: Grid, windows: Windows, classes: Classes, m: int, qmax: int, rmax: int, mode: str,
    exact_stages: bool, limit: Callable[[int], float] | None = None, ratio: bool = False,
) -> tuple[np.ndarray, Choice]:
    """One DP on `grid` for m micro-batches: max W with memory as a limit, or (ratio) max memory / capacity."""
    cache: dict[tuple[Window, int, int], tuple[np.ndarray, ...]] = {}

    def matrix(w: int, r: int, before: int, rows: slice, cols: slice, needs: np.ndarray) -> np.ndarray:
        window = windows[w, r, before]
        key = (window, rows.start, cols.start)
        if key not in cache:
            work, static, flight = stage_parts(problem, grid, window, m, rows, cols)
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

    return _dp(problem.devices, len(grid.cuts), qmax, rmax, matrix, mode, m, classes, limit, exact_stages)


def _walk(choice: Choice, classes: Classes, D: int, q: int) -> tuple[list[int], list[int]]:
    """Cut indices and replicas of the best suffix from (D devices, q stages, cut 0)."""
    idx, reps, k, i, c = [0], [], D, 0, 0
    while k > 0:
        r, j = int(choice[k][0][c, q, i]), int(choice[k][1][c, q, i])
        reps.append(r)
        idx.append(j)
        k, q, i = k - r, q - 1, j
        c = classes[k][1][r] if k > 0 else 0
    return idx, reps


def micro_batch_counts(devices: int, batch: int | None, micro_batches: int | Sequence[int] | None = None) -> list[int]:
    """Micro-batch counts to try: given, else every count that fills some replica count evenly.

    The default is the counts up to `PER_DEVICE` per device that are a multiple c * r
    (c <= PER_DEVICE) of a replica count r <= devices, or a divisor of the batch, or a power
    of two: a stage with r replicas runs ceil(m / r) micro-batches per replica, so 15 + 1
    replicas want m = 15 or 30, not the 16 or 32 a power of two gives. Counts above the
    batch are dropped (the smallest is kept when none is left).
    """
    top = max(8, PER_DEVICE * devices)
    if micro_batches is None:
        ms = {c * r for r in range(1, devices + 1) for c in range(1, PER_DEVICE + 1)}
        ms |= {2**e for e in range(top.bit_length())} | {d for d in range(1, top + 1) if batch and batch % d == 0}
        ms = {m for m in ms if m <= top}
    else:
        ms = {micro_batches} if isinstance(micro_batches, int) else set(micro_batches)
    if not ms or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in ms):
        raise PartitionError(f"micro_batches={micro_batches!r}: give a positive integer or a list of them")
    kept = [m for m in ms if batch is None or m <= batch]
    return sorted(set(kept or [min(ms)]))


def _candidates(problem: HybridProblem, micro_batches: int | Sequence[int] | None) -> list[int]:
    return micro_batch_counts(problem.devices, problem.batch, micro_batches)


def _units(windows: Windows, qmax: int, rmax: int) -> int:
    """DP cost of one pass in units of K^2: q values per (devices left, replicas), plus stage matrices (counted
    for a stage after one device, so the grid is that of a DP without classes; the classes add their share)."""
    D = max(w for w, _, _ in windows) + 1
    loops = sum(max(1, min(k - r, qmax - 1)) for k in range(1, D + 1) for r in range(1, min(k, rmax) + 1))
    return loops + 12 * len({v for (w, r, before), v in windows.items() if r <= rmax and before <= 1})


def solve_hybrid(
    problem: HybridProblem,
    micro_batches: int | Sequence[int] | None = None,
    schedules: Sequence[str] = SCHEDULES,
    stages: int | None = None,
    replicate: bool = True,
    budget: float = WORK_BUDGET,
) -> HybridSolution:
    """The configuration with the smallest predicted step (see the module docstring).

    Raises:
        PartitionError: bad arguments; InfeasibleError when nothing fits in memory.
    """
    D, n = problem.devices, problem.n
    if not schedules or any(s not in searched_names() for s in schedules):
        raise PartitionError(f"schedules={list(schedules)!r}; use a non-empty subset of {list(searched_names())}")
    most = D if not replicate else min(D, n) if stages is None else stages
    if D < 1 or not 1 <= most <= min(D, n) or (not replicate and stages not in (None, D)) or isinstance(stages, bool):
        raise PartitionError(
            f"stages={stages}, replicate={replicate} on {D} devices and {n} compute nodes: use 1 .. {min(D, n)} stages "
            "(each needs a device and a node); replicate=False puts one stage on every device"
        )
    qmax = most
    ms = _candidates(problem, micro_batches)
    mode = "1f1b" if "1f1b" in schedules else schedules[0]
    fill = schedule_fill(mode)
    best: tuple[float, int, int, list[int], list[int]] | None = None
    windows = all_windows(problem, D if replicate else 1)
    rmax = {m: min(D, m) if replicate else 1 for m in ms}
    every = receive_classes(windows, D, D if replicate else 1)
    by_rmax: dict[int, Classes] = {}

    def classes(m: int) -> Classes:  # made for the counts a pass runs
        if rmax[m] not in by_rmax:
            by_rmax[rmax[m]] = restrict(every, rmax[m])
        return by_rmax[rmax[m]]

    def run(m: int, grid: Grid) -> None:
        nonlocal best

        def limit(q: int) -> float:  # a max W at or above this cannot beat the best step so far
            return np.inf if best is None else best[0] / fill(m, q) * (1 + 1e-12)

        finals, choice = _pass(problem, grid, windows, classes(m), m, qmax, rmax[m], mode, stages is not None, limit)
        for q in range(1, qmax + 1):
            step = fill(m, q) * finals[q]
            if (stages is None or q == stages) and np.isfinite(step) and (best is None or step < best[0]):
                idx, reps = _walk(choice, classes(m), problem.devices, q)
                best = (float(step), m, q, [int(grid.cuts[i]) for i in idx], reps)

    # Default counts, two passes: powers of two and divisors of the batch first; then the multiples
    # of the best layout's replica counts (15 + 1 replicas want m = 15 or 30), so the search prices a
    # few more counts, not every multiple of every replica count.
    first = ms if micro_batches is not None else [
        m for m in ms if m & (m - 1) == 0 or (problem.batch is not None and problem.batch % m == 0)] or ms
    floor = min(n + 1, max(64, 2 * qmax + 2))
    size = max(floor, int(math.sqrt(budget / sum(_units(windows, qmax, rmax[m]) for m in first))))
    coarse = Grid(problem, cut_candidates(problem, size))
    for m in first:
        run(m, coarse)
    if best is not None and first is not ms:
        fits = {c * r for r in set(best[4]) for c in range(1, PER_DEVICE + 1)}
        for m in sorted(fits & set(ms) - set(first)):
            run(m, coarse)
    stride = math.ceil(n / size)
    while best is not None and stride > 1:  # zoom in around the chosen cuts
        m, bounds = best[1], best[3]
        room = max(floor, int(math.sqrt(budget / 2 / _units(windows, qmax, rmax[m])))) - len(coarse.cuts)
        finer = max(1, math.ceil(2 * stride * len(bounds) / max(room, 1)))
        if finer >= stride:
            break
        run(m, Grid(problem, cut_candidates(problem, size, bounds, stride, finer)))
        stride = finer
    if best is None:
        raise _infeasible(problem, ms, qmax, rmax, stages, coarse, windows, classes, mode)
    _, m, _, bounds, reps = best
    schedule = mode
    same = (
        mode == "1f1b" and evaluate(problem, bounds, reps, m, "gpipe")[2] == evaluate(problem, bounds, reps, m, mode)[2]
    )
    if same and "gpipe" in schedules:  # same predicted time: GPipe only where it holds no more
        schedule = "gpipe"
    step, work, memory = evaluate(problem, bounds, reps, m, schedule)
    return HybridSolution(bounds, reps, m, schedule, step, work, memory)


def evaluate(
    problem: HybridProblem, bounds: Sequence[int], replicas: Sequence[int], m: int, schedule: str
) -> tuple[float, list[float], list[float]]:
    """Predicted step seconds, W per stage and bytes per replica of a given configuration."""
    cuts = np.asarray(bounds, dtype=np.int64)
    grid, p, w = Grid(problem, cuts), len(replicas), 0
    work, memory = [], []
    for s, r in enumerate(replicas):
        window = stage_window(problem, w, r, replicas[s - 1] if s else 0)
        wk, static, flight = stage_parts(problem, grid, window, m, slice(s, s + 1), slice(s + 1, s + 2))
        work.append(float(wk[0, 0]))
        memory.append(float(static[0, 0] + replica_in_flight(schedule, p - s, m, r) * flight[0, 0]))
        w += r
    return schedule_fill(schedule)(m, p) * max(work), work, memory


def _infeasible(
    problem: HybridProblem, ms: list[int], qmax: int, rmax: dict[int, int], stages: int | None, grid: Grid,
    windows: Windows, classes: Callable[[int], Classes], mode: str,
) -> InfeasibleError:
    """The error naming the memory each device would need under the split that needs the least."""
    D, best = problem.devices, None
    for m in ms:
        finals, choice = _pass(problem, grid, windows, classes(m), m, qmax, rmax[m], mode, stages is not None,
                               ratio=True)
        for q in range(1, qmax + 1):
            if (stages is None or q == stages) and np.isfinite(finals[q]) and (best is None or finals[q] < best[0]):
                idx, reps = _walk(choice, classes(m), D, q)
                best = (float(finals[q]), m, [int(grid.cuts[i]) for i in idx], reps)
    if best is None:
        return InfeasibleError(
            f"no split puts all {D} devices to work on {problem.n} compute nodes: every stage needs a node and at "
            f"most m replicas (micro_batches {ms}); allow more micro-batches, or pass fewer devices or stages={stages}",
            [],
        )
    _, m, bounds, reps = best
    memory = evaluate(problem, bounds, reps, m, mode)[2]
    needed = [int(math.ceil(x)) for x, r in zip(memory, reps) for _ in range(r)]
    names = problem.names or [f"device {d}" for d in range(D)]
    lines = [f"  {name}: needs {_size(x)} (has {_size(c)})" for name, x, c in zip(names, needed, problem.capacity)]
    return InfeasibleError(
        "the model fits on no split of these devices: every choice of stages, replicas and micro-batches "
        "puts some stage over its device's memory. The smallest memory each device would need "
        f"({len(reps)} stages, replicas {reps}, {m} micro-batches, {mode}):\n" + "\n".join(lines)
        + "\nFix: use devices with at least that much memory, add devices, or use an optimizer with fewer states "
        "(sgd).",
        needed,
    )


def _size(x: float) -> str:
    if not np.isfinite(x):
        return "no limit"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024 or unit == "GiB":
            return f"{x:.0f} B" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    return ""
