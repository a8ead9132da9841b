"""Communication formulas: point-to-point time over a link, and ring all-reduce over several.

    p2p(b)            = latency + b / bandwidth
    ring_allreduce(b) = 2 (n - 1) * latency + 2 (n - 1) / n * b / bandwidth

For the all-reduce, `latency` and `bandwidth` are those of the ring's slowest link: each of
the 2 (n - 1) steps (reduce-scatter, then all-gather) moves b / n bytes over every link at
once, so the slowest link sets the pace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

__all__ = ["LINK_KINDS", "Link", "default_link", "p2p_time", "ring_allreduce_time", "slowest"]


@dataclass(frozen=True)
class Link:
    """A connection between two devices: a fixed latency plus a bandwidth (bytes/s, one way)."""

    kind: str
    latency_s: float
    bandwidth: float

    def __post_init__(self) -> None:
        if self.latency_s < 0 or not self.bandwidth > 0:
            raise ValueError(
                f"link {self.kind!r}: latency_s={self.latency_s}, bandwidth={self.bandwidth}; "
                "use latency_s >= 0 and bandwidth > 0 (bytes per second)"
            )

    def time(self, nbytes: float) -> float:
        """Seconds to send `nbytes` one way (0 for nothing)."""
        return p2p_time(nbytes, self)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "latency_s": self.latency_s, "bandwidth": self.bandwidth}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | str) -> Link:
        """A link from {'kind', 'latency_s', 'bandwidth'}; a known kind alone takes its defaults.

        Raises:
            ValueError: an unknown kind without its own latency_s and bandwidth, or bad numbers.
        """
        if isinstance(data, str):
            data = {"kind": data}
        kind = str(data.get("kind", "custom"))
        base = LINK_KINDS.get(kind)
        if base is None and not {"latency_s", "bandwidth"} <= set(data):
            raise ValueError(
                f"link kind {kind!r} is not one of {sorted(LINK_KINDS)}; give it latency_s and bandwidth (bytes/s)"
            )
        latency = float(data.get("latency_s", base.latency_s if base else 0.0))
        bandwidth = float(data.get("bandwidth", base.bandwidth if base else 0.0))
        return cls(kind, latency, bandwidth)


# Typical one-way numbers; measured or hand-described links override them.
LINK_KINDS: dict[str, Link] = {
    "same": Link("same", 0.0, math.inf),  # one device: nothing moves
    "nvlink": Link("nvlink", 8e-6, 150e9),  # NVLink 3/4 peer-to-peer copy, several links bonded
    "nvswitch": Link("nvswitch", 8e-6, 300e9),  # every GPU pair of an NVSwitch board (A100 300, H100 450 GB/s)
    "pcie": Link("pcie", 10e-6, 20e9),  # PCIe 4 x16 peer-to-peer
    "host": Link("host", 10e-6, 12e9),  # CPU <-> GPU over PCIe (pinned memory)
    "network": Link("network", 30e-6, 10e9),  # 100 Gb/s between machines (InfiniBand, RoCE)
    "loopback": Link("loopback", 60e-6, 2e9),  # gloo over TCP on 127.0.0.1 (measure it: comm.loopback)
    "unknown": Link("unknown", 20e-6, 5e9),
}


def default_link(src: torch.device, dst: torch.device) -> Link:
    """The typical link between two devices when nothing was measured or described."""
    if src == dst:
        return LINK_KINDS["same"]
    types = {src.type, dst.type}
    if types == {"cuda"}:
        return LINK_KINDS["pcie"]
    if types == {"cpu", "cuda"}:
        return LINK_KINDS["host"]
    if types == {"cpu"}:
        return LINK_KINDS["same"]  # one host's memory: stages on "cpu" share it
    return LINK_KINDS["unknown"]


def p2p_time(nbytes: float, link: Link) -> float:
    """latency + nbytes / bandwidth; 0 when nothing is sent or both ends are one device."""
    if nbytes <= 0 or link.kind == "same":
        return 0.0
    return link.latency_s + nbytes / link.bandwidth


def slowest(links: Sequence[Link]) -> Link:
    """A link as slow as the worst of `links`: highest latency, lowest bandwidth."""
    if not links:
        raise ValueError("slowest() needs at least one link")
    return Link("slowest", max(link.latency_s for link in links), min(link.bandwidth for link in links))


def ring_allreduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of `nbytes` (per device) among `n` devices whose slowest link is `link`.

    2 (n - 1) steps, each sending nbytes / n over every link and paying one latency:
    2 (n - 1) * latency + 2 (n - 1) / n * nbytes / bandwidth. Zero for n <= 1.
    """
    if n < 1:
        raise ValueError(f"ring_allreduce_time needs n >= 1 devices, got {n}")
    if n == 1 or nbytes <= 0 or link.kind == "same":
        return 0.0
    steps = 2 * (n - 1)
    return steps * link.latency_s + steps / n * nbytes / link.bandwidth
