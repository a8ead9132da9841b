"""Costs between processes: ranks that share a device still move tensors through the process group.

In one process, two stages on "cpu" share memory and a transfer between them is free. Under
torchrun every stage replica is its own process, so the same transfer is a gloo send over
loopback (or a copy through the host between processes on one GPU). `BetweenProcesses`
wraps any cost model and charges those transfers and all-reduces; everything else is the
wrapped model's.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from cost_model.comm import LINK_KINDS, Link, p2p_time, ring_allreduce_time, slowest

__all__ = ["BetweenProcesses"]


class BetweenProcesses:
    """A cost model for planning one process per stage replica (see module docstring)."""

    def __init__(self, base: Any, same_device_link: Link | None = None) -> None:
        self.base = base
        self.same_device_link = same_device_link or LINK_KINDS["loopback"]

    def node_time(self, node: Mapping[str, Any], device: torch.device) -> float:
        return float(self.base.node_time(node, device))

    def transfer_time(self, nbytes: float, src: torch.device, dst: torch.device) -> float:
        if nbytes <= 0:
            return 0.0
        if torch.device(src) == torch.device(dst):
            return p2p_time(nbytes, self.same_device_link)
        return float(self.base.transfer_time(nbytes, src, dst))

    def allreduce_time(self, nbytes: float, devices: Sequence[torch.device]) -> float:
        n = len(devices)
        if n <= 1 or nbytes <= 0:
            return 0.0
        hops = [(torch.device(devices[i]), torch.device(devices[(i + 1) % n])) for i in range(n)]
        if all(a == b for a, b in hops):
            return ring_allreduce_time(nbytes, n, self.same_device_link)
        method = getattr(self.base, "allreduce_time", None)
        if callable(method):
            return float(method(nbytes, devices))
        probe = 1 << 20
        links = [
            Link(
                "hop",
                self.transfer_time(1, a, b),
                probe / max(self.transfer_time(probe + 1, a, b) - self.transfer_time(1, a, b), 1e-12),
            )
            for a, b in hops
        ]
        return ring_allreduce_time(nbytes, n, slowest(links))

    def __getattr__(self, name: str) -> Any:  # forward_time, prepare, spec, fallback, ...
        return getattr(self.base, name)
