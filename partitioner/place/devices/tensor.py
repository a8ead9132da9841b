"""Tensor degrees in the device-list search: what a stage split over t ranks per replica costs, on a grid of cuts.

A stage of r replicas and tensor degree t on devices w .. w + r t - 1 runs replica j on the t devices
w + j t .. w + j t + t - 1 (runtime/plan.py [Note: ranks of a split stage]). It is priced as devices/search.py
prices a stage (search.stage_costs.stage_parts), with three changes:

    problem     the model as each of the t ranks runs it (search.tensor_split.split_problem: the split groups'
                compute at their 1/t GEMM shapes, their collectives on the tensor group's ring added at
                their last node, their weights and saved activations / t), one per distinct ring
    all-reduce  of each rank's weights over its r peers of one tensor index (devices w + i, w + t + i, ...:
                the slowest of those t rings, which run at once)
    where       a split stage holds a split group, and neither of its cuts falls inside one

Its receive and send links are those of a stage on all r t devices (the slowest pair), and it holds
r t devices, so the next stage sees a stage of r t devices before it (devices/windows.py's classes).
A message to a split stage is priced once (each of its t ranks gets a copy on a link of its own).
"""

from __future__ import annotations

import numpy as np

from partitioner.place.search.degrees import Degrees
from partitioner.place.search.problem import Window
from partitioner.place.search.stage_costs import Grid, stage_parts

__all__ = ["TensorPricer"]


class TensorPricer:
    """Split stages' W, static memory and memory per micro-batch on one grid of cuts, per degree and ring."""

    def __init__(self, space: Degrees, cuts: np.ndarray) -> None:
        self.space, self.cuts = space, cuts
        self._grids: dict[tuple[int, int], Grid] = {}
        self._valid = {d.tensor: d.valid(cuts) for d in space.degrees if d.tensor > 1}

    def window(self, t: int, w: int, r: int, whole: Window) -> tuple[Window, int]:
        """The Window of r replicas of degree t from device w (`whole`: a stage's on all r t devices), and
        the index of its problem."""
        degree = self.space.degree(t)
        return (r, whole[1], whole[2], whole[3], degree.reduce[w, r], whole[5]), degree.ring[w, r]

    def parts(self, t: int, problem: int, window: Window, m: int, rows: slice,
              cols: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """stage_parts of the split problem; W is inf where the stage may not split (TensorDegree.valid)."""
        key = (t, problem)
        if key not in self._grids:
            self._grids[key] = Grid(self.space.degree(t).problems[problem], self.cuts)
        grid = self._grids[key]
        work, static, flight = stage_parts(grid.problem, grid, window, m, rows, cols)
        return np.where(self._valid[t][rows, cols], work, np.inf), static, flight
