"""Full recomputation as a search prices it: every node's forward again in backward, only checkpoints' inputs kept.

The built-in "recompute" axis of search/axes.py: a stage recomputing in full runs each node's forward once
more in its backward (time x (1 + forward share)) and keeps per micro-batch only its inputs and each
checkpoint's input (`segments`: one checkpoint per repeated block, as runtime/recompute_segments.py cuts).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from partitioner.place.search.problem import SearchProblem
from rules.segments import segments

__all__ = ["node_segments", "recomputing"]


def node_segments(modules: Sequence[tuple[str, str]]) -> np.ndarray:
    """[n] each node's recomputation segment (rules.segments), from (node, owning module path) in compute order."""
    segment = segments(modules)
    return np.array([segment[name] for name, _ in modules], dtype=np.int64)


def recomputing(problem: SearchProblem, share: np.ndarray, segment: np.ndarray | None = None) -> SearchProblem:
    """`problem` as full recomputation runs it: every node's forward once more in backward (its time x (1 +
    forward share)), and kept per micro-batch only the stage inputs (the receive bytes the search counts anyway)
    and, with `segment` (each node's recomputation segment, rules.segments), each checkpoint's input: a value a
    later segment reads. One micro-batch's backward also holds its segment's recomputed activations
    (cost_model.recompute_cost's walk): added to each node's output bytes / 3, so the backward working set the
    search counts (search.stage_costs.stage_parts: 3 x the stage's largest output) holds the stage's largest segment."""
    grow = 1.0 + share
    saved, out = np.zeros(problem.n), problem.out_bytes
    if segment is not None:
        for v, at in enumerate(problem.producers):
            if at >= 0 and any(c < problem.n and segment[c] > segment[at] for c in problem.consumers[v]):
                saved[at] += problem.value_bytes[v]  # a checkpoint's input: kept until its segment's backward
        if out is not None:
            out = out + np.bincount(segment, weights=problem.saved_bytes, minlength=int(segment.max()) + 1)[
                segment] / 3
    return dataclasses.replace(
        problem, saved_bytes=saved, out_bytes=out, fixed_times=problem.fixed_times * grow,
        batch_times=problem.batch_times * grow,
        size_times={k: v * grow for k, v in problem.size_times.items()} if problem.size_times else None)
