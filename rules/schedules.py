"""What a schedule is, written once: a `ScheduleSpec` per schedule, in the registry everything reads by name.

A spec holds the schedule's generator and every rule the rest of the product needs about it:

    layout           chain  one stage per rank (replicas allowed): one list per stage, dealt to replicas
                     loop   v >= 2 stages per rank round robin, stage s on rank s % ranks (interleaved)
                     v      2 stages per rank in a V, rank r holds r and 2p - 1 - r (zbv, dualpipev)
    actions          (micro_batches, ranks, stages per rank) -> one action list per rank (chain: per stage)
    accepts          (micro_batches, ranks, stages per rank) -> None, or why it cannot run that count
    in_flight        closed form: micro-batches a stage holds at its peak (planners' memory, before lists)
    fill             closed form: step / the slowest stage's work (the hybrid and cluster searches)
    splits_backward  whether its lists hold W's (B computes the inputs' gradients only)
    replicas, dag    whether a chain stage may run on several ranks; a generator for a DAG of stages
    auto             its place among the schedules `schedule="auto"` compares (None: never)

The runtime (`runtime.launch.stage_layout`, `runtime.schedule_ranks.rank_schedule`, so lowering),
the plan's check, the planners, the simulators and the CLI choices read the registry, so a
schedule registered from outside (`register(ScheduleSpec(...))`) plans, runs, simulates and
draws with no other edit. A plan names its schedule as a string checked against the registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence, get_args

from rules.actions import Action
from rules.generators import (
    dag_gpipe,
    dualpipe_v,
    dualpipe_v_micro_batches,
    gpipe,
    interleaved_micro_batches,
    interleaved_one_f_one_b,
    one_f_one_b,
    v_stage_ranks,
    zero_bubble_h1,
    zero_bubble_v,
)

__all__ = [
    "LAYOUTS", "Layout", "ScheduleSpec", "auto_layouts", "either", "in_flight", "layout_ranks", "register",
    "schedule_names", "schedule_spec", "searched_names", "stage_ranks", "unregister", "virtual_stages",
]

Layout = Literal["chain", "loop", "v"]
LAYOUTS: tuple[str, ...] = get_args(Layout)
Actions = Callable[[int, int, int], list[list[Action]]]
Accepts = Callable[[int, int, int], "str | None"]
InFlight = Callable[[int, int, int, int], int]
Fill = Callable[[int, int], float]
DagActions = Callable[[int, Sequence[int], Sequence[int]], list[list[Action]]]


def _any_count(micro_batches: int, ranks: int, per_rank: int) -> str | None:
    return None


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule: its generator, layout and closed forms (see the module docstring).

    Attributes:
        name: what `partition(schedule=...)`, the CLI and `Plan.schedule` call it.
        actions: `actions(micro_batches, ranks, per_rank)`, one list of `Action`s per rank in
            order; for a chain, one list per stage of a `ranks`-stage pipeline (`per_rank` is 1).
        layout: "chain", "loop" or "v".
        in_flight: `in_flight(stage, stages, micro_batches, replicas)`, the micro-batches stage
            `stage` of `stages` holds at its peak when each of its `replicas` runs its share;
            None: no closed form (planners count them from the lists).
        fill: `fill(micro_batches, stages)`, the step over the slowest stage's work for a step
            (GPipe and 1F1B: (m + p - 1) / m); None: the hybrid and cluster searches do not plan it.
            Set only for a chain whose `in_flight` depends on stages - stage alone (the searches
            build pipelines from the last stage: they price a stage as stage 0 of the rest).
        splits_backward: its lists hold W's.
        replicas: a chain stage may run on several ranks (micro-batch i on replica i mod r).
        accepts: `accepts(micro_batches, ranks, per_rank)`: None, or the message saying why not.
        dag: `dag(micro_batches, levels, owner)`, one list per owner for a DAG of stages with one
            replica each (several stages may share an owner); None: chains only, one stage a rank.
        auto: its position among the schedules `schedule="auto"` compares (ties keep the
            earlier); None: never compared.
        doc: a few words for help texts ("2 stages per device").
    """

    name: str
    actions: Actions
    layout: Layout = "chain"
    in_flight: InFlight | None = None
    fill: Fill | None = None
    splits_backward: bool = False
    replicas: bool = True
    accepts: Accepts = _any_count
    dag: DagActions | None = None
    auto: int | None = None
    doc: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name == "auto" or self.name != self.name.strip():
            raise ValueError(f"schedule name {self.name!r}: use a non-empty name other than 'auto', without spaces "
                             "around it")
        if self.layout not in LAYOUTS:
            raise ValueError(f"schedule {self.name!r} has layout={self.layout!r}; use one of {', '.join(LAYOUTS)}")
        if self.layout != "chain" and (self.replicas or self.dag is not None or self.fill is not None):
            raise ValueError(f"schedule {self.name!r}: a {self.layout} layout runs one replica per stage on its own "
                             "layout; pass replicas=False and no dag or fill (those are for chains)")
        if self.fill is not None and self.in_flight is None:
            raise ValueError(f"schedule {self.name!r} has a fill but no in_flight: the searches that read fill "
                             "price memory with in_flight; give both")


_REGISTRY: dict[str, ScheduleSpec] = {}


def register(spec: ScheduleSpec, *, replace: bool = False) -> ScheduleSpec:
    """Add `spec` to the registry (names keep their registration order); returns it.

    Raises:
        ValueError: the name is taken and `replace` is False.
    """
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"schedule {spec.name!r} is registered already; pick another name, or pass replace=True")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a registered schedule (tests register toys and take them away). Raises ValueError if unknown."""
    schedule_spec(name)
    del _REGISTRY[name]


def schedule_names() -> tuple[str, ...]:
    """The registered schedules' names, in registration order (the built-ins first)."""
    return tuple(_REGISTRY)


def searched_names() -> tuple[str, ...]:
    """The schedules the hybrid and cluster searches can plan (those with a `fill`), in registration order."""
    return tuple(n for n, spec in _REGISTRY.items() if spec.fill is not None)


def either(names: Sequence[str]) -> str:
    """['a', 'b', 'c'] -> "'a', 'b' or 'c'" (the lists error messages offer)."""
    quoted = [repr(n) for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec registered as `name`. Raises ValueError naming the known schedules."""
    spec = _REGISTRY.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown schedule {name!r}; use {either(schedule_names())} "
                         "(or register one: rules.schedules.register)")
    return spec


def layout_ranks(layout: Layout, ranks: int, per_rank: int) -> list[list[int]]:
    """The ranks of each stage of a layout with one replica per stage, on `ranks` ranks.

        chain            stage s on rank s                      [[0], [1], [2]]
        loop, per_rank=2 stage s on rank s % ranks              [[0], [1], [2], [0], [1], [2]]
        v                rank r holds r and 2 ranks - 1 - r    [[0], [1], [2], [2], [1], [0]]
    """
    if layout == "v":
        return v_stage_ranks(ranks)
    return [[s % ranks] for s in range(ranks * (per_rank if layout == "loop" else 1))]


def stage_ranks(schedule: str, ranks: int, replicas: Sequence[int] | None, per_rank: int) -> list[list[int]]:
    """The ranks of each stage: stage by stage with replicas (chains); round robin (loop); a V (v).

    Raises:
        ValueError: an unknown schedule, replicas it cannot run or that do not add up to `ranks`,
            or a stage count per rank its layout does not hold.
    """
    spec = schedule_spec(schedule)
    replicated = replicas is not None and any(r != 1 for r in replicas)
    if replicated and not spec.replicas:
        others = [s.name for s in _REGISTRY.values() if s.replicas]
        raise ValueError(f"schedule={schedule!r} runs one replica per stage; drop replicas or use {either(others)}")
    if spec.layout == "v":
        if per_rank != 2:
            raise ValueError(f"virtual_stages={per_rank}; {schedule} holds exactly 2 stages per rank: pass 2")
        return layout_ranks("v", ranks, 2)
    if spec.layout == "loop":
        if per_rank < 2:
            raise ValueError(f"virtual_stages={per_rank}; {schedule} interleaves 2 or more stages per rank: pass 2 "
                             "or more")
        return layout_ranks("loop", ranks, per_rank)
    counts = list(replicas) if replicas is not None else [1] * ranks
    if any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in counts) or sum(counts) != ranks:
        raise ValueError(f"replicas={counts} must be positive integers adding up to the {ranks} ranks of the job")
    starts = [sum(counts[:s]) for s in range(len(counts))]
    return [list(range(a, a + r)) for a, r in zip(starts, counts)]


def virtual_stages(schedule: str, stage_ranks: Sequence[Sequence[int]]) -> int:
    """Stages per rank of a loop or V layout (stages // ranks holding them, at least 1); 1 for a chain."""
    if schedule_spec(schedule).layout == "chain":
        return 1
    ranks = {r for rs in stage_ranks for r in rs}
    return max(1, len(stage_ranks) // max(1, len(ranks)))


def auto_layouts(layout: Sequence[Sequence[int]], micro_batches: int, *,
                 searched: bool = False) -> dict[str, list[list[int]]]:
    """The schedules `schedule="auto"` compares on `layout`, in their `auto` order, each with its stage ranks.

    A chain runs `layout` (one stage per rank, or replicated stages where it allows replicas); a
    loop or V needs one replica per stage and 2 ranks or more, and runs 2 stages per rank.
    `searched`: only those the hybrid search plans (with a `fill`). A schedule that does not
    accept the micro-batch count is left out.
    """
    chain = [list(r) for r in layout]
    world = 1 + max(r for ranks in layout for r in ranks)
    single = all(len(r) == 1 for r in layout)
    out: dict[str, list[list[int]]] = {}
    for spec in sorted((s for s in _REGISTRY.values() if s.auto is not None), key=lambda s: s.auto or 0):
        if searched and spec.fill is None:
            continue
        if spec.layout == "chain":
            if (single or spec.replicas) and spec.accepts(micro_batches, len(chain), 1) is None:
                out[spec.name] = chain
        elif world > 1 and single and spec.accepts(micro_batches, world, 2) is None:
            out[spec.name] = layout_ranks(spec.layout, world, 2)
    return out


def in_flight(schedule: str, stage: int, stages: int, micro_batches: int, replicas: int = 1) -> int:
    """Micro-batches whose activations stage `stage` (0-based) of `stages` holds at its peak: the closed form.

    GPipe runs every forward before any backward: all m. 1F1B starts p - s forwards, then
    alternates one backward and one forward: min(p - s, m). ZB-H1 keeps each to its W: min(p, m).
    With r replicas each runs its own share, ceil(m / r). Names match without case, '-' or '_'.

    Raises:
        ValueError: an unknown schedule, one without a closed form, or a stage outside 0..stages-1.
    """
    if stages < 1 or micro_batches < 1 or replicas < 1 or not 0 <= stage < stages:
        raise ValueError(
            f"stage={stage}, stages={stages}, micro_batches={micro_batches}, replicas={replicas}: "
            "need 0 <= stage < stages, micro_batches >= 1 and replicas >= 1"
        )
    spec = _REGISTRY.get(schedule) or schedule_spec({_plain(n): n for n in _REGISTRY}.get(_plain(schedule), schedule))
    if spec.in_flight is None:
        raise ValueError(f"schedule {spec.name!r} has no closed form for micro-batches in flight; count them from "
                         "its action lists (rules.actions.peak_in_flight)")
    return spec.in_flight(stage, stages, micro_batches, replicas)


def _plain(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


# The built-in schedules. Generators take (micro_batches, stages) or (micro_batches, ranks); a spec's
# `actions` takes (micro_batches, ranks, per_rank) for every layout.


def _gpipe(m: int, p: int, _per_rank: int) -> list[list[Action]]:
    return gpipe(m, p)


def _one_f_one_b(m: int, p: int, _per_rank: int) -> list[list[Action]]:
    return one_f_one_b(m, p)


def _zero_bubble_h1(m: int, p: int, _per_rank: int) -> list[list[Action]]:
    return zero_bubble_h1(m, p)


def _zero_bubble_v(m: int, ranks: int, _per_rank: int) -> list[list[Action]]:
    return zero_bubble_v(m, ranks)


def _dualpipe_v(m: int, ranks: int, _per_rank: int) -> list[list[Action]]:
    return dualpipe_v(m, ranks)


def _all_in_flight(stage: int, stages: int, m: int, r: int) -> int:
    return -(-m // r)


def _depth_in_flight(stage: int, stages: int, m: int, r: int) -> int:
    return min(stages - stage, -(-m // r))  # [Note: a replica runs its own 1F1B] in runtime/schedule_ranks.py


def _pipeline_in_flight(stage: int, stages: int, m: int, r: int) -> int:
    return min(stages, -(-m // r))


def _fill_drain(m: int, p: int) -> float:
    return (m + p - 1) / m


for _spec in (
    ScheduleSpec("gpipe", _gpipe, in_flight=_all_in_flight, fill=_fill_drain, dag=dag_gpipe, auto=1),
    ScheduleSpec("1f1b", _one_f_one_b, in_flight=_depth_in_flight, fill=_fill_drain, auto=0),
    ScheduleSpec("interleaved", interleaved_one_f_one_b, "loop", replicas=False, accepts=interleaved_micro_batches,
                 auto=3, doc="2 stages per device"),
    ScheduleSpec("zb1", _zero_bubble_h1, in_flight=_pipeline_in_flight, splits_backward=True, auto=2,
                 doc="zero-bubble ZB-H1"),
    ScheduleSpec("zbv", _zero_bubble_v, "v", splits_backward=True, replicas=False, auto=4,
                 doc="zero-bubble, 2 stages per device in a V"),
    ScheduleSpec("dualpipev", _dualpipe_v, "v", splits_backward=True, replicas=False,
                 accepts=dualpipe_v_micro_batches, auto=5, doc="DualPipeV on zbv's V; micro-batches >= 2 x devices"),
):
    register(_spec)
