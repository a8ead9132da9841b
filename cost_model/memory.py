"""Memory of one pipeline stage at its peak under a schedule: weights, gradients, optimizer state, activations.

    params       P                      the stage's parameters and buffers
    grads        P                      one gradient per parameter
    optimizer    k * P                  k = 0 (SGD), 1 (SGD with momentum), 2 (Adam, AdamW)
    activations  (f - 1) * A + B        A: what the stage keeps per micro-batch, B: the most one
                 + f * R                micro-batch holds during its backward (A, recomputation and
                                        gradients: cost_model.recompute_cost, `peak_bytes`); R: inputs
                                        it received, held per micro-batch; f micro-batches in flight:
                                        GPipe f = m, 1F1B f = min(p - s, m) for stage s of p
                                        (rules.schedules.in_flight: each schedule's closed form)
    buffers      (f + 1) * S            S: the outputs it sends, held per micro-batch until its
                                        backward, and their gradient (received) during it; the last
                 f * S (last stage)     stage's S is the model output it returns, and its loss holds
                                        3 x S at the start of backward, beside A (B >= A + 3 S:
                                        cross-entropy's log-softmax, its gradient, the output's;
                                        rules.kernels.WORKING_OUTPUTS: a fused loss holds 2)

Without B (`peak_bytes`), the coarse form the hybrid solver prices: activations f * (A + R),
buffers 2 * (R + S) (a receive and a send buffer each way).
That total is what the stage's tensors need: compare it with `torch.cuda.max_memory_allocated`.
A CUDA device holds less than its capacity for them (`usable_bytes`):

    usable = (capacity - CUDA_CONTEXT_BYTES) * (1 - ALLOCATOR_HEADROOM)     on CUDA
    usable = capacity                                                        elsewhere
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from cost_model.recompute_cost import saved_bytes_per_node
from rules.kernels import WORKING_OUTPUTS
from rules.schedules import in_flight  # the closed form of each registered schedule; cost_model.in_flight

if TYPE_CHECKING:
    import torch

__all__ = ["ALLOCATOR_HEADROOM", "CUDA_CONTEXT_BYTES", "OPTIMIZER_STATES", "StageMemory", "device_overhead_bytes",
           "in_flight", "optimizer_states", "saved_activation_bytes", "stage_memory", "usable_bytes"]  # fmt: skip

# Tensors of optimizer state per parameter tensor (same size and dtype).
OPTIMIZER_STATES = {"sgd": 0, "sgd_momentum": 1, "momentum": 1, "adam": 2, "adamw": 2}
# What a process's CUDA context takes on the GPU before any tensor: the driver's context, the
# kernels it loads (lazily since CUDA 11.7) and the cuBLAS/cuDNN handles and workspaces; about
# 300-600 MiB on A100/H100 with CUDA 12 (nvidia-smi of a process that ran one matmul and one conv).
CUDA_CONTEXT_BYTES = 512 << 20
# Fraction of the rest the caching allocator cannot hand out: blocks split and cached for other
# sizes (reserved minus allocated is commonly 5-15% at a training step's peak).
ALLOCATOR_HEADROOM = 0.10


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


def optimizer_states(optimizer: str) -> int:
    """Copies of the parameters an optimizer keeps. Raises ValueError naming the known ones."""
    key = optimizer.lower().replace(" ", "_").replace("-", "_")
    if key not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer {optimizer!r} is not one of {sorted(OPTIMIZER_STATES)}; name the closest one")
    return OPTIMIZER_STATES[key]


def saved_activation_bytes(nodes: Sequence[Mapping[str, Any]], device_type: str = "cpu") -> int:
    """Bytes the nodes of a stage save for backward (no recomputation): what autograd keeps, each tensor once.

    The sum of `cost_model.recompute_cost.saved_bytes_per_node` (the one rule: a product keeps its
    inputs, ReLU its output, add nothing; a ReLU output that the next conv saves counts once), so
    this equals `recompute_costs(nodes)["none"].kept_bytes`. Each node needs `name` and `inputs`
    (`recompute_cost.graph_nodes` makes them from a graph); the stage's inputs and weights are not counted.
    """
    return int(sum(saved_bytes_per_node(nodes, device_type).values()))


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
    peak_bytes: int | None = None,
    flight: int | None = None,
    last: bool = False,
) -> StageMemory:
    """Peak bytes of one stage (see the module docstring for each term).

    Args:
        param_bytes: parameters and buffers the stage holds.
        activation_bytes: bytes its nodes save for backward, for one micro-batch.
        stage, stages: this stage's index and the pipeline's depth.
        micro_batches: m, micro-batches per step.
        schedule: a schedule with a closed form for micro-batches in flight ("gpipe", "1f1b", "zb1";
            rules.schedules.in_flight); ignored when `flight` is given.
        optimizer: "sgd", "sgd_momentum" (or "momentum"), "adam" or "adamw".
        recv_bytes, send_bytes: per micro-batch, crossing into and out of the stage (the last
            stage's send_bytes: the model output it returns).
        peak_bytes: the most one micro-batch holds during its backward (`ModeCost.peak_bytes`);
            None for the coarse form.
        flight: micro-batches in flight where the programs say (default: by `schedule`).
        last: the stage computes the loss (its output's loss holds 3 x send_bytes: torch's eager one).

    Raises:
        ValueError: negative sizes, an unknown schedule or optimizer.
    """
    if min(param_bytes, activation_bytes, recv_bytes, send_bytes, peak_bytes or 0) < 0:
        raise ValueError("byte counts must be >= 0")
    f = in_flight(schedule, stage, stages, micro_batches) if flight is None else flight
    states = optimizer_states(optimizer)
    if peak_bytes is None:
        activations, buffers = f * (activation_bytes + recv_bytes), 2 * (recv_bytes + send_bytes)
    else:
        loss = WORKING_OUTPUTS["eager"] * send_bytes if last else 0
        activations = max(0, f - 1) * activation_bytes + max(peak_bytes, activation_bytes + loss) + f * recv_bytes
        buffers = (f if last else f + 1) * send_bytes
    return StageMemory(
        params=int(param_bytes),
        grads=int(param_bytes),
        optimizer=int(states * param_bytes),
        activations=int(activations),
        buffers=int(buffers),
    )


def _device_type(kind: str | torch.device) -> str:
    return str(kind).split(":", 1)[0].lower()  # 'cuda:3' or torch.device('cuda', 3) -> 'cuda'


def device_overhead_bytes(kind: str | torch.device) -> int:
    """Bytes a device loses before holding any tensor: CUDA_CONTEXT_BYTES on 'cuda' (or 'cuda:N'), else 0."""
    return CUDA_CONTEXT_BYTES if _device_type(kind) == "cuda" else 0


def usable_bytes(capacity_bytes: int, kind: str | torch.device) -> int:
    """Bytes of a device's capacity that a stage's tensors may fill (see the module docstring).

    On CUDA the context and the allocator's headroom come off; other devices keep all of it
    (host memory has no context, and its allocator returns freed memory to the system).

    Args:
        capacity_bytes: the device's memory (`DeviceSpec.memory_bytes`, total_memory).
        kind: the device type or name: 'cuda', 'cuda:3', 'cpu', or a torch.device.

    Raises:
        ValueError: a negative capacity.
    """
    if capacity_bytes < 0:
        raise ValueError(f"capacity_bytes={capacity_bytes} is negative; pass the device's memory in bytes")
    if _device_type(kind) != "cuda":
        return int(capacity_bytes)
    return max(0, int((capacity_bytes - device_overhead_bytes(kind)) * (1.0 - ALLOCATOR_HEADROOM)))
