"""Interleaved 1F1B (Megatron-LM's virtual pipeline stages) as the cluster search prices it: v chunks per rank.

Each of the p ranks of a pipeline holds v chunks of its stage (rank k: chunks k, k + p, ..., Narayanan et al.,
SC'21, section 2.2.2, https://arxiv.org/abs/2104.04473), and Megatron-LM's schedule
(megatron/schedules.py, forward_backward_pipelining_with_interleaving) runs them so that, for n micro-batches
per pipeline (m / d):

    fill(n, p, v)          = (n + (p - 1) / v) / n        the bubble shrinks by v (the paper's eq. 2 over n)
    chunks in flight, s    = min(n v, 2 (p - s - 1) + (v - 1) p + 1)   its warmup forwards, plus the one running
    messages               = v x a stage's own per micro-batch (each crosses every rank boundary v times; the
                             wrap from the last rank to the first is left in the first rank's count)

The fill and the warm-up are rules.generators' (interleaved_fill, interleaved_warmup), beside the generator
that runs the schedule, and so is the rule that n be a multiple of p. A chunk saves 1/v of its stage's
activations and receives and sends a boundary value of its own, so memory in flight is chunks / v x the
stage's saved bytes + chunks x its boundary bytes (full recomputation keeps only the boundaries: chunks x
them). The runtime runs interleaving with one replica per stage only (rules.schedules "interleaved"), so the cluster
search prices v > 1 where a caller fixes it (cluster/fixed.py: a published run's configuration), and a plan
is not made of it.
"""

from __future__ import annotations

from typing import Sequence

from partitioner.errors import PartitionError
from partitioner.place.search.problem import Window
from rules.generators import interleaved_micro_batches, interleaved_warmup

__all__ = ["check_virtual", "interleaved_chunks", "scaled_windows"]


def interleaved_chunks(q: int, p: int, n: int, v: int) -> int:
    """Chunks rank p - q of p holds at its peak (q = p - s: the stage is q-th from the end): its warm-up forwards
    (rules.generators.interleaved_warmup, the generator's own count) and the one running, at most n v."""
    return min(n * v, interleaved_warmup(p - q, p, n, v) + 1)


def scaled_windows(wins: Sequence[Window], v: int) -> list[Window]:
    """Windows whose point-to-point links cost v times as much per micro-batch (v crossings each)."""
    if v == 1:
        return list(wins)
    out: list[Window] = []
    for r, kinds, recv, send, reduce, capacity in wins:
        out.append((r, kinds, tuple(v * x for x in recv) if recv is not None else None,
                    tuple(v * x for x in send) if send is not None else None, reduce, capacity))
    return out


def check_virtual(v: int, p: int, n: int) -> None:
    """Raise PartitionError unless v chunks per rank can run: v >= 1, and with v > 1 at least 2 ranks and n a
    multiple of p (Megatron-LM's condition)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise PartitionError(f"virtual_stages={v!r}; give a whole number of chunks per rank, 1 or more")
    if v > 1 and (p < 2 or interleaved_micro_batches(n, p, v) is not None):
        raise PartitionError(f"virtual_stages={v} needs 2 or more stages and micro-batches per pipeline ({n}) a "
                             f"multiple of the stages ({p}), as Megatron-LM's interleaved schedule does")
