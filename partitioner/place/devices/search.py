"""The device-list search, the numbers: stages, replicas per stage, micro-batches and schedule for D devices.

(place/search/graph_costs.py turns a graph and a cost model into these numbers, SearchProblem in search/problem.py;
place/devices/plan.py turns the result into a Plan; search/stage_costs.py prices one stage.)

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

Transfers into a stage are priced per sender and receiver (partitioner/place/devices/windows.py): on
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

Given Degrees (search/degrees.py, made from the model's split groups by devices/split.py), a stage
may also split its layers over t ranks per replica: r replicas of degree t take the next r t devices,
priced on the model as each of its t ranks runs it; the DP (devices/dp.py) chooses t per stage, 1 at a tie.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from partitioner.errors import PartitionError
from partitioner.place.devices.dp import run_pass, units, walk
from partitioner.place.devices.solution import DeviceSolution
from partitioner.place.devices.tensor import TensorPricer
from partitioner.place.devices.windows import Classes, Windows, all_windows, receive_classes, restrict, stage_window
from partitioner.place.search.compare import SCHEDULES, kept_schedule, priced_schedule
from partitioner.place.search.counts import PER_DEVICE, micro_batch_counts
from partitioner.place.search.degrees import Degrees
from partitioner.place.search.infeasible import Held, InfeasibleError, held_text, size_text
from partitioner.place.search.problem import SearchProblem
from partitioner.place.search.stage_costs import Grid, cut_candidates, replica_in_flight, schedule_fill, stage_parts
from rules.schedules import searched_names

__all__ = ["evaluate", "solve_devices"]

WORK_BUDGET = 1e8  # DP work of the first pass over all micro-batch counts; sets how many cut candidates fit


def _candidates(problem: SearchProblem, micro_batches: int | Sequence[int] | None) -> list[int]:
    return micro_batch_counts(problem.devices, problem.batch, micro_batches)


def solve_devices(
    problem: SearchProblem,
    micro_batches: int | Sequence[int] | None = None,
    schedules: Sequence[str] = SCHEDULES,
    stages: int | None = None,
    replicate: bool = True,
    budget: float = WORK_BUDGET,
    tensor: Degrees | None = None,
) -> DeviceSolution:
    """The configuration with the smallest predicted step (see the module docstring).

    `tensor`: the degrees a stage may split its layers over (devices/tensor.py; None: every stage whole). A stage
    of r replicas and degree t takes r t devices; with replicate=False every stage keeps one device.

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
    mode = priced_schedule(schedules)
    fill = schedule_fill(mode)
    best: tuple[float, int, int, list[int], list[int], list[int]] | None = None
    windows = all_windows(problem, D if replicate else 1)
    rmax = {m: min(D, m) if replicate else 1 for m in ms}
    every = receive_classes(windows, D, D if replicate else 1)
    by_rmax: dict[int, Classes] = {}
    tensor = tensor if replicate and tensor is not None and tensor.splits else None
    degrees = tensor.tensors if tensor is not None else (1,)
    pricers: dict[int, tuple[Grid, TensorPricer]] = {}  # by id of a grid, kept alive so that ids stay unique

    def pricer(grid: Grid) -> TensorPricer | None:
        if tensor is None:
            return None
        if id(grid) not in pricers:
            pricers[id(grid)] = grid, TensorPricer(tensor, grid.cuts)
        return pricers[id(grid)][1]

    def classes(m: int) -> Classes:  # made for the counts a pass runs (a split stage may span every device)
        most = D if tensor is not None else rmax[m]
        if most not in by_rmax:
            by_rmax[most] = restrict(every, most)
        return by_rmax[most]

    def run(m: int, grid: Grid) -> None:
        nonlocal best

        def limit(q: int) -> float:  # a max W at or above this cannot beat the best step so far
            return np.inf if best is None else best[0] / fill(m, q) * (1 + 1e-12)

        finals, choice = run_pass(problem, grid, windows, classes(m), m, qmax, rmax[m], mode, stages is not None,
                                  limit, tensor=pricer(grid))
        for q in range(1, qmax + 1):
            step = fill(m, q) * finals[q]
            if (stages is None or q == stages) and np.isfinite(step) and (best is None or step < best[0]):
                idx, reps, tensors = walk(choice, classes(m), problem.devices, q)
                best = (float(step), m, q, [int(grid.cuts[i]) for i in idx], reps, tensors)

    # Default counts, two passes: powers of two and divisors of the batch first; then the multiples
    # of the best layout's replica counts (15 + 1 replicas want m = 15 or 30), so the search prices a
    # few more counts, not every multiple of every replica count.
    first = ms if micro_batches is not None else [
        m for m in ms if m & (m - 1) == 0 or (problem.batch is not None and problem.batch % m == 0)] or ms
    floor = min(n + 1, max(64, 2 * qmax + 2))
    size = max(floor, int(math.sqrt(budget / sum(units(windows, qmax, rmax[m], degrees) for m in first))))
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
        room = max(floor, int(math.sqrt(budget / 2 / units(windows, qmax, rmax[m], degrees)))) - len(coarse.cuts)
        finer = max(1, math.ceil(2 * stride * len(bounds) / max(room, 1)))
        if finer >= stride:
            break
        run(m, Grid(problem, cut_candidates(problem, size, bounds, stride, finer)))
        stride = finer
    if best is None:
        raise _infeasible(problem, ms, qmax, rmax, stages, coarse, windows, classes, mode, pricer(coarse))
    _, m, _, bounds, reps, tensors = best
    split = tensors if any(t > 1 for t in tensors) else None
    priced = {name: evaluate(problem, bounds, reps, m, name, split, tensor) for name in schedules}
    schedule = kept_schedule(schedules, lambda name: (priced[name][0], priced[name][2]), mode)
    step, work, memory = priced[schedule]
    return DeviceSolution(bounds, reps, m, schedule, step, work, memory, split or [])


def evaluate(
    problem: SearchProblem, bounds: Sequence[int], replicas: Sequence[int], m: int, schedule: str,
    tensors: Sequence[int] | None = None, space: Degrees | None = None,
) -> tuple[float, list[float], list[float]]:
    """Predicted step seconds, W per stage and bytes per replica of a given configuration (`tensors`: each
    stage's degree, priced by `space`; None: every stage whole)."""
    parts = _stages(problem, bounds, replicas, m, tensors, space)
    work = [wk for wk, _, _ in parts]
    memory = [static + replica_in_flight(schedule, len(parts) - s, m, r) * flight
              for s, ((_, static, flight), r) in enumerate(zip(parts, replicas))]
    return schedule_fill(schedule)(m, len(parts)) * max(work), work, memory


def held(
    problem: SearchProblem, bounds: Sequence[int], replicas: Sequence[int], m: int, schedule: str,
    tensors: Sequence[int] | None = None, space: Degrees | None = None,
) -> list[Held]:
    """What each stage's devices hold of `evaluate`'s memory: states and buffers, and the micro-batches in flight."""
    out = []
    for s, ((_, static, flight), r) in enumerate(zip(_stages(problem, bounds, replicas, m, tensors, space), replicas)):
        count = replica_in_flight(schedule, len(replicas) - s, m, r)
        out.append(Held(s, static, count * flight, count))
    return out


def _stages(
    problem: SearchProblem, bounds: Sequence[int], replicas: Sequence[int], m: int,
    tensors: Sequence[int] | None, space: Degrees | None,
) -> list[tuple[float, float, float]]:
    """(W, static bytes, bytes per micro-batch in flight) of each stage of a given configuration."""
    cuts = np.asarray(bounds, dtype=np.int64)
    grid, p, w = Grid(problem, cuts), len(replicas), 0
    degrees = list(tensors) if tensors is not None else [1] * p
    if any(t > 1 for t in degrees) and space is None:
        raise PartitionError(f"tensor degrees {degrees} need the Degrees that price them (devices/split.py)")
    pricer = TensorPricer(space, cuts) if space is not None and any(t > 1 for t in degrees) else None
    out = []
    for s, (r, t) in enumerate(zip(replicas, degrees)):
        rows, cols = slice(s, s + 1), slice(s + 1, s + 2)
        window = stage_window(problem, w, r * t, replicas[s - 1] * degrees[s - 1] if s else 0)
        if pricer is not None and t > 1:
            window, index = pricer.window(t, w, r, window)
            wk, static, flight = pricer.parts(t, index, window, m, rows, cols)
        else:
            wk, static, flight = stage_parts(problem, grid, window, m, rows, cols)
        out.append((float(wk[0, 0]), float(static[0, 0]), float(flight[0, 0])))
        w += r * t
    return out


def _infeasible(
    problem: SearchProblem, ms: list[int], qmax: int, rmax: dict[int, int], stages: int | None, grid: Grid,
    windows: Windows, classes: Callable[[int], Classes], mode: str, tensor: TensorPricer | None = None,
) -> InfeasibleError:
    """The error naming the memory each device would need under the split that needs the least."""
    D, best = problem.devices, None
    for m in ms:
        finals, choice = run_pass(problem, grid, windows, classes(m), m, qmax, rmax[m], mode, stages is not None,
                                  ratio=True, tensor=tensor)
        for q in range(1, qmax + 1):
            if (stages is None or q == stages) and np.isfinite(finals[q]) and (best is None or finals[q] < best[0]):
                idx, reps, tensors = walk(choice, classes(m), D, q)
                best = (float(finals[q]), m, [int(grid.cuts[i]) for i in idx], reps, tensors)
    if best is None:
        return InfeasibleError(
            f"no split puts all {D} devices to work on {problem.n} compute nodes: every stage needs a node and at "
            f"most m replicas (micro_batches {ms}); allow more micro-batches, or pass fewer devices or stages={stages}",
            [],
        )
    _, m, bounds, reps, tensors = best
    space = tensor.space if tensor is not None else None
    kinds = held(problem, bounds, reps, m, mode, tensors if space is not None else None, space)
    memory = [h.total for h in kinds]  # evaluate's memory, priced once
    needed = [int(math.ceil(x)) for x, r, t in zip(memory, reps, tensors) for _ in range(r * t)]
    names = problem.names or [f"device {d}" for d in range(D)]
    lines = [f"  {name}: needs {size_text(x)} (has {size_text(c)})"
             for name, x, c in zip(names, needed, problem.capacity)]
    return InfeasibleError(
        "the model fits on no split of these devices: every choice of stages, replicas and micro-batches "
        "puts some stage over its device's memory. The smallest memory each device would need "
        f"({len(reps)} stages, replicas {reps}{_degrees(tensors)}, {m} micro-batches, {mode}):\n" + "\n".join(lines)
        + f"\n{held_text(kinds, 'device')}"
        + "\nFix: use devices with at least that much memory, add devices, or use an optimizer with fewer states "
        "(sgd).",
        needed, held=kinds,
    )


def _degrees(tensors: Sequence[int]) -> str:
    return f", tensor {list(tensors)}" if any(t > 1 for t in tensors) else ""
