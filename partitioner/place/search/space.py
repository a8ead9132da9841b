"""The search space, decoded once: what a request lets the searches choose, as one typed, checked object.

    request (PlanRequest)            SearchSpace                     meaning
    micro_batches=8                  micro_batches 8                 the count (a tuple: candidates; None: the
                                                                     search's defaults, search/counts.py)
    schedule="1f1b"                  schedules ("1f1b",)             the searched schedules compared (compare.py)
    recompute="auto" | "full" | ..   recompute "auto" | "full" |     searched both ways / with / without full
                                     "none"                          recomputation (per-stage modes: planning's)
    precision=...                    precision                       the dtypes states are counted at
    tensor="auto" | t                tensor None | (t,)              every degree the model and GPUs allow /
                                                                     that one ((1,): no layer split)
    sharding="auto" | mode           sharding None | (mode,)         every mode worth pricing / that one
    (not a request option)           sequence_parallel               priced only: a configuration given whole
    kernels="eager" | "fused"        kernels                         the kernel set priced (rules/kernels.py)
    (not a request option)           gradient_sync None | syncs      sharded stages' gradients reduced once a
                                                                     step ("last"), per micro-batch ("every");
                                                                     None: "every" where zero2/zero3 may be chosen

`SearchSpace.of(request, schedule)` is the only place the request's `auto` choices are read; the searches
ask the space what it allows (`tensor_degrees`, `sharding_modes`, `recompute_modes`, `gradient_syncs`,
`cluster_only`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Sequence

from cost_model.precision import Precision
from partitioner.errors import PartitionError
from partitioner.place.search.compare import SCHEDULES
from partitioner.place.search.counts import given_counts
from partitioner.request import PlanRequest
from rules.kernels import KERNEL_SETS
from rules.sharding import GRADIENT_SYNCS, SHARDING_MODES, sharding_problem

__all__ = ["ANY", "PRICED_ONLY_RECOMPUTE", "SearchSpace", "SearchedRecompute"]

# Recomputation a search prices: none, full for every stage, or both ways (the smaller objective kept); "attention"
# (the attention core: Megatron-LM's selective recomputation) and "selective-op" (torchtitan's selective op policy),
# search/recompute.py, are priced only (no Plan runs them).
SearchedRecompute = Literal["none", "full", "auto", "attention", "selective-op"]
PRICED_ONLY_RECOMPUTE = ("attention", "selective-op")


@dataclass(frozen=True)
class SearchSpace:
    """What the searches may choose (module docstring). Lists are kept as tuples; values are checked here.

    Raises:
        PartitionError: micro-batch counts, recomputation, tensor degrees or sharding modes that cannot be planned.
    """

    micro_batches: int | tuple[int, ...] | None = None
    schedules: tuple[str, ...] = SCHEDULES
    recompute: SearchedRecompute = "none"
    precision: Precision | None = None
    tensor: tuple[int, ...] | None = None
    sharding: tuple[str, ...] | None = None
    sequence_parallel: bool = False
    gradient_sync: tuple[str, ...] | None = None
    kernels: str = "eager"

    def __post_init__(self) -> None:
        for name in ("micro_batches", "tensor", "sharding", "gradient_sync"):  # lists as users pass them
            value = getattr(self, name)
            if isinstance(value, (list, set)):
                object.__setattr__(self, name, tuple(value))
        object.__setattr__(self, "schedules", tuple(self.schedules))
        if self.micro_batches is not None:
            given_counts(self.micro_batches)
        if self.tensor == () or self.sharding == ():
            raise PartitionError(f"tensor={self.tensor!r}, sharding={self.sharding!r}: allow one value at least, or "
                                 "None for every value the search finds")
        if self.recompute not in ("none", "full", "auto", *PRICED_ONLY_RECOMPUTE):
            raise PartitionError(f"recompute={self.recompute!r}; use 'none', 'full' or 'auto' (or, priced only, "
                                 f"{' or '.join(map(repr, PRICED_ONLY_RECOMPUTE))})")
        if self.tensor is not None and any(isinstance(t, bool) or not isinstance(t, int) or t < 1
                                           for t in self.tensor):
            raise PartitionError(f"tensor degrees {list(self.tensor)}: give positive integers (1: no layer split)")
        unknown = [x for x in self.gradient_sync or () if x not in GRADIENT_SYNCS]
        if unknown or self.gradient_sync == ():
            raise PartitionError(f"gradient_sync={self.gradient_sync!r}; allow one or more of {list(GRADIENT_SYNCS)} "
                                 "(None: both where a stage may shard under zero2 or zero3)")
        if self.kernels not in KERNEL_SETS:
            raise PartitionError(f"kernels={self.kernels!r}; use one of {', '.join(map(repr, KERNEL_SETS))}")
        for mode in self.sharding or ():
            problem = sharding_problem(mode, precision=self.precision is not None)
            if problem is not None:
                raise PartitionError(f"{problem} (sharding modes allowed: {list(self.sharding or ())}, of "
                                     f"{list(SHARDING_MODES)})")

    @classmethod
    def of(cls, request: PlanRequest, schedule: str) -> SearchSpace:
        """The space `request` lets the searches choose in for `schedule` (its `auto`s decoded: module docstring)."""
        recompute = request.recompute if request.recompute in ("full", "auto") else "none"
        return cls(micro_batches=request.micro_batches, schedules=(schedule,),
                   recompute=recompute,
                   precision=request.precision,
                   tensor=None if request.tensor == "auto" else (request.tensor,),
                   sharding=None if request.sharding == "auto" else (request.sharding,),
                   kernels=request.kernels)

    def but(self, **changes: object) -> SearchSpace:
        """This space with some choices changed (checked again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def unsplit(self) -> bool:
        """Whether no layer may split (tensor (1,))."""
        return self.tensor is not None and set(self.tensor) == {1}

    @property
    def cluster_only(self) -> list[str]:
        """What only the cluster search honours, in words: a fixed tensor degree > 1, a fixed sharding mode other than
        "none" (the device-list search chooses each stage's degree and never shards)."""
        fixed = [f"tensor degrees {list(self.tensor)}"] if self.tensor is not None and not self.unsplit else []
        if self.sharding is not None and set(self.sharding) != {"none"}:
            fixed.append(f"sharding {list(self.sharding)}")
        return fixed

    @property
    def recompute_modes(self) -> tuple[str, ...]:
        """The recomputation each search prices, in order ("auto": without first)."""
        return ("none", "full") if self.recompute == "auto" else (self.recompute,)

    def optimizer(self, given: str) -> str:
        """The optimizer states are counted for: the precision's, else `given`."""
        return self.precision.optimizer if self.precision is not None else given

    def tensor_degrees(self, possible: Sequence[int], where: str) -> list[int]:
        """The tensor degrees to search: those allowed, from `possible` (what the model and GPUs `where` take).

        Raises:
            PartitionError: a degree asked for that is not possible.
        """
        if self.tensor is None:
            return sorted(possible)
        unknown = sorted(set(self.tensor) - set(possible))
        if unknown:
            raise PartitionError(f"tensor degrees {unknown} cannot split this model on {where}; it can take "
                                 f"{sorted(possible)} (a split group's degree that divides the GPUs and a host's, "
                                 "or twice a host)")
        return sorted(set(self.tensor))

    def sharding_modes(self) -> tuple[str, ...]:
        """The sharding modes to price replicas under: those allowed; by default every mode with a precision (the
        states sharded at their own dtypes), "none" alone without one (every state at the model's dtype)."""
        if self.sharding is not None:
            return tuple(self.sharding)
        return tuple(SHARDING_MODES) if self.precision is not None else ("none",)

    def gradient_syncs(self) -> tuple[str, ...]:
        """When sharded stages reduce gradients, the values the "gradients" axis tries (search/axes.py): those allowed;
        by default "every" where zero2 or zero3 may be chosen (FULL_SHARD as trainers run it; each stage still
        chooses zero1, which accumulates whole gradients, where that is faster), else "last" (nothing to choose).
        Zero3 accumulating whole gradients is priced where asked for (("last",), or ("last", "every") to compare:
        each value one more run of the search, which the default spares the planning time of large clusters)."""
        if self.gradient_sync is not None:
            return tuple(self.gradient_sync)
        return ("every",) if {"zero2", "zero3"} & set(self.sharding_modes()) else ("last",)


ANY = SearchSpace()  # the searches choose every axis, with their default micro-batch counts and schedules
