"""The problem both searches price (SearchProblem): node times, values, links and capacities, no torch.

devices/problem.py (a device list: per-device links and rings) and cluster/prepare.py (a cluster: node
arrays only, links priced by rank) make one from a traced graph and a cost model (search/graph_costs.py);
devices/search.py and cluster/search.py search it. `Window` is what a stage's price depends on by where it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SearchProblem", "LinkCost", "Window"]

# A stage's window, what its costs depend on: (replicas, device kinds, receive link, send link, all-reduce
# ring, smallest capacity); links and ring are (latency, seconds per byte), None where there is no
# neighbour or no replica to reduce with (devices/windows.py and cluster/search.py make them).
LinkCost = tuple[float, ...] | None
Window = tuple[int, tuple[int, ...], LinkCost, LinkCost, LinkCost, float]


@dataclass
class SearchProblem:
    """The numbers both searches price, with no torch or graph objects (times s, sizes bytes)."""

    fixed_times: np.ndarray  # [kinds, n] per micro-batch, whatever its size (op overheads)
    batch_times: np.ndarray  # [kinds, n] of the whole batch, split evenly over the micro-batches
    device_kind: np.ndarray  # [D] row of each device in the two arrays above
    producers: np.ndarray  # [v] position of the producing node (-1: a pipeline input)
    consumers: list[np.ndarray]  # [v] sorted positions reading it (n: the model output)
    value_bytes: np.ndarray  # [v] whole batch
    param_bytes: np.ndarray  # [n] parameters first used by node i
    saved_bytes: np.ndarray  # [n] activations node i keeps for backward, whole batch
    link: np.ndarray  # [D, D, 2] (latency, seconds per byte) from device i to device j
    allreduce: np.ndarray  # [D, D + 1, 2] (latency, seconds per byte) of a ring over devices w .. w+r-1
    capacity: np.ndarray  # [D] usable bytes per device (inf: no limit)
    optimizer_states: int = 2
    batch: int | None = None  # samples per step: micro-batch counts above it are skipped
    names: list[str] | None = None  # device names for messages
    out_bytes: np.ndarray | None = None  # [n] node i's output, whole batch (None: no backward working set)
    size_times: dict[int, np.ndarray] | None = None  # samples -> [kinds, n] one micro-batch of that many samples
    gradient_sync: str = "last"  # sharded stages' gradients: reduced once a step or every micro-batch (rules.sharding)
    # HBM bytes/s the optimizer step streams at (cost_model.optimizer_step; the memory-bound kernels' rate);
    # 0: not priced (devices the calibration's per-step time covers)
    step_bytes_per_s: float = 0.0
    working_outputs: float = 3.0  # a backward holds this many of a stage's largest output (rules.kernels)

    def micro_batch_times(self, m: int) -> np.ndarray:
        """[kinds, n] seconds of one micro-batch when the batch is cut into m: the mean over the sizes
        torch.tensor_split makes, priced at their shapes (`size_times`), else fixed + whole-batch / m."""
        if self.batch and self.size_times and m <= self.batch:
            low, extra = divmod(self.batch, m)
            if low in self.size_times and (not extra or low + 1 in self.size_times):
                times = self.size_times[low] * ((m - extra) / m)
                return times + self.size_times[low + 1] * (extra / m) if extra else times
        out: np.ndarray = self.fixed_times + self.batch_times / m
        return out

    @property
    def n(self) -> int:
        return int(self.fixed_times.shape[1])

    @property
    def devices(self) -> int:
        return int(len(self.device_kind))
