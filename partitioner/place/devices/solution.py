"""What the device-list search returns: the chosen cuts, replicas and tensor degree per stage, and their price."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DeviceSolution"]


@dataclass
class DeviceSolution:
    """A chosen configuration and its predicted costs."""

    bounds: list[int]  # [0, b1, ..., n]
    replicas: list[int]
    micro_batches: int
    schedule: str
    step_s: float
    work_s: list[float]  # W per stage
    memory: list[float]  # bytes per replica of each stage
    tensor: list[int] = field(default_factory=list)  # ranks per replica of each stage (empty: 1 each)

    @property
    def tensors(self) -> list[int]:
        """Each stage's tensor degree (1: its layers whole)."""
        return self.tensor or [1] * len(self.replicas)
