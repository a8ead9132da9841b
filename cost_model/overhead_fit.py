"""The runtime's own time around ops, as lines that grow with the compute before it: a + b x ms.

On a CPU host the work between ops (Python, autograd set-up, posting a message) costs more after a
long op than after a short one: the op evicted what that work touches. Measured here with 2 gloo
ranks, a 128 KiB isend takes 0.06 ms after a 0.3 ms matmul loop and 0.18 ms after a 6 ms one (more
after memory-bound work). One constant per kind, fitted on plans of long ops, overprices a plan of
many short ones: the Inception net's branch placement (0.3-0.6 ms ops) pays 0.05 ms per op and
0.13 ms per send (medians) where the pipelines of the fidelity benchmark (2-6 ms ops) pay 0.2 and
0.3-0.5. Two lines, fitted from a traced step's events:

    "task"  per rank and step: its untraced time = a x its F/B/W ops + b x their measured ms
    "SEND"  per send: the sender's posting time = a + b x the measured ms of its compute op before it.
            Robust: the points are the medians (op ms, posting ms) of a run's sends after F, after B
            (after W); a send's mean is made by its tail (a rank descheduled on a loaded host), which
            differs from run to run and would set the whole line

A run's rows weigh 1 together. The rows are kept as normal equations [sum u u, sum u v, sum v v,
sum u y, sum v y] (`Calibration.lines`, decayed like the rest); `solve` draws b slightly to 0, so a run
whose ops all last alike gives the flat line through its mean, and never returns a falling line.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["RIDGE", "add", "price", "send_points", "solve", "task_rows"]

RIDGE = 0.01  # ms^2: b is drawn to 0 as if every point had this much more spread in its op ms
Row = tuple[tuple[float, float], float]  # ((u, v), y)
Events = Sequence[Mapping[str, Any]]


def task_rows(ranks: Iterable[Events], compute: Iterable[str]) -> list[Row]:
    """((ops, their ms), untraced ms) of each rank's events of a step (sorted by start; `compute`: F/B/W kinds)."""
    kinds = set(compute)
    rows = []
    for events in ranks:
        if not events:
            continue
        ops = [float(e["end"]) - float(e["start"]) for e in events if e.get("kind") in kinds]
        span = max(float(e["end"]) for e in events) - float(events[0]["start"])
        untraced = span - sum(float(e["end"]) - float(e["start"]) for e in events)
        if ops:
            rows.append(((float(len(ops)), sum(ops)), max(0.0, untraced)))
    return rows


def send_points(ranks: Iterable[Events], compute: Iterable[str]) -> list[Row]:
    """((1, median ms of the op before), median posting ms) of the sends after each compute kind."""
    kinds = set(compute)
    after: dict[str, list[tuple[float, float]]] = {}
    for events in ranks:
        last: tuple[str, float] | None = None
        for e in events:
            length = float(e["end"]) - float(e["start"])
            if e.get("kind") in kinds:
                last = (str(e["kind"]), length)
            elif e.get("kind") == "send" and last is not None:
                after.setdefault(last[0], []).append((last[1], length))
    return [((1.0, statistics.median(ms for ms, _ in pairs)), statistics.median(post for _, post in pairs))
            for _, pairs in sorted(after.items())]


def add(eq: Sequence[float], rows: Sequence[Row], decay: float = 1.0) -> list[float]:
    """`eq` (or zeros) times `decay`, with `rows` added, weighing 1 together."""
    out = [x * decay for x in eq] if eq else [0.0] * 5
    w = 1.0 / len(rows) if rows else 0.0
    for (u, v), y in rows:
        out[0] += w * u * u
        out[1] += w * u * v
        out[2] += w * v * v
        out[3] += w * u * y
        out[4] += w * v * y
    return out


def solve(eq: Sequence[float]) -> tuple[float, float] | None:
    """(a, b) of y = a u + b v from normal equations (b >= 0, drawn to 0 by RIDGE); None without data."""
    if len(eq) != 5 or eq[0] <= 0:
        return None
    uu, uv, vv, uy, vy = eq
    ridge = RIDGE * uu
    det = uu * (vv + ridge) - uv * uv
    b = (uu * vy - uv * uy) / det if det > 0 else 0.0
    if b <= 0:
        return uy / uu, 0.0
    return (uy - uv * b) / uu, b


def price(line: tuple[float, float] | None, ms: float, default: float) -> float:
    """The overhead after (or around) `ms` of compute: the line's, never below 0; `default` without a line."""
    return default if line is None else max(0.0, line[0] + line[1] * ms)
