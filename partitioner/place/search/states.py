"""How a search counts a stage's states (StateRule): at the training precision's dtypes, or all at the model's.

Without a precision every state is counted at the model's dtype and the replicas all-reduce after the
backward, as plans were counted before precision was an input (`legacy`); with one, each state at its own
dtype (cost_model.precision), sharded where the mode shards it (split_costs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_model.collectives import Ring
from cost_model.precision import Precision

__all__ = ["StateRule"]


@dataclass(frozen=True)
class StateRule:
    """How a search counts a stage's states: the training precision (None: every state at the model's dtype, the
    all-reduce after the backward, as before precision was an input), the bytes of one weight element in the graph."""

    precision: Precision | None
    itemsize: int
    optimizer: str = "adam"  # without a precision: the optimizer counted (with one: the precision's)
    shard_degree: int = 1  # ranks of each replica its sharded states split over too (context ranks: FSDP2's mesh)
    shard_ring: Ring = (0.0, 0.0)  # an all-reduce over those ranks of one replica (collectives.ring_of)

    @property
    def states(self) -> Precision:
        """The precision states are counted at (the model's dtype for every state, without one)."""
        if self.precision is not None:
            return self.precision
        name = {8: "float64", 4: "float32", 2: "bfloat16", 1: "float8_e4m3fn"}.get(self.itemsize, "float32")
        return Precision(name, name, name, name, optimizer=self.optimizer, name=name)

    def legacy(self, mode: str) -> bool:
        return self.precision is None and mode == "none"

    def data_group(self, mode: str, replicas: int, ring: Ring) -> tuple[int, Ring]:
        """(ranks, all-reduce ring) of a stage's data-parallel collectives under `mode`: a sharded stage's FSDP2 mesh
        holds every replica's `shard_degree` context ranks too (runtime/layer_split.py, as torchtitan's dp_shard x
        cp), so it gathers and reduce-scatters over replicas x shard_degree ranks at the slower of the two rings
        (with one replica, the context ranks' alone); unsharded, the replicas alone."""
        if mode == "none" or self.shard_degree == 1:
            return replicas, ring
        if replicas == 1:
            return self.shard_degree, self.shard_ring
        return replicas * self.shard_degree, (max(ring[0], self.shard_ring[0]), max(ring[1], self.shard_ring[1]))
