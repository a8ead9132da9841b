"""Bytes a stage receives and sends for every pair of cuts at once: what its boundary values cost, for every planner."""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["boundary_bytes"]


def boundary_bytes(
    producers: np.ndarray, consumers: Sequence[np.ndarray], value_bytes: np.ndarray, n: int, cuts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Bytes received (R) and sent (S) by a stage [cuts[i], cuts[j]), for every i, j.

    A value made at p (-1: a pipeline input) and read at c1 < c2 < ... (n: the model output)
    is received by [a, b) when p < a <= c < b for some c, and sent when a <= p < b <= its
    last reader (the model output counts as n - 1). Each condition is a rectangle in (a, b);
    2-D difference arrays add them all at once. Shared by the chain and both searches.
    """
    k = len(cuts)
    lengths = np.array([len(c) for c in consumers], dtype=np.int64)
    vid = np.repeat(np.arange(len(lengths)), lengths)
    cons = np.concatenate([np.zeros(0, dtype=np.int64), *consumers]).astype(np.int64)
    first = np.ones(len(cons), dtype=bool)
    first[1:] = vid[1:] != vid[:-1]
    prev = np.where(first, producers[vid], np.roll(cons, 1))  # the previous reader, or the producer
    inner = cons < n
    recv = _rectangles(cuts, prev[inner] + 1, cons[inner], cons[inner] + 1, np.full(inner.sum(), n),
                       value_bytes[vid[inner]])
    has = (lengths > 0) & (producers >= 0)
    last = np.array([c[-1] if len(c) else 0 for c in consumers], dtype=np.int64)[has]
    prod = producers[has]
    send = _rectangles(cuts, 0 * prod, prod, prod + 1, np.minimum(last, n - 1), value_bytes[has])
    return recv[:k, :k], send[:k, :k]


def _rectangles(
    cuts: np.ndarray, r0: np.ndarray, r1: np.ndarray, c0: np.ndarray, c1: np.ndarray, w: np.ndarray
) -> np.ndarray:
    """Sum of w over rectangles rows [r0, r1] x cols [c0, c1] (node positions), on the cut grid."""
    k = len(cuts)
    i0, i1 = np.searchsorted(cuts, r0, "left"), np.searchsorted(cuts, r1, "right") - 1
    j0, j1 = np.searchsorted(cuts, c0, "left"), np.searchsorted(cuts, c1, "right") - 1
    ok = (i0 <= i1) & (j0 <= j1) & (w != 0)
    i0, i1, j0, j1, w = i0[ok], i1[ok], j0[ok], j1[ok], w[ok]
    d = np.zeros((k + 1, k + 1))
    for rows, cols, sign in ((i0, j0, 1), (i0, j1 + 1, -1), (i1 + 1, j0, -1), (i1 + 1, j1 + 1, 1)):
        np.add.at(d, (rows, cols), sign * w)
    np.cumsum(d, axis=0, out=d)
    np.cumsum(d, axis=1, out=d)
    return d
