"""The micro-batch counts a search tries: the ones given, else each search's defaults.

    device lists   multiples c * r (c <= PER_DEVICE) of every replica count r, divisors of the batch, powers of
                   two, up to PER_DEVICE per device: a stage of r replicas runs ceil(m / r) micro-batches each,
                   so 15 + 1 replicas want m = 15 or 30, not the 16 or 32 a power of two gives
    clusters       c * d (c <= PER_REPLICA) for every replica count d = GPUs / p, and the batch's divisors some
                   d divides: the cluster search deals m micro-batches to d equal replicas (d | m)

Counts above the batch are dropped in both (a micro-batch holds one sample at least).
"""

from __future__ import annotations

from typing import Sequence

from partitioner.errors import PartitionError

__all__ = ["PER_DEVICE", "PER_REPLICA", "cluster_counts", "given_counts", "micro_batch_counts"]

PER_DEVICE = 4  # device lists: default counts go up to this many per device (and multiples of replica counts)
PER_REPLICA = 4  # clusters: default counts go up to this many per replica


def given_counts(micro_batches: int | Sequence[int]) -> set[int]:
    """The counts a caller gave (one, or a list), checked.

    Raises:
        PartitionError: no count, or one that is not a positive integer.
    """
    ms = {micro_batches} if isinstance(micro_batches, int) else set(micro_batches)
    if not ms or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in ms):
        raise PartitionError(f"micro_batches={micro_batches!r}: give a positive integer or a list of them")
    return ms


def micro_batch_counts(devices: int, batch: int | None, micro_batches: int | Sequence[int] | None = None) -> list[int]:
    """Micro-batch counts the device-list search tries: given, else its defaults (module docstring), none above
    the batch (the smallest is kept when none is left)."""
    top = max(8, PER_DEVICE * devices)
    if micro_batches is None:
        ms = {c * r for r in range(1, devices + 1) for c in range(1, PER_DEVICE + 1)}
        ms |= {2**e for e in range(top.bit_length())} | {d for d in range(1, top + 1) if batch and batch % d == 0}
        ms = {m for m in ms if m <= top}
    else:
        ms = given_counts(micro_batches)
    kept = [m for m in ms if batch is None or m <= batch]
    return sorted(set(kept or [min(ms)]))


def cluster_counts(gpus: int, batch: int | None, stages_limit: int) -> list[int]:
    """Micro-batch counts the cluster search tries by default (module docstring), for every d = gpus / p with
    p <= stages_limit; none above the batch.

    Raises:
        PartitionError: the batch is too small for every replica count.
    """
    ds = [gpus // p for p in range(1, min(gpus, stages_limit) + 1) if gpus % p == 0]
    ms = {c * d for d in ds for c in range(1, PER_REPLICA + 1)}
    if batch:
        ms |= {x for x in range(1, batch + 1) if batch % x == 0 and any(x % d == 0 for d in ds)}
    kept = sorted(m for m in ms if batch is None or m <= batch)
    if not kept:
        raise PartitionError(f"a batch of {batch} samples cannot give each of {min(ds)} or more replicas of a stage a "
                             f"micro-batch on {gpus} GPUs; use a global batch of at least {min(ds)}, or fewer GPUs")
    return kept
