"""Memory of one pipeline stage under a schedule: weights, gradients, optimizer state, activations.

    params       P                      the stage's parameters and buffers
    grads        P                      one gradient per parameter
    optimizer    k * P                  k = 0 (SGD), 1 (SGD with momentum), 2 (Adam, AdamW)
    activations  f * (A + R)            A: saved outputs of the stage's nodes, R: inputs it
                                        received, per micro-batch; f micro-batches in flight:
                                        GPipe f = m, 1F1B f = min(p - s, m) for stage s of p
    buffers      2 * (R + S)            one receive and one send buffer for activations
                                        (R in, S out) and one each for their gradients
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping

from cost_model.ops import classify

__all__ = ["OPTIMIZER_STATES", "StageMemory", "in_flight", "optimizer_states", "saved_activation_bytes", "stage_memory"]

# Tensors of optimizer state per parameter tensor (same size and dtype).
OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "momentum": 1, "adam": 2, "adamw": 2}
_SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class StageMemory:
    """Bytes one stage holds at its peak, by kind."""

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def fits(self, capacity_bytes: int, headroom: float = 0.9) -> bool:
        """True when the total is within `headroom` of the device's capacity."""
        return self.total <= headroom * capacity_bytes

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def in_flight(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage `stage` (0-based) of `stages` holds at its peak.

    GPipe runs every forward before any backward: all m. 1F1B starts p - s forwards, then
    alternates one backward and one forward: min(p - s, m).

    Raises:
        ValueError: an unknown schedule, or a stage index outside 0..stages-1.
    """
    if stages < 1 or micro_batches < 1 or not 0 <= stage < stages:
        raise ValueError(
            f"stage={stage}, stages={stages}, micro_batches={micro_batches}: "
            "need 0 <= stage < stages and micro_batches >= 1"
        )
    name = schedule.lower().replace("-", "").replace("_", "")
    if name == "gpipe":
        return micro_batches
    if name == "1f1b":
        return min(stages - stage, micro_batches)
    raise ValueError(f"schedule {schedule!r} is not one of {list(_SCHEDULES)}")


def optimizer_states(optimizer: str) -> int:
    """Copies of the parameters an optimizer keeps. Raises ValueError naming the known ones."""
    key = optimizer.lower().replace(" ", "_").replace("-", "_")
    if key not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer {optimizer!r} is not one of {sorted(OPTIMIZER_STATES)}; name the closest one")
    return OPTIMIZER_STATES[key]


def saved_activation_bytes(nodes: Iterable[Mapping[str, Any]]) -> int:
    """Bytes of node outputs kept for backward: every tensor output except views and sizes.

    An upper bound: some ops keep less (ReLU its output only, which the next op may share).
    """
    return int(sum(int(n.get("out_bytes", 0) or 0) for n in nodes if classify(n) not in ("view", "python")))


def stage_memory(
    param_bytes: int,
    activation_bytes: int,
    *,
    stage: int,
    stages: int,
    micro_batches: int,
    schedule: str = "gpipe",
    optimizer: str = "adam",
    recv_bytes: int = 0,
    send_bytes: int = 0,
) -> StageMemory:
    """Peak bytes of one stage (see the module docstring for each term).

    Args:
        param_bytes: parameters and buffers the stage holds.
        activation_bytes: bytes its nodes save for backward, for one micro-batch.
        stage, stages: this stage's index and the pipeline's depth.
        micro_batches: m, micro-batches per step.
        schedule: "gpipe" or "1f1b".
        optimizer: "sgd", "sgd_momentum" (or "momentum"), "adam" or "adamw".
        recv_bytes, send_bytes: per micro-batch, crossing into and out of the stage.

    Raises:
        ValueError: negative sizes, an unknown schedule or optimizer.
    """
    if min(param_bytes, activation_bytes, recv_bytes, send_bytes) < 0:
        raise ValueError("byte counts must be >= 0")
    flight = in_flight(schedule, stage, stages, micro_batches)
    states = optimizer_states(optimizer)
    return StageMemory(
        params=int(param_bytes),
        grads=int(param_bytes),
        optimizer=int(states * param_bytes),
        activations=int(flight * (activation_bytes + recv_bytes)),
        buffers=int(2 * (recv_bytes + send_bytes)),
    )
