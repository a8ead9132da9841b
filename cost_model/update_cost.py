"""Memory of asynchronous weight updates: the weight versions (and gradients) a stage keeps beyond a sync step.

A synchronous step holds each weight once and its gradient once (cost_model/memory.py counts
(2 + optimizer states) x P for a stage of P weight bytes). With no pipeline flush
(runtime/versions.py) the forwards read clones of the weights, so a stage holds more:

    update   versions alive          gradients alive              extra bytes
    sync     0                       1 (the step's)               0
    2bw      2 (batches t, t + 1)    2 (t awaiting its update,    3 P
                                        t + 1 accumulating)
    stash    p - s on stage s of p   1 (one backward at a time)   (p - s) P
             (one per micro-batch in flight, 1F1B)
"""

from __future__ import annotations

from typing import Literal

__all__ = ["version_bytes"]


def version_bytes(update: Literal["sync", "2bw", "stash"], *, param_bytes: int, stage: int, stages: int) -> int:
    """Bytes stage `stage` of `stages` holds for weight versions under `update`, beyond a synchronous step.

    Raises:
        ValueError: an unknown update rule.
    """
    if update == "sync":
        return 0
    if update == "2bw":
        return 3 * param_bytes
    if update == "stash":
        return (stages - stage) * param_bytes
    raise ValueError(f"update={update!r}; use 'sync', '2bw' or 'stash'")
