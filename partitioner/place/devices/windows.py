"""Stage windows of the device-list DP (devices/search.py): what a stage's costs depend on, by where it runs.

A stage on devices w .. w+r-1 after a stage of `before` replicas (devices w - before .. w-1) is priced
by its window: replicas, device kinds, receive link, send link, all-reduce ring, smallest capacity.
Equal windows, equal costs, so the DP prices each distinct window once.

The receive is priced per sender and receiver: micro-batch i travels from replica i % before of the
stage before to replica i % r, and a message is priced on the slowest pair of the two stages' devices,
as the simulator prices a message between two stages (partitioner/predict/counting.py `_message_ms`).
The send goes to the next stage's first device (its replicas are not known yet; its receive covers
every pair). Replica counts of the stage before that price a stage's receive alike form one class,
so the DP keeps one state per class (one on a host; two or three over hosts), not per count.
"""

from __future__ import annotations

import numpy as np

from partitioner.place.search.problem import LinkCost, SearchProblem, Window

__all__: list[str] = []

Windows = dict[tuple[int, int, int], Window]  # by (first device, replicas, replicas of the stage before; 0: none)
# By devices left k: a replica count of the stage before per class, each count's class (counts in one class
# give the stage at device D - k the same receive price whatever its own replicas), and per own replica
# count r the classes that price its receive alike (one group where the stage's own devices span hosts).
Classes = dict[int, tuple[list[int], dict[int, int], dict[int, list[list[int]]]]]


def stage_window(p: SearchProblem, w: int, r: int, before: int) -> Window:
    """What a stage's costs depend on when it runs on devices w .. w+r-1 after a stage of `before` replicas
    (on devices w - before .. w-1): equal keys, equal costs."""
    kinds = tuple(np.unique(p.device_kind[w : w + r]).tolist())
    recv = tuple(p.link[w - max(before, 1) : w, w : w + r].reshape(-1, 2).max(axis=0).tolist()) if w > 0 else None
    send = tuple(p.link[w : w + r, w + r].max(axis=0).tolist()) if w + r < p.devices else None
    reduce = tuple(p.allreduce[w, r].tolist()) if r > 1 else None
    return r, kinds, recv, send, reduce, float(p.capacity[w : w + r].min())


def all_windows(problem: SearchProblem, rmax: int) -> Windows:
    """Every stage window (w, r) after every replica count of the stage before (at most rmax, at most w)."""
    D, out = problem.devices, {}
    for w in range(D):
        for r in range(1, min(D - w, rmax) + 1):
            window = stage_window(problem, w, r, 1)
            if w == 0:
                out[w, r, 0] = window
                continue
            rows = problem.link[max(0, w - rmax) : w, w : w + r].max(axis=1)  # each sender's slowest receiver
            worst = np.maximum.accumulate(rows[::-1], axis=0)  # [b - 1]: over the last b senders
            for before in range(1, min(w, rmax) + 1):
                out[w, r, before] = (*window[:2], tuple(worst[before - 1].tolist()), *window[3:])
    return out


def receive_classes(windows: Windows, D: int, rmax: int) -> Classes:
    """Per devices left k: the replica counts of the stage before that price the receive of a stage at
    device D - k alike for every replica count of its own, grouped (see `Classes`)."""
    out: Classes = {}
    for k in range(1, D + 1):
        w = D - k
        reps: list[int] = []
        index: dict[int, int] = {}
        seen: dict[tuple[LinkCost, ...], int] = {}
        for before in [0] if w == 0 else range(1, min(w, rmax) + 1):
            key = tuple(windows[w, r, before][2] for r in range(1, min(k, rmax) + 1))
            if key not in seen:
                seen[key] = len(reps)
                reps.append(before)
            index[before] = seen[key]
        groups: dict[int, list[list[int]]] = {}
        for r in range(1, min(k, rmax) + 1):
            alike: dict[LinkCost, list[int]] = {}
            for c, before in enumerate(reps):
                alike.setdefault(windows[w, r, before][2], []).append(c)
            groups[r] = list(alike.values())
        out[k] = (reps, index, groups)
    return out


def restrict(classes: Classes, rmax: int) -> Classes:
    """`classes` for stages of at most `rmax` replicas: the classes some count up to rmax reaches, each with
    its smallest such count."""
    out: Classes = {}
    for k, (_, index, groups) in classes.items():
        kept = sorted({c for before, c in index.items() if before <= rmax})
        new = {c: i for i, c in enumerate(kept)}
        smallest = {c: min(b for b, x in index.items() if x == c and b <= rmax) for c in kept}
        out[k] = ([smallest[c] for c in kept], {b: new[c] for b, c in index.items() if b <= rmax},
                  {r: [[new[c] for c in g if c in new] for g in gs if any(c in new for c in g)]
                   for r, gs in groups.items() if r <= rmax})
    return out
