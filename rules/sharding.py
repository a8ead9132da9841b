"""Sharded data parallelism modes: what each keeps gathered and when it reduces gradients (one rule: run and priced).

[Note: sharding modes]
A stage's weights are sharded over its data-parallel ranks by PyTorch's FSDP2 (runtime/sharding.py:
one FSDP unit per repeated block, then the stage's root), and cost_model/precision.py prices what
each mode holds. Both read this table, so the rule cannot drift between them. d is the shard degree.

    mode   weights forward reads                     gradients                         stored weights, optimizer
    none   full on every replica (no FSDP: the       full (all-reduced)                full
           runtime's bucketed all-reduce)
    zero1  gathered at the step's first forward,     accumulated unsharded, reduce-    1/d (the shard FSDP2 keeps)
           kept to its last backward, then freed     scattered once, after the last
    zero2  gathered per micro-batch, each block      reduce-scattered per micro-batch  1/d
           kept from its forward to its backward     ("every") or once ("last")
    zero3  gathered per block for its forward,       as zero2                          1/d
           freed, gathered again for its backward

FSDP2 always stores the shard only (a DTensor; the optimizer steps on it), so "zero1" and "zero2"
are FSDP2 keeping the gathered copy longer, not a replicated model: zero1 = reshard_after_forward
False and reshard_after_backward False but on the last micro-batch (one all-gather and one
reduce-scatter a step: an all-reduce's volume, as ZeRO-1 moves), zero2 = reshard_after_forward
False, zero3 = True. Gradient sync "last" (torch.distributed.pipelining's rule: no reduction until
the last micro-batch's backward) makes FSDP2 accumulate every block's gradients unsharded between
micro-batches, so with more than one micro-batch it holds the full gradients there; "every"
reduce-scatters each micro-batch (gradients at 1/d, m reduce-scatters a step). Trainers call "every" under
zero3 FULL_SHARD; "last" under zero3 is accumulating whole gradients and reducing once a step, a different
mode priced apart (cost_model/data_parallel.py, cost_model/training_memory.py). A plan names each stage's
(StagePlan.gradient_sync); the searches choose it (search/axes.py's "gradients" axis; `stage_sync` says what
a stage of each mode runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["GRADIENT_SYNCS", "SHARDING_MODES", "GradientSync", "ModeRule", "ShardingMode", "accumulates_unsharded",
           "mode_rule", "reduces", "sharding_problem", "stage_sync"]  # fmt: skip

ShardingMode = Literal["none", "zero1", "zero2", "zero3"]
GradientSync = Literal["last", "every"]
SHARDING_MODES: tuple[str, ...] = get_args(ShardingMode)
GRADIENT_SYNCS: tuple[str, ...] = get_args(GradientSync)


@dataclass(frozen=True)
class ModeRule:
    """What one mode does (see [Note: sharding modes]).

    sharded: FSDP2 runs it (the stored weights, gradients and optimizer state are 1/d).
    reshard_after_forward: FSDP2's `fully_shard(reshard_after_forward=)` for every unit.
    keep_gathered: the weights stay gathered from the step's first forward to its last backward.
    """

    sharded: bool
    reshard_after_forward: bool
    keep_gathered: bool


_RULES = {
    "none": ModeRule(sharded=False, reshard_after_forward=False, keep_gathered=True),
    "zero1": ModeRule(sharded=True, reshard_after_forward=False, keep_gathered=True),
    "zero2": ModeRule(sharded=True, reshard_after_forward=False, keep_gathered=False),
    "zero3": ModeRule(sharded=True, reshard_after_forward=True, keep_gathered=False),
}


def mode_rule(mode: str, gradient_sync: str = "last") -> ModeRule:
    """The rule of `mode`.

    Raises:
        ValueError: an unknown mode or gradient sync, or zero1 with gradient_sync="every" (zero1
            reduces once a step by definition; per-micro-batch reduction is zero2).
    """
    if mode not in _RULES:
        raise ValueError(f"sharding mode {mode!r} is not one of {list(SHARDING_MODES)}")
    if gradient_sync not in GRADIENT_SYNCS:
        raise ValueError(f"gradient_sync {gradient_sync!r} is not one of {list(GRADIENT_SYNCS)}")
    if mode == "zero1" and gradient_sync == "every":
        raise ValueError("zero1 reduces its gradients once a step, after the last micro-batch; "
                         "for a reduce-scatter every micro-batch use 'zero2' (or 'zero3')")
    return _RULES[mode]


def sharding_problem(mode: object, *, precision: bool) -> str | None:
    """Why replicas cannot be planned sharded by `mode`, or None: not a mode, or a sharded mode without a
    training precision (a sharded state is counted at its own dtype: `precision=` gives them). The one check of
    a mode's validity for planning: the request's and the searches' (a Plan's own stages are checked where it runs).
    """
    if not isinstance(mode, str) or mode not in _RULES:
        return f"sharding={mode!r}; use one of {', '.join(map(repr, SHARDING_MODES))}"
    if mode != "none" and not precision:
        return (f"sharding={mode!r} needs the training precision its sharded states are counted at: give "
                "precision= (e.g. 'mixed'), or use sharding='none'")
    return None


def stage_sync(mode: str, gradient_sync: str) -> GradientSync:
    """The gradient sync a stage sharded by `mode` runs when a plan asks for `gradient_sync`: "every" (FULL_SHARD:
    reduce-scatter after each micro-batch's backward, only the shard kept) where the mode reduce-scatters per
    micro-batch at all (zero2, zero3), else "last" (zero1 reduces once a step by definition; "none" is DDP's).

    Raises:
        ValueError: an unknown mode or gradient sync.
    """
    mode_rule(mode)
    if gradient_sync not in GRADIENT_SYNCS:
        raise ValueError(f"gradient_sync {gradient_sync!r} is not one of {list(GRADIENT_SYNCS)}")
    return "every" if gradient_sync == "every" and mode in ("zero2", "zero3") else "last"


def reduces(mode: str, gradient_sync: str, last: bool) -> bool:
    """Whether a micro-batch's backward reduces the gradients (the last one always does)."""
    mode_rule(mode, gradient_sync)
    return last or gradient_sync == "every"


def accumulates_unsharded(mode: str, gradient_sync: str, micro_batches: int) -> bool:
    """Whether a sharded stage holds its full unsharded gradients between micro-batches (see the Note)."""
    rule = mode_rule(mode, gradient_sync)
    return rule.sharded and micro_batches > 1 and gradient_sync == "last"
