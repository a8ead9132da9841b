"""Recomputation as a search prices it: full (every node's forward again in backward, only checkpoints' inputs
kept), or the attention core (Megatron-LM's selective recomputation).

The built-in "recompute" axis of search/axes.py: a stage recomputing in full runs each node's forward once
more in its backward (time x (1 + forward share)) and keeps per micro-batch only its inputs and each
checkpoint's input (`segments`: one checkpoint per repeated block, as runtime/recompute_segments.py cuts).
Recomputing the attention core (Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198, section 4.2) keeps
no attention scores (the 5 a s^2 b term) and runs the core's forward again: priced only (the runtime's
"selective" keeps every product's output instead, scores included), for configurations Megatron-LM ran.
torchtitan's selective op policy (`op_policy_recomputing`) is priced likewise: full recomputation but for the
outputs it keeps.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from partitioner.place.search.problem import SearchProblem
from rules.segments import segments

__all__ = ["attention_recomputing", "node_segments", "op_policy_recomputing", "recomputing"]


def node_segments(modules: Sequence[tuple[str, str]]) -> np.ndarray:
    """[n] each node's recomputation segment (rules.segments), from (node, owning module path) in compute order."""
    segment = segments(modules)
    return np.array([segment[name] for name, _ in modules], dtype=np.int64)


def _rerun(problem: SearchProblem, base: SearchProblem, grow: np.ndarray, saved: np.ndarray) -> SearchProblem:
    """`base` keeping `saved` bytes per node, each node's times of `problem` x `grow` (1 + the share of its time
    its forward takes again in backward)."""
    return dataclasses.replace(
        base, saved_bytes=saved, fixed_times=problem.fixed_times * grow, batch_times=problem.batch_times * grow,
        size_times={k: v * grow for k, v in problem.size_times.items()} if problem.size_times else None)


def recomputing(problem: SearchProblem, share: np.ndarray, segment: np.ndarray | None = None) -> SearchProblem:
    """`problem` as full recomputation runs it: every node's forward once more in backward (its time x (1 +
    forward share)), and kept per micro-batch only the stage inputs (the receive bytes the search counts anyway)
    and, with `segment` (each node's recomputation segment, rules.segments), each checkpoint's input: a value a
    later segment reads. One micro-batch's backward also holds its segment's recomputed activations
    (cost_model.recompute_cost's walk): added to each node's output bytes / `working_outputs`, so the backward
    working set the search counts (search.stage_costs.stage_parts: SearchProblem.working_outputs x the stage's
    largest output) holds the stage's largest segment."""
    grow = 1.0 + share
    saved, out = np.zeros(problem.n), problem.out_bytes
    if segment is not None:
        for v, at in enumerate(problem.producers):
            if at >= 0 and any(c < problem.n and segment[c] > segment[at] for c in problem.consumers[v]):
                saved[at] += problem.value_bytes[v]  # a checkpoint's input: kept until its segment's backward
        if out is not None:
            out = out + np.bincount(segment, weights=problem.saved_bytes, minlength=int(segment.max()) + 1)[
                segment] / problem.working_outputs
    return _rerun(problem, dataclasses.replace(problem, out_bytes=out), grow, saved)


def attention_recomputing(problem: SearchProblem, share: np.ndarray, scores: np.ndarray,
                          core: np.ndarray) -> SearchProblem:
    """`problem` as recomputing the attention core runs it: the score nodes keep nothing for backward, the core's
    nodes (`core`, bool, the scores and the product reading them: cost_model.fused_kernels.attention_core) run their
    forward once more (time x (1 + forward share)); a backward still holds one layer's scores while it runs, so the
    working set (`out_bytes`) stays."""
    return _rerun(problem, problem, 1.0 + share * core, np.where(scores, 0.0, problem.saved_bytes))


def op_policy_recomputing(problem: SearchProblem, share: np.ndarray, segment: np.ndarray, products: np.ndarray,
                          scores: np.ndarray, core: np.ndarray, blocks: np.ndarray) -> SearchProblem:
    """`problem` as torchtitan's selective op policy runs it (activation_checkpoint mode "selective", option "op":
    torchtitan/distributed/activation_checkpoint.py's `_get_custom_policy`): each block (`blocks`, bool: a node of
    an indexed module, `layers.3`) recomputed as in full, but the outputs of the attention kernel (the product
    reading the scores, or the fused attention call) and of every second matrix product of the block (the 1st, 3rd,
    ...: its mm count odd) kept, and their forward not run again; nodes outside the blocks (embedding, final norm,
    head) keep what autograd keeps and run once. `products`, `scores`, `core`: bool per node (a FLOP-counting node;
    cost_model.fused_kernels.attention_core). Without output bytes (no working set priced) it is full recomputation."""
    full = recomputing(problem, share, segment)
    if problem.out_bytes is None:
        return full
    keep = blocks & core & ~scores
    count: dict[int, int] = {}
    for i in np.flatnonzero(blocks & products & ~core):
        count[int(segment[i])] = count.get(int(segment[i]), 0) + 1
        keep[i] = count[int(segment[i])] % 2 == 1
    saved = full.saved_bytes + np.where(keep, problem.out_bytes, 0.0) + np.where(blocks, 0.0, problem.saved_bytes)
    return _rerun(problem, full, 1.0 + share * (blocks & ~keep), saved)
