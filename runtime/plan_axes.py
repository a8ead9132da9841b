"""What keeps a stage's axes inside a replica from running: tensor split, sharding, experts, sequence; and its ranks.

[Note: ranks of a split stage] A stage's replica j runs on `width` = context x tensor consecutive ranks
from ranks[j], tensor innermost (torchtitan's mesh order, ... cp, tp):

    ranks [0, 4], context 2, tensor 2:   replica 0: 0 1 | 2 3     replica 1: 4 5 | 6 7
                                                   c=0   c=1                 c=0   c=1
    tensor groups  (0, 1) (2, 3) (4, 5) (6, 7)      context groups  (0, 2) (1, 3) (4, 6) (5, 7)

Experts split over replicas (`expert` of them, consecutive): with expert 2, (0, 4) and (1, 5), ...
dispatch their tokens to each other. A rank holds one replica of a stage at most, and the stages a
rank holds (interleaved, V) share its group.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from rules.sharding import GRADIENT_SYNCS, SHARDING_MODES
from runtime.tensor_parallel_spec import TensorParallelGroup

__all__ = ["axis_problems", "rank_problems"]


class _Stage(Protocol):  # runtime.plan.StagePlan, read only
    @property
    def index(self) -> int: ...

    @property
    def ranks(self) -> list[int]: ...

    @property
    def tensor(self) -> int: ...

    @property
    def tensor_groups(self) -> list[TensorParallelGroup]: ...

    @property
    def sharding(self) -> str: ...

    @property
    def gradient_sync(self) -> str: ...

    @property
    def expert(self) -> int: ...

    @property
    def expert_layers(self) -> list[str]: ...

    @property
    def context(self) -> int: ...

    @property
    def context_attention(self) -> list[str]: ...

    @property
    def replicas(self) -> int: ...

    @property
    def width(self) -> int: ...

    @property
    def rank_groups(self) -> list[list[int]]: ...

    @property
    def all_ranks(self) -> list[int]: ...


def _degree(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def axis_problems(k: int, s: _Stage, data_split: str) -> list[str]:
    """What keeps stage k's layer split, sharding, expert split and sequence split from running."""
    problems = []
    if not _degree(s.tensor):
        problems.append(f"stages[{k}].tensor={s.tensor!r}; use an integer >= 1 (1: layers whole)")
    elif s.tensor == 1 and s.tensor_groups:
        problems.append(f"stages[{k}] splits {len(s.tensor_groups)} layer groups over tensor=1 rank; set tensor to "
                        "the ranks that split them, or drop tensor_groups")
    elif s.tensor > 1 and not s.tensor_groups:
        problems.append(f"stages[{k}].tensor={s.tensor} but it names no tensor_groups to split; list them "
                        "(partitioner.capture.shardable), or use tensor=1")
    if s.sharding not in SHARDING_MODES:
        problems.append(f"stages[{k}].sharding={s.sharding!r}; use one of {', '.join(SHARDING_MODES)}")
    elif s.sharding != "none" and data_split != "slice":
        problems.append(f"stages[{k}].sharding={s.sharding!r} shards over replicas that run every micro-batch in "
                        "lockstep: set the plan's data_split='slice'")
    if s.gradient_sync not in GRADIENT_SYNCS:
        problems.append(f"stages[{k}].gradient_sync={s.gradient_sync!r}; use one of {', '.join(GRADIENT_SYNCS)}")
    elif s.gradient_sync == "every" and s.sharding not in ("zero2", "zero3"):
        problems.append(f"stages[{k}].gradient_sync='every' (reduce-scatter per micro-batch) needs sharding 'zero2' "
                        f"or 'zero3', not {s.sharding!r}; use gradient_sync='last'")
    if not _degree(s.expert):
        problems.append(f"stages[{k}].expert={s.expert!r}; use an integer >= 1 (1: every replica holds every expert)")
    elif s.expert == 1 and s.expert_layers:
        problems.append(f"stages[{k}] splits the experts of {len(s.expert_layers)} layers over expert=1 replica; set "
                        "expert to the replicas that split them, or drop expert_layers")
    elif s.expert > 1:
        if not s.expert_layers:
            problems.append(f"stages[{k}].expert={s.expert} but it names no expert_layers to split; list them "
                            "(partitioner.capture.experts), or use expert=1")
        if s.replicas % s.expert:
            problems.append(f"stages[{k}].expert={s.expert} splits experts over replicas, but the stage has "
                            f"{s.replicas}; use a divisor of {s.replicas}, or a multiple of {s.expert} replicas")
        if data_split != "slice":
            problems.append(f"stages[{k}].expert={s.expert}: replicas dispatch tokens to each other in every "
                            "forward and backward, so they run every micro-batch in lockstep: set the plan's "
                            "data_split='slice'")
    if not _degree(s.context):
        problems.append(f"stages[{k}].context={s.context!r}; use an integer >= 1 (1: the sequence whole)")
    elif s.context == 1 and s.context_attention:
        problems.append(f"stages[{k}] splits the sequence of {len(s.context_attention)} attentions over context=1 "
                        "rank; set context to the ranks that split it, or drop context_attention")
    elif s.context > 1 and data_split != "slice":
        problems.append(f"stages[{k}].context={s.context}: a replica's context ranks run its micro-batches together, "
                        "with programs lowered where they run (as sliced replicas): set the plan's "
                        "data_split='slice'")
    return problems


def rank_problems(stages: Sequence[_Stage]) -> list[str]:
    """Replicas that overlap, and a rank in two groups of different shapes (see [Note: ranks of a split stage])."""
    problems = []
    group_of: dict[int, tuple[int, int, int]] = {}  # rank -> (first rank of its group, tensor, context)
    for s in stages:
        if not _degree(s.tensor) or not _degree(s.context):
            continue
        if len(set(s.all_ranks)) != len(s.all_ranks):
            problems.append(f"stage {s.index}'s replicas overlap: ranks {s.ranks} with tensor={s.tensor} x "
                            f"context={s.context} give {s.rank_groups}; space replicas by tensor x context")
        for group in s.rank_groups:
            for r in group:
                seen = group_of.setdefault(r, (group[0], s.tensor, s.context))
                if seen != (group[0], s.tensor, s.context):
                    problems.append(f"rank {r} runs stage {s.index} in the group {group} but also in a group from "
                                    f"rank {seen[0]} with tensor={seen[1]}, context={seen[2]}; stages on one rank "
                                    "share its group")
    return problems
