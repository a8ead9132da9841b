"""A stage's work and memory over a grid of cuts when its data-parallel group shards or overlaps (the cluster search).

search/stage_costs.py prices a stage as plans were priced before training precision was an input: every
state at the model's dtype ((2 + optimizer states) x weights) and the all-reduce after the backward.
Here, for a sharding mode and a Precision (StateRule), over the same Grid:

    W       = ceil(m / r) (T + per_micro_batch) + per_step + optimizer step
              T: one micro-batch's compute and messages, as stage_costs; per_micro_batch and per_step:
              the group's collectives by mode, overlapped (cost_model/data_parallel.py), on P = weights
              / itemsize elements, U the largest block's (cost_model's FSDP unit, search/blocks.py), the
              gradients reduced as the problem's gradient_sync says (rules.sharding.stage_sync); the
              optimizer step over the P / (r x context ranks) a sharded rank steps, P unsharded, at the
              problem's step_bytes_per_s (cost_model/optimizer_step.py; 0: not priced)
    static  = weights + master + gradients + optimizer (cost_model.training_memory.state_bytes: each
              state at its own dtype, / d where the mode shards it) + buffers as stage_costs
    flight  = as stage_costs (saved activations, received and sent values per micro-batch held)

F and B of a micro-batch (what DDP's and FSDP2's collectives hide behind) are its compute split by each
node's forward share. A rule with no precision and mode "none" is stage_costs' own (same numbers).
"""

from __future__ import annotations

import math

import numpy as np

from cost_model.data_parallel import DataParallelCost
from cost_model.optimizer_step import step_seconds
from cost_model.training_memory import state_bytes
from partitioner.place.search.problem import SearchProblem, Window
from partitioner.place.search.stage_costs import Grid, range_max, span, stage_parts
from partitioner.place.search.states import StateRule
from rules.sharding import stage_sync

__all__ = ["SplitGrid", "lower_static_bytes", "split_parts"]


class SplitGrid(Grid):
    """A Grid with what sharding needs: the largest block's weights and the weights outside blocks, per cut range,
    and each micro-batch's forward part."""

    def __init__(self, problem: SearchProblem, cuts: np.ndarray, blocks: np.ndarray, share: np.ndarray) -> None:
        super().__init__(problem, cuts)
        ids = np.asarray(blocks)
        inside = ids >= 0
        totals = np.bincount(ids[inside], weights=problem.param_bytes[inside]) if inside.any() else np.zeros(0)
        per_node = np.where(inside, totals[np.where(inside, ids, 0)] if len(totals) else 0.0, 0.0)
        self.unit = range_max(per_node, cuts)
        self.root = self._prefix(np.where(inside, 0.0, problem.param_bytes))
        self.share = share
        self._forward: dict[int, np.ndarray] = {}

    def forward(self, m: int) -> np.ndarray:
        """[kinds, cuts] cumulative forward seconds of one micro-batch of m."""
        if m not in self._forward:
            self._forward[m] = self._prefix(self.problem.micro_batch_times(m) * self.share)
        return self._forward[m]


def split_parts(p: SearchProblem, g: SplitGrid, window: Window, m: int, rows: slice, cols: slice, mode: str,
                rule: StateRule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W, static memory and memory per micro-batch in flight of stages [cuts[rows], cuts[cols]) on a window,
    with the stage's replicas sharded by `mode` (module docstring)."""
    if rule.legacy(mode):
        return stage_parts(p, g, window, m, rows, cols)
    r, kinds, recv_link, send_link, ring, _ = window
    comp_all = span(g.compute(m)[list(kinds)], rows, cols)
    slowest = np.argmax(comp_all, axis=0)
    comp = np.take_along_axis(comp_all, slowest[None], axis=0)[0]
    forward = np.take_along_axis(span(g.forward(m)[list(kinds)], rows, cols), slowest[None], axis=0)[0]
    recv, send = g.recv[rows, cols] / m, g.send[rows, cols] / m
    t = comp
    for link, nbytes in ((recv_link, recv), (send_link, send)):
        if link is not None:
            t = t + 2 * np.where(nbytes > 0, link[0] + link[1] * nbytes, 0.0)
    precision = rule.states
    params = span(g.params, rows, cols) / rule.itemsize
    unit = np.minimum(g.unit[rows, cols] / rule.itemsize, params)
    root = span(g.root, rows, cols) / rule.itemsize
    backward = comp - forward
    sync = stage_sync(mode, p.gradient_sync)
    # sharded: over the replicas and each one's context ranks (rule.shard_degree), FSDP2's mesh
    rs, group_ring = rule.data_group(mode, r, tuple(ring) if ring is not None else (0.0, 0.0))  # type: ignore[arg-type]
    dp = DataParallelCost(mode, rs, group_ring, precision.itemsize("compute"), precision.itemsize("grad"),
                          gradient_sync=sync)
    per_replica = math.ceil(m / r)
    work = per_replica * (t + dp.per_micro_batch(params, unit, forward, backward))
    work = work + dp.per_step(params, unit, forward, backward)
    work = work + step_seconds(params, precision, p.step_bytes_per_s, shards=rs if mode != "none" else 1)
    idx = np.arange(len(g.cuts))
    work = np.where(idx[cols][None, :] > idx[rows][:, None], work, np.inf)
    kinds_bytes = state_bytes(params, precision, mode=mode, degree=rs, micro_batches=per_replica, gradient_sync=sync,
                              root=root, unit=unit)
    static = sum(kinds_bytes) + 2 * (recv + send)
    if g.largest is not None:
        static = static + p.working_outputs * g.largest[rows, cols] / m
    flight = span(g.saved, rows, cols) / m + recv + send
    return work, static, flight


def lower_static_bytes(param_bytes: float, rule: StateRule, mode: str, degree: int, micro_batches: int) -> float:
    """A lower bound on the states one rank holds for `param_bytes` of weights (no gathered block counted)."""
    if rule.legacy(mode):
        return float("nan")  # the caller's own bound
    params = param_bytes / rule.itemsize
    kinds = state_bytes(params, rule.states, mode=mode, degree=degree * rule.shard_degree,
                        micro_batches=micro_batches, root=0.0, unit=0.0, second=0.0)
    return float(sum(kinds))
