"""Collectives of one group of ranks: all-reduce, all-gather and reduce-scatter prices, and what overlap hides.

    all_reduce(b)       = a + s b        (a, s): the group's Ring, from Cluster.allreduce_time (affine in b
                                         for a fixed group: a ring inside a host, hierarchical across hosts)
    all_gather(b)       = reduce_scatter(b) = all_reduce(b) / 2
    exposed(c, h, f)    = max(c - h, f)  a collective of c seconds run beside h seconds of compute shows
                                         what h does not hide, never less than f: its last piece, which
                                         starts when the compute that makes it ends

b is the whole tensor per rank: what an all-reduce sums, what an all-gather ends with, what a
reduce-scatter starts from. A ring all-reduce is a reduce-scatter then an all-gather, (n - 1) steps
each over the same links, and the hierarchical one (reduce-scatter in hosts, all-reduce across,
all-gather in hosts) splits the same way, so each half costs half of it, latency included.
Numbers broadcast: b, c, h, f may be numpy arrays (the searches price every cut at once).

DDP_BUCKET_BYTES is torch.nn.parallel.DistributedDataParallel's default bucket_cap_mb=25: DDP
all-reduces a bucket as soon as backward has made its gradients, so only the last bucket's
all-reduce necessarily follows the backward.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from cost_model.cluster_shape import Cluster, Rank

__all__ = ["DDP_BUCKET_BYTES", "Ring", "all_gather", "all_reduce", "exposed", "reduce_scatter", "ring_of"]

Ring = tuple[float, float]  # (latency s, seconds per byte) of an all-reduce over one group
DDP_BUCKET_BYTES = 25 * (1 << 20)
_PROBE = float(1 << 20)


def ring_of(cluster: Cluster, ranks: Iterable[Rank]) -> Ring:
    """(latency, seconds per byte) of `cluster.allreduce_time(b, ranks)`; (0, 0) for one rank."""
    group = list(ranks)
    if len(group) <= 1:
        return 0.0, 0.0
    one, big = cluster.allreduce_time(1.0, group), cluster.allreduce_time(1.0 + _PROBE, group)
    slope = (big - one) / _PROBE
    return max(0.0, one - slope), max(0.0, slope)


def all_reduce(ring: Ring, nbytes: Any) -> Any:
    """Seconds to all-reduce `nbytes` per rank over the group (0 for nothing)."""
    latency, slope = ring
    out: Any = np.where(np.asarray(nbytes) > 0, latency + slope * np.asarray(nbytes, dtype=float), 0.0)
    return out if isinstance(nbytes, np.ndarray) else float(out)


def all_gather(ring: Ring, nbytes: Any) -> Any:
    """Seconds to all-gather a tensor of `nbytes` (gathered) over the group: half an all-reduce of it."""
    return 0.5 * all_reduce(ring, nbytes)


def reduce_scatter(ring: Ring, nbytes: Any) -> Any:
    """Seconds to reduce-scatter `nbytes` (each rank's input) over the group: half an all-reduce of it."""
    return 0.5 * all_reduce(ring, nbytes)


def exposed(comm: Any, hidden: Any, floor: Any) -> Any:
    """What of `comm` seconds shows beside `hidden` seconds of compute: max(comm - hidden, floor), floor <= comm."""
    out: Any = np.maximum(np.asarray(comm) - hidden, np.minimum(floor, comm))
    return out if isinstance(comm, np.ndarray) else float(out)
