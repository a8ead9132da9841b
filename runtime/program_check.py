"""Whether a plan's programs run its stages: each micro-batch's forward and backward once, on its rank, in order.

Programs are written once when a plan is made (runtime.program.lower) and read back from JSON, so
a hand edit (micro_batches 4 -> 8, a stage moved to another rank, an op deleted) would leave
programs that run another step than the plan says: micro-batches never run, or ops naming
micro-batches, stages or ranks that do not exist. `program_problems` names each mismatch; the
fix is to let the runtime lower the programs again (`plan.programs = []`, or drop "programs"
from the JSON).
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from runtime.ops import Program

__all__ = ["program_problems"]

_FIX = "regenerate them (plan.programs = [], or drop \"programs\" from the JSON)"
_SHOWN = 4  # mismatches named per kind


def _listed(items: Sequence[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def program_problems(
    programs: Sequence[Program],
    stage_ranks: Sequence[Sequence[int]],
    stage_devices: Sequence[str],
    micro_batches: int,
    dealt: bool = True,
) -> list[str]:
    """What keeps `programs` from running the plan's step; [] when they do (or when there are none).

    `stage_ranks[s]` are stage s's replicas (micro-batch i on `ranks[i % len(ranks)]`, default [s])
    and `stage_devices[s]` the device of its first. `dealt` False (a split or sliced plan, whose
    programs are laid out over more ranks than `stage_ranks`): only ranges and counts are checked.
    """
    if not programs:
        return []
    stages, world = len(stage_ranks), len(programs)
    ranks = [list(r) or [s] for s, r in enumerate(stage_ranks)]
    problems = [f"programs[{k}].rank is {p.rank}; number programs 0, 1, 2, ... in order"
                for k, p in enumerate(programs) if p.rank != k]
    bad: list[str] = []
    for p in programs:
        for op in p.ops:
            if op.is_compute and not (0 <= op.stage < stages and 0 <= op.microbatch < micro_batches):
                bad.append(f"{op} on rank {p.rank}")
            elif op.is_p2p and not (0 <= op.src < stages and 0 <= op.dst < stages and 0 <= op.microbatch
                                    < micro_batches and 0 <= op.peer < world):
                bad.append(f"{op} on rank {p.rank}")
            elif op.kind == "AR" and not all(0 <= r < world for r in op.group):
                bad.append(f"{op} on rank {p.rank}")
    if bad:
        problems.append(f"programs name micro-batches, stages or ranks the plan does not have (micro_batches="
                        f"{micro_batches}, {stages} stages, {world} programs): {_listed(bad)}; {_FIX}")
        return problems
    if any(r >= world for rs in ranks for r in rs):
        problems.append(f"the stages run on ranks up to {max(r for rs in ranks for r in rs)} but there are programs "
                        f"for {world}; {_FIX}")
        return problems
    counts = Counter((op.kind, op.stage, op.microbatch) for p in programs for op in p.ops if op.kind in ("F", "B"))
    missing = [f"{kind} s{s} mb{i}" for s in range(stages) for i in range(micro_batches) for kind in ("F", "B")
               if counts[(kind, s, i)] == 0]
    twice = [f"{kind} s{s} mb{i}" for (kind, s, i), n in counts.items() if n > 1]
    if missing and not dealt:
        missing = [m for m in missing if m.startswith("F")]
    if missing:
        problems.append(f"with micro_batches={micro_batches} the programs never run {_listed(missing)}; {_FIX}")
    if twice and dealt:
        problems.append(f"the programs run {_listed(twice)} more than once; {_FIX}")
    if dealt:
        problems += _placement_problems(programs, ranks, stage_devices)
    return problems


def _placement_problems(programs: Sequence[Program], ranks: list[list[int]], devices: Sequence[str]) -> list[str]:
    """Each op on the rank of its stage's replica, every message received where it is sent, and each
    program on its first stage's device."""
    problems = []
    wrong = [f"{op} on rank {p.rank} (stage {op.stage} runs micro-batch {op.microbatch} on rank "
             f"{ranks[op.stage][op.microbatch % len(ranks[op.stage])]})"
             for p in programs for op in p.ops
             if op.is_compute and ranks[op.stage][op.microbatch % len(ranks[op.stage])] != p.rank]
    if wrong:
        problems.append(f"ops on the wrong rank: {_listed(wrong)}; {_FIX}")
    sends = Counter((p.rank, op.peer, op.key()) for p in programs for op in p.ops if op.kind == "SEND")
    recvs = Counter((op.peer, p.rank, op.key()) for p in programs for op in p.ops if op.kind == "RECV")
    unpaired = [f"{_message(k)} sent {sends[k]}, received {recvs[k]} time(s)"
                for k in sorted(set(sends) | set(recvs)) if sends[k] != recvs[k]]
    if unpaired:
        problems.append(f"messages not paired: {_listed(unpaired)}; {_FIX}")
    moved = [f"programs[{rs[0]}] on {programs[rs[0]].device} runs stage {s} of {devices[s]}"
             for s, rs in enumerate(ranks) if s < len(devices) and programs[rs[0]].device != devices[s]]
    if moved:
        problems.append(f"{_listed(moved)}; set the stage's device and its program's alike, or {_FIX}")
    return problems


def _message(key: tuple[int, int, tuple[int, int, int]]) -> str:
    src_rank, dst_rank, (src, dst, mb) = key
    return f"s{src}->s{dst} mb{mb} (rank {src_rank} -> {dst_rank})"
