"""What a stage's data-parallel group costs a step by sharding mode, overlapped as DDP and FSDP2 overlap it.

P parameters per rank (after tensor parallelism), U those of one FSDP unit (a repeated block: FSDP2
gathers and reduces unit by unit, prefetching the next while one computes), c and g the bytes of
one compute and one gradient element (Precision), F and B one micro-batch's forward and backward
seconds on the stage, AR/AG/RS the group's collectives and exposed(c, h, f) = max(c - h, f)
(cost_model/collectives.py). [Note: sharding modes] in rules/sharding.py says what each mode does:

    mode    every micro-batch                                   once a step
    none    0                                                   max(AR(P g) - B, AR(min(P g, bucket)))
    zero1   0                                                   max(AG(P c) - F, AG(U c)) + max(RS(P g) - B, RS(U g))
    zero2   max(AG(P c) - F, AG(U c))                           max(RS(P g) - B, RS(U g))
    zero3   max(AG(P c) - F, AG(U c)) + max(AG(P c) - B, AG(U c))     as zero2

  gradient sync "every" (FULL_SHARD as trainers run it: rules.sharding.stage_sync, zero2 and zero3 only):
    zero2   max(AG(P c) - F, AG(U c)) + max(RS(P g) - B, 0)     RS(U g)
    zero3   max(AG(P c) - F, AG(U c)) + max(AG(P c) + RS(P g) - B, AG(U c))     RS(U g)

- none: DDP's bucketed all-reduce runs beside the last micro-batch's backward, bucket by bucket
  (DDP_BUCKET_BYTES); what the backward cannot hide, and at least the last bucket, shows.
- zero1 gathers the weights once, at the step's first forward (unit by unit, the next prefetched
  while one computes), and reduce-scatters once, in the last backward (gradient sync "last").
- zero2 gathers every micro-batch's forward and keeps the weights to its backward; zero3 frees
  them after each unit's forward and gathers again for its backward: a pipeline schedule pays
  both per micro-batch, which is what makes ZeRO-3 costly under many micro-batches.
- "every" reduce-scatters after each micro-batch's backward, on the link its backward's gathers use (one
  NIC, one stream of collectives): m reduce-scatters a step, each hidden behind its backward where it can
  be; the last one's last unit (the root's) is exposed once a step.
- overlap=False prices the all-reduce after the backward, whole (AR(P g) once a step): how plans
  were priced before training precision was an input (their numbers stay as they were).
Every argument broadcasts (numpy arrays of every cut at once); with one replica everything is 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cost_model.collectives import DDP_BUCKET_BYTES, Ring, all_gather, all_reduce, exposed, reduce_scatter
from rules.sharding import mode_rule, stage_sync

__all__ = ["DataParallelCost"]


@dataclass(frozen=True)
class DataParallelCost:
    """The prices of one stage's data-parallel group (see the module docstring).

    Args:
        mode: "none", "zero1", "zero2" or "zero3" (rules.sharding).
        degree: replicas of the stage, d (1: nothing to reduce).
        ring: (latency, seconds per byte) of an all-reduce over the group (collectives.ring_of).
        compute_bytes, grad_bytes: c and g, bytes per element of the weights forward reads and of a gradient.
        overlap: price DDP's and FSDP2's overlap with compute (False: the all-reduce after the backward).
        gradient_sync: "last" (reduced once a step, accumulated whole) or "every" (reduce-scattered per
            micro-batch); what the mode runs of it is rules.sharding.stage_sync's.
    """

    mode: str
    degree: int
    ring: Ring
    compute_bytes: float
    grad_bytes: float
    overlap: bool = True
    gradient_sync: str = "last"

    def __post_init__(self) -> None:
        mode_rule(self.mode)  # an unknown mode is a ValueError naming the known ones
        object.__setattr__(self, "gradient_sync", stage_sync(self.mode, self.gradient_sync))
        if self.degree < 1:
            raise ValueError(f"degree={self.degree}; a stage has one replica or more")

    def per_micro_batch(self, params: Any, unit: Any, forward: Any, backward: Any) -> Any:
        """Seconds each micro-batch adds (FSDP2's gathers), for P = `params` and U = `unit` elements."""
        before, after = self.gathers(params, unit, forward, backward)
        return before + after

    def gathers(self, params: Any, unit: Any, forward: Any, backward: Any) -> tuple[Any, Any]:
        """(forward, backward) seconds each micro-batch's gathers add: zero2 and zero3 before its forward, zero3
        again before its backward."""
        none = 0.0 * np.asarray(params) if isinstance(params, np.ndarray) else 0.0
        if self.degree == 1 or self.mode in ("none", "zero1"):
            return none, none
        c = self.compute_bytes
        whole, piece = all_gather(self.ring, params * c), all_gather(self.ring, unit * c)
        before = exposed(whole, forward, piece)
        if self.gradient_sync == "every":  # this micro-batch's reduce-scatter beside the backward's gathers
            scatter = reduce_scatter(self.ring, params * self.grad_bytes)
            if self.mode == "zero3":
                return before, exposed(whole + scatter, backward, piece)
            return before, exposed(scatter, backward, 0.0 * scatter)
        return before, exposed(whole, backward, piece) if self.mode == "zero3" else none

    def per_step(self, params: Any, unit: Any, forward: Any, backward: Any) -> Any:
        """Seconds once a step: the gradients' reduction (and zero1's one gather), what overlap leaves."""
        if self.degree == 1:
            return 0.0 * np.asarray(params) if isinstance(params, np.ndarray) else 0.0
        g, c = self.grad_bytes, self.compute_bytes
        if self.gradient_sync == "every":  # the last micro-batch's last unit, after its backward
            return reduce_scatter(self.ring, unit * g)
        if self.mode == "none":
            whole = all_reduce(self.ring, params * g)
            if not self.overlap:
                return whole
            return exposed(whole, backward, all_reduce(self.ring, np.minimum(params * g, DDP_BUCKET_BYTES)))
        out = exposed(reduce_scatter(self.ring, params * g), backward, reduce_scatter(self.ring, unit * g))
        if self.mode == "zero1":
            out = out + exposed(all_gather(self.ring, params * c), forward, all_gather(self.ring, unit * c))
        return out
