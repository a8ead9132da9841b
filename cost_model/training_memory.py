"""What one stage holds at its peak by kind under a training precision, divided by the degrees that shard each.

P parameters, d the shard degree (1 unsharded; HSDP's replicate degree divides nothing), bytes
per element c (compute), p (param), g (grad), s (state), S optimizer state elements (2P for Adam),
[Note: sharding modes] in rules/sharding.py for what each mode keeps:

    kind        none (replicas)          zero1               zero2               zero3
    weights     P c                      P c                 P c                 G c   G = root + 2 largest units
    master      P p (mixed), else 0      P p / d             P p / d             P p / d
    gradients   P g                      P g + A             sync "last", more than one micro-batch: P g + A;
                                                             else (sync "every") T + P p / d
    optimizer   S s                      S s / d             S s / d             S s / d
    activations as given (cost_model.memory: saved per micro-batch in flight, buffers)

- weights: the copy forward reads. Unsharded, a mixed trainer's autocast copies (saved for
  backward); FSDP2 gathers it per unit: zero1 and zero2 hold every unit at the end of a forward,
  zero3 its root (the stage's own weights: a tied embedding; held through the root's forward and
  backward) and two units (the one running and the one prefetched).
- master: FSDP2 stores only the shard, apart from the gathered copy, in p (mixed or not).
- gradients: FSDP2 reduce-scatters into shards in p (the optimizer reads them). With gradient
  sync "last" and more than one micro-batch (zero1 always) it accumulates every unit's gradients
  unsharded in g between micro-batches (P g; the last backward frees each unit's accumulator as
  its shard arrives, so the shards add nothing while p / d <= g), and A = max(root, L) g is the
  largest reduce-scatter input. Otherwise (sync "every": FULL_SHARD) the shards are held from the
  first reduce-scatter on, and T = (root + L) g is transient: the root's gradients until the
  backward ends and one unit's until its reduce-scatter (the gathered weights they are computed
  with are counted in weights already). L: the largest unit's parameters. Measured under torchrun
  (tests/test_split_layers.py, "zero3+every"): within 2% on 1F1B's first stage.
- optimizer: torch optimizers keep their states in the dtype of the weights they step (p);
  Precision.state says otherwise for trainers that do (Megatron's distributed optimizer).

Buffers (masks, running statistics) are not sharded: `buffer_bytes` adds to weights.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from cost_model.precision import MIXED, Precision
from rules.sharding import accumulates_unsharded, mode_rule

__all__ = ["PrecisionFit", "TrainingMemory", "fits_under", "state_bytes", "training_memory"]

_GIB = float(1 << 30)


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes one rank of a stage holds at its peak, by kind."""

    weights: int
    master: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.master + self.gradients + self.optimizer + self.activations

    def fits(self, capacity_bytes: int) -> bool:
        """True when the total is within `capacity_bytes` (usable bytes: cost_model.memory.usable_bytes)."""
        return self.total <= capacity_bytes

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def training_memory(
    params: int,
    precision: Precision = MIXED,
    *,
    mode: str = "none",
    degree: int = 1,
    micro_batches: int = 1,
    gradient_sync: str = "last",
    activation_bytes: int = 0,
    buffer_bytes: int = 0,
    units: Sequence[int] = (),
    state_elements: int | None = None,
    in_flight: int = 1,
) -> TrainingMemory:
    """Peak bytes of one rank of a stage, by kind, at the moment of the peak (see the module docstring).

    Args:
        params: the stage's trainable parameter elements, P.
        precision: the dtypes of each state and the optimizer.
        mode: "none", "zero1", "zero2" or "zero3" (rules.sharding).
        degree: ranks each state is sharded over, d (a stage's data-parallel ranks; HSDP: its shard dim).
        micro_batches: micro-batches per step (more than one with gradient sync "last": gradients
            accumulate unsharded between them).
        gradient_sync: "last" or "every" (rules.sharding).
        activation_bytes: what the stage's micro-batches in flight hold (cost_model.memory).
        buffer_bytes: buffers (not sharded).
        units: parameter elements of each FSDP unit (the stage's repeated blocks); the rest of
            `params` is the root's. Empty: one unit, the whole stage.
        state_elements: optimizer state elements (Precision.state_elements of the shapes, for
            Adafactor); default: the dense count.
        in_flight: micro-batches the stage holds at once (`activation_bytes` is what they hold). When
            every micro-batch of the step is in flight before the first backward (micro_batches <=
            in_flight: no forward follows a backward), the activations' peak (the first backward's start,
            no gradient yet) and the gradients' (once the first backward has freed its micro-batch)
            never coincide: the peak is the larger of the two moments, by kind at that moment.

    Raises:
        ValueError: negative sizes, degree < 1, units summing past params, an unknown mode.
    """
    if min(params, activation_bytes, buffer_bytes, *units) < 0 or degree < 1:
        raise ValueError(f"params={params}, activation_bytes={activation_bytes}, buffer_bytes={buffer_bytes} and "
                         f"units must be >= 0 and degree={degree} >= 1")
    if sum(units) > params:
        raise ValueError(f"the units hold {sum(units)} parameters, more than the stage's {params}")
    states = state_elements if state_elements is not None else int(precision.state_elements_per_param() * params)
    root = params - sum(units)
    largest = sorted(units, reverse=True)[:2] + [0, 0]
    kinds = state_bytes(params, precision, mode=mode, degree=degree, micro_batches=micro_batches,
                        gradient_sync=gradient_sync, root=root, unit=largest[0], second=largest[1],
                        state_elements=states)
    weights, master, gradients, optimizer = (int(k) for k in kinds)
    activations = activation_bytes
    if in_flight > 1 and micro_batches <= in_flight and gradients:
        after = activation_bytes * (in_flight - 1) // in_flight  # the first backward has freed its micro-batch
        if activation_bytes >= after + gradients:
            gradients = 0  # the peak is the first backward's start: every activation held, no gradient yet
        else:
            activations = after
    return TrainingMemory(weights=weights + buffer_bytes, master=master, gradients=gradients, optimizer=optimizer,
                          activations=activations)


def state_bytes(
    params: Any,
    precision: Precision = MIXED,
    *,
    mode: str = "none",
    degree: int = 1,
    micro_batches: int = 1,
    gradient_sync: str = "last",
    root: Any = None,
    unit: Any = 0,
    second: Any = None,
    state_elements: Any = None,
) -> tuple[Any, Any, Any, Any]:
    """(weights, master, gradients, optimizer) bytes of one rank of a stage (the module docstring's table),
    for numbers or numpy arrays alike (the searches price every cut at once).

    `root`: parameters outside the FSDP units (default: all of them);
    `unit` and `second`: the largest and second largest unit's (default `second`: as large as `unit`,
    repeated blocks); `state_elements`: optimizer state elements (default: the dense count).
    """
    rule = mode_rule(mode, gradient_sync)
    c, p, g, s = (precision.itemsize(f) for f in ("compute", "param", "grad", "state"))
    states = state_elements if state_elements is not None else precision.state_elements_per_param() * params
    copies = precision.matmul_copy_bytes  # FP8 weights and their transpose, held as the compute copy is
    if not rule.sharded:
        return (params * ((c if precision.mixed else p) + copies), params * p if precision.mixed else 0 * params,
                params * g, states * s)
    root = root if root is not None else params
    second = second if second is not None else unit
    gathered = root + unit + second if rule.reshard_after_forward else params
    gathered = np.minimum(gathered, params) if isinstance(gathered, np.ndarray) else min(gathered, params)
    shard = _ceil(params, degree)
    if accumulates_unsharded(mode, gradient_sync, micro_batches):
        gradients = params * g + np.maximum(root, unit) * g  # a unit's shards replace its freed accumulators
    else:
        gradients = (root + unit) * g + shard * p
    return gathered * (c + copies), shard * p, gradients, _ceil(states, degree) * s


def _ceil(n: Any, d: int) -> Any:
    return -(-n // d)


@dataclass(frozen=True)
class PrecisionFit:
    """One stage's memory under several precisions against a capacity; `message` says which fit."""

    capacity_bytes: int
    memory: dict[str, TrainingMemory]

    @property
    def fitting(self) -> list[str]:
        return [name for name, m in self.memory.items() if m.fits(self.capacity_bytes)]

    @property
    def message(self) -> str:
        def gib(n: int) -> str:
            return f"{n / _GIB:.1f} GiB"

        yes = [f"{n} ({gib(m.total)})" for n, m in self.memory.items() if m.fits(self.capacity_bytes)]
        no = [f"{n} ({gib(m.total)})" for n, m in self.memory.items() if not m.fits(self.capacity_bytes)]
        cap = gib(self.capacity_bytes)
        if not no:
            return f"fits in {cap} under every precision: {', '.join(yes)}"
        if not yes:
            return f"fits in {cap} under no precision: {', '.join(no)}"
        return f"fits in {cap} under {', '.join(yes)} but not under {', '.join(no)}"


def fits_under(params: int, capacity_bytes: int, precisions: Sequence[Precision] | Mapping[str, Precision],
               **memory: object) -> PrecisionFit:
    """`training_memory` of one stage under each precision, against `capacity_bytes` (usable bytes).

    `precisions` by name, or a sequence (named by their labels); `memory`: training_memory's keyword
    arguments (mode, degree, micro_batches, activation_bytes, ...).
    """
    named = dict(precisions) if isinstance(precisions, Mapping) else {p.label: p for p in precisions}
    return PrecisionFit(int(capacity_bytes),
                        {n: training_memory(params, p, **memory) for n, p in named.items()})  # type: ignore[arg-type]
