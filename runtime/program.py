"""Per-rank programs: a schedule's compute actions lowered to everything a rank does in a step.

A schedule (runtime.schedule_ranks) says which forwards and backwards each rank runs, in order.
`lower` turns it into each rank's whole step: compute, the sends and receives that connect
stages on different ranks, gradient all-reduces, and the end of the step. The same programs
are run by the interpreter (runtime.interpreter), priced by the simulator and drawn by the
visualizer, so what is drawn is what runs.

[Note: one agreed order]
NCCL pairs the point-to-point operations of two ranks in posting order, in both directions
on one stream, and ignores tags. `lower` therefore replays the schedule in lock-step ticks
(every rank whose next action has its inputs runs it) and gives each transfer the tick of
the action that produced it. After its compute of tick t, a rank posts one batch with every
send and receive of tick t, sorted by one key on both sides:

    tick:    0           1                 2
    rank 0:  F s0 mb0 |  F s0 mb1        |  ...
             SEND s0->s1 mb0 r1 t0   SEND s0->s1 mb1 r1 t1
    rank 1:           |  F s1 mb0        |  F s1 mb1
             RECV s0->s1 mb0 r0 t0   RECV s0->s1 mb1 r0 t1

Batch t only waits for work of ticks below t, so by induction every batch completes: no
rank pair can wait on each other, whatever NCCL serializes. All-reduces of a group of ranks
come after the tick of the group's last backward (B or W), in one global order. A W (the
weight part of a split backward) waits for its B on the same rank and moves nothing.

Split layers and sequences ([Note: ranks of a split stage] in runtime/plan_axes.py) keep this
order. `plan_programs` lowers over each replica's first rank (a sliced plan as the dealt one of
m * d micro-batches: slice j of micro-batch i is piece i * d + j of the batch), then copies each
program to the w - 1 peers of its rank (`split_programs`; w = tensor x context, the ranks of a
replica). A message from stage a (width wa) to stage b (width wb) goes to every rank k_b of b's
replica from rank k_b mod wa of a's (values at a stage boundary are whole on every rank of a replica,
split layers and sequences alike, but a sequence kept split between stages of one width: rank k sends
its tokens to rank k, [Note: boundaries that stay split] in runtime/context_parallel.py), so the
sender's one SEND becomes a SEND to each such k_b, in rank order, and an all-reduce group moves to
the ranks of the same index. The ops two ranks exchange at tick t are copies of those their leaders
exchange at tick t, sorted by the leaders' key on both sides, and peers compute at their leader's
ticks, so batch t still waits only for ticks below t.
The collectives inside an F or B (DTensor's, over the tensor group; FSDP2's, over a sharded stage's
replicas; the all-gathers of a split sequence; the all-to-alls of split experts, over sliced
replicas) are posted by every rank of their group in the same op of the same program position: a
replica's peers run one program, sliced replicas the same program on their own micro-batches (see
[Note: one order of TP collectives] in runtime/tensor_parallel.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from runtime.ops import Op, OpKind, Program, format_program, parse_program
from runtime.plan import Plan
from runtime.schedule import Action
from runtime.schedule_ranks import rank_schedule

__all__ = ["Op", "OpKind", "Program", "action_deps", "format_program", "lower", "parse_program", "plan_programs",
           "split_programs", "stage_readers"]


def stage_readers(producers: Sequence[Sequence[int]]) -> list[list[int]]:
    """For each stage, the stages that read its values (`producers` inverted), in stage order."""
    readers: list[list[int]] = [[] for _ in producers]
    for s, ps in enumerate(producers):
        for p in ps:
            readers[p].append(s)
    return readers


def action_deps(a: Action, producers: Sequence[Sequence[int]], consumers: Sequence[Sequence[int]]) -> list[Action]:
    """What `a` waits for: a forward, its producers' forwards; a backward, its forward and consumers'
    (`stage_readers`) backwards; a W, its own B (W moves nothing between stages)."""
    if a.kind == "F":
        return [Action(p, "F", a.microbatch) for p in producers[a.stage]]
    if a.kind == "W":
        return [Action(a.stage, "B", a.microbatch)]
    return [Action(a.stage, "F", a.microbatch)] + [Action(c, "B", a.microbatch) for c in consumers[a.stage]]


def lower(
    schedule: Sequence[Sequence[Action]],
    producers: Sequence[Sequence[int]],
    stage_ranks: Sequence[Sequence[int]],
    devices: Sequence[str],
    groups: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
    *,
    forward_only: bool = False,
) -> list[Program]:
    """Each rank's program for one step of `schedule` (see [Note: one agreed order]).

    Args:
        schedule: per rank, its forward and backward actions in order (`schedule[r]`); a B
            with a W of the same stage and micro-batch is lowered as a split B.
        producers: for each stage, the stages whose values it reads.
        stage_ranks: for each stage, the ranks of its replicas; micro-batch i runs on
            replica i mod r.
        devices: the device of each rank.
        groups: (ranks, stages) of each set of weights held by several ranks: their
            gradients are all-reduced over `ranks` after the last backward of `stages`.
        forward_only: drop backwards (B and W), gradient messages and all-reduces (inference).

    Raises:
        ValueError: an action on a rank that does not run its stage's micro-batch, an action
            listed twice, or a schedule whose lists wait on each other forever (named, with
            what each waits on).
    """
    consumers = stage_readers(producers)
    lists = [[a for a in actions if not (forward_only and a.kind != "F")] for actions in schedule]

    def rank_of(stage: int, mb: int) -> int:
        ranks = stage_ranks[stage]
        return ranks[mb % len(ranks)]

    seen: dict[Action, int] = {}
    for r, actions in enumerate(lists):
        for a in actions:
            if rank_of(a.stage, a.microbatch) != r:
                raise ValueError(f"rank {r}'s schedule runs {a}, but stage {a.stage} runs micro-batch {a.microbatch} "
                                 f"on rank {rank_of(a.stage, a.microbatch)}")
            if a in seen:
                raise ValueError(f"{a} is listed twice (ranks {seen[a]} and {r}); list each action once")
            seen[a] = r
    tick_of: dict[Action, int] = {}
    pointer = [0] * len(lists)
    total = sum(len(actions) for actions in lists)
    tick = 0
    while len(tick_of) < total:
        ready = [
            r for r, actions in enumerate(lists)
            if pointer[r] < len(actions)
            and all(d in tick_of for d in action_deps(actions[pointer[r]], producers, consumers)
                    if not (forward_only and d.kind == "B"))
        ]
        if not ready:
            waiting = "; ".join(
                f"rank {r} at {lists[r][pointer[r]]}" for r in range(len(lists)) if pointer[r] < len(lists[r])
            )
            raise ValueError(f"the schedule deadlocks: no rank can run its next action ({waiting})")
        for r in ready:
            tick_of[lists[r][pointer[r]]] = tick
            pointer[r] += 1
        tick += 1

    batches: dict[tuple[int, int], list[Op]] = {}  # (rank, tick) -> its sends and receives
    for a, t in tick_of.items():
        if a.kind == "W":
            continue
        src_rank = rank_of(a.stage, a.microbatch)
        targets = consumers[a.stage] if a.kind == "F" else producers[a.stage]
        for other in targets:
            dst_rank = rank_of(other, a.microbatch)
            if dst_rank == src_rank:
                continue
            batches.setdefault((src_rank, t), []).append(Op("SEND", microbatch=a.microbatch, src=a.stage, dst=other,
                                                            peer=dst_rank, tick=t))
            batches.setdefault((dst_rank, t), []).append(Op("RECV", microbatch=a.microbatch, src=a.stage, dst=other,
                                                            peer=src_rank, tick=t))
    reduce_after: dict[int, list[tuple[int, ...]]] = {}  # tick -> the rank groups all-reduced after it
    if not forward_only:
        for ranks, group_stages in groups:
            members = tuple(sorted(set(ranks)))
            if len(members) < 2:
                continue
            last = max((t for a, t in tick_of.items() if a.kind != "F" and a.stage in group_stages), default=tick - 1)
            reduce_after.setdefault(last, []).append(members)

    programs: list[Program] = []
    for r, actions in enumerate(lists):
        ops: list[Op] = []
        by_tick = {tick_of[a]: a for a in actions}
        for t in range(tick):
            action = by_tick.get(t)
            if action is not None:
                split = action.kind == "B" and Action(action.stage, "W", action.microbatch) in tick_of
                ops.append(Op(action.kind, stage=action.stage, microbatch=action.microbatch, tick=t, split=split))
            ops += sorted(batches.get((r, t), []), key=lambda op: (op.key(), op.kind))
            for members in sorted(reduce_after.get(t, [])):
                if r in members:
                    ops.append(Op("AR", group=members, tick=t))
        ops.append(Op("STEP"))
        programs.append(Program(rank=r, device=devices[r], ops=ops))
    return programs


def plan_programs(
    plan: Plan,
    groups: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
    *,
    forward_only: bool = False,
    devices: Mapping[int, str] | None = None,
) -> list[Program]:
    """The programs of `plan`: its schedule's action lists (runtime.schedule_ranks.rank_schedule), lowered.

    Stage s runs on `plan.stages[s].ranks` (default: rank s) and reads `reads_from`. `groups`
    are (ranks, stages) of weights held by several ranks (ranks: each replica's first rank); a
    group of one sharded stage's weights gets no all-reduce (FSDP2 reduces them). Every rank up to
    the highest in `devices` or the stages gets a program; one that runs no stage (an unused
    device slot) only STEP. A rank's device is `devices[rank]`, else that of its first stage. A
    stage that recomputes selectively runs its backward whole (no W): torch's selective checkpoint
    allows one backward per region, and a split backward needs two. Split layers and sliced
    replicas: see [Note: one agreed order].
    """
    stage_ranks = [list(s.ranks) or [s.index] for s in plan.stages]
    producers = [list(s.reads_from) for s in plan.stages]
    names: dict[int, str] = dict(devices or {})
    for s, ranks in zip(plan.stages, stage_ranks):
        for r in ranks:
            for peer in range(r, r + s.width):
                names.setdefault(peer, s.device)
    world = 1 + max(names)
    sharded = {s.index for s in plan.stages if s.sharding != "none"}
    groups = [(r, st) for r, st in groups if not (len(set(st)) == 1 and st[0] in sharded)]
    split = any(s.width > 1 for s in plan.stages)
    leaders = sorted({r for ranks in stage_ranks for r in ranks}) if split else list(range(world))
    index = {r: i for i, r in enumerate(leaders)}  # split layers: lowered over the first ranks, numbered 0, 1, ...
    if split:
        stage_ranks = [[index[r] for r in ranks] for ranks in stage_ranks]
        groups = [([index[r] for r in ranks], st) for ranks, st in groups]
    micro_batches = plan.pieces  # a sliced plan runs as the dealt one of m x replicas (see [Note: one agreed order])
    lists = rank_schedule(plan.schedule, micro_batches, stage_ranks, producers)
    whole = {s.index for s in plan.stages if s.recompute == "selective"}
    lists = [[a for a in actions if not (a.kind == "W" and a.stage in whole)] for actions in lists]
    lists += [[] for _ in range(len(leaders) - len(lists))]
    programs = lower(lists, producers, stage_ranks, [names.get(r, "cpu") for r in leaders], groups,
                     forward_only=forward_only)
    if not split:
        return programs
    by_rank = {r: Program(r, names.get(r, "cpu"), [Op("STEP")]) for r in range(world)}
    for p in programs:  # back to the first ranks' own numbers
        by_rank[leaders[p.rank]] = Program(leaders[p.rank], p.device, [
            replace(op, peer=leaders[op.peer] if op.peer >= 0 else -1, group=tuple(leaders[g] for g in op.group))
            for op in p.ops])
    return split_programs([by_rank[r] for r in range(world)], plan)


def split_programs(programs: Sequence[Program], plan: Plan) -> list[Program]:
    """Programs lowered over each replica's first rank, copied to its peers (see [Note: one agreed order]).

    `programs[r]` is rank r's; a peer's own (nothing to run) is replaced by its first rank's, with messages
    and all-reduce groups moved to the ranks of its index in the replica.

    Raises:
        ValueError: an all-reduce over ranks of different widths (a weight two stages share whose tensor or
            context degrees differ: give them one degree).
    """
    tensor = [s.width for s in plan.stages]
    place: dict[int, tuple[int, int, int]] = {}  # rank -> (its group's first rank, its index, the group's degree)
    for s in plan.stages:
        for group in s.rank_groups:
            for k, r in enumerate(group):
                place[r] = (group[0], k, s.width)

    def degree(r: int) -> int:
        return place.get(r, (r, 0, 1))[2]

    out: list[Program] = []
    for program in programs:
        first, k, _ = place.get(program.rank, (program.rank, 0, 1))
        ops: list[Op] = []
        for op in programs[first].ops:
            if op.kind == "SEND":  # to every rank of the reader's group whose index is k modulo the sender's degree
                ops += [replace(op, peer=op.peer + kb) for kb in range(k, tensor[op.dst], tensor[op.src])]
            elif op.kind == "RECV":
                ops.append(replace(op, peer=op.peer + k % tensor[op.src]))
            elif op.kind == "AR":
                if len({degree(r) for r in op.group}) > 1:
                    raise ValueError(f"ranks {list(op.group)} all-reduce weights they share, but their stages hold "
                                     f"{[degree(r) for r in op.group]} ranks per replica; stages sharing a weight need "
                                     "one tensor and context degree")
                ops.append(replace(op, group=tuple(r + k for r in op.group)))
            else:
                ops.append(op)
        out.append(Program(program.rank, program.device, ops))
    return out
