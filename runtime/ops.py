"""What a rank's program is made of: ops (compute, sends and receives, all-reduces, the step's end) and their text.

An op prints as one line and reads back (`Op.parse`), so a plan's programs are plain text in
its JSON; runtime/program.py makes programs by lowering a schedule (see [Note: one agreed
order] there).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Sequence

from rules.actions import Action

__all__ = ["Op", "OpKind", "Program", "format_program", "parse_program"]

OpKind = Literal["F", "B", "W", "SEND", "RECV", "AR", "STEP"]
_COMPUTE = ("F", "B", "W")


@dataclass(frozen=True)
class Op:
    """One thing a rank does in a step; prints as text (see `Op.parse`).

    F/B/W: compute of `stage` on `microbatch`. A `split` B computes only the gradients of the
    stage's inputs; the W of the same stage and micro-batch later adds the weights' (see
    runtime.split_backward). A B that is not split does both.
    SEND/RECV: the values `src` sends `dst` for `microbatch` (activations when src < dst,
    gradients when src > dst), to or from rank `peer`. AR: all-reduce of the gradients of the
    weights held by exactly `group`. STEP: the end of the step. `tick` orders batches.
    """

    kind: OpKind
    stage: int = -1
    microbatch: int = -1
    src: int = -1
    dst: int = -1
    peer: int = -1
    tick: int = -1
    group: tuple[int, ...] = ()
    split: bool = False

    @property
    def is_compute(self) -> bool:
        return self.kind in _COMPUTE

    @property
    def is_p2p(self) -> bool:
        return self.kind in ("SEND", "RECV")

    @property
    def gradient(self) -> bool:
        """A SEND/RECV of gradients (backward direction)."""
        return self.src > self.dst

    def key(self) -> tuple[int, int, int]:
        """(src, dst, microbatch): the message a SEND/RECV moves; both sides sort a batch by it."""
        return (self.src, self.dst, self.microbatch)

    def __str__(self) -> str:
        if self.is_compute:
            return f"{self.kind} s{self.stage} mb{self.microbatch} t{self.tick}" + (" split" if self.split else "")
        if self.is_p2p:
            return f"{self.kind} s{self.src}->s{self.dst} mb{self.microbatch} r{self.peer} t{self.tick}"
        if self.kind == "AR":
            return f"AR r{','.join(map(str, self.group))} t{self.tick}"
        return "STEP"

    @classmethod
    def parse(cls, text: str) -> Op:
        """Read `str(op)` back: 'F s1 mb3 t4', 'B s1 mb3 t7 split', 'SEND s1->s2 mb3 r2 t4', 'AR r0,1 t9', 'STEP'."""
        words = text.split()
        if words == ["STEP"]:
            return cls("STEP")
        match = _PATTERNS.get(words[0] if words else "", (None,))[0]
        found = match.fullmatch(" ".join(words)) if match else None
        if found is None:
            raise ValueError(
                f"cannot parse op {text!r}; expected e.g. 'F s1 mb3 t4', 'B s1 mb3 t7 split', 'W s1 mb3 t9', "
                "'SEND s1->s2 mb3 r2 t4', 'AR r0,1 t9' or 'STEP'"
            )
        kind = words[0]
        g = found.groupdict()
        if kind in _COMPUTE:
            return cls(kind, stage=int(g["stage"]), microbatch=int(g["mb"]), tick=int(g["tick"]),  # type: ignore[arg-type]
                       split=bool(g.get("split")))
        if kind == "AR":
            return cls("AR", group=tuple(int(r) for r in g["group"].split(",")), tick=int(g["tick"]))
        return cls(kind, microbatch=int(g["mb"]), src=int(g["src"]), dst=int(g["dst"]),  # type: ignore[arg-type]
                   peer=int(g["peer"]), tick=int(g["tick"]))


_COMPUTE_RE = re.compile(r"[FW] s(?P<stage>\d+) mb(?P<mb>\d+) t(?P<tick>\d+)")
_BACKWARD_RE = re.compile(r"B s(?P<stage>\d+) mb(?P<mb>\d+) t(?P<tick>\d+)( (?P<split>split))?")
_P2P_RE = re.compile(r"(SEND|RECV) s(?P<src>\d+)->s(?P<dst>\d+) mb(?P<mb>\d+) r(?P<peer>\d+) t(?P<tick>\d+)")
_AR_RE = re.compile(r"AR r(?P<group>\d+(,\d+)*) t(?P<tick>\d+)")
_PATTERNS = {"F": (_COMPUTE_RE,), "B": (_BACKWARD_RE,), "W": (_COMPUTE_RE,), "SEND": (_P2P_RE,), "RECV": (_P2P_RE,),
             "AR": (_AR_RE,)}


@dataclass
class Program:
    """Everything one rank (or, in one process, one worker) does in a step, in order.

    `predicted` holds the simulator's (start, end) in ms for each op, or is empty.
    """

    rank: int
    device: str
    ops: list[Op]
    predicted: list[tuple[float, float]] = field(default_factory=list)

    def text(self) -> str:
        return format_program(self.ops)

    def compute(self) -> list[Action]:
        """The schedule's actions of this rank (F, B and W), in order."""
        return [Action(op.stage, op.kind, op.microbatch) for op in self.ops  # type: ignore[arg-type]
                if op.kind in _COMPUTE]


def format_program(ops: Sequence[Op]) -> str:
    """One op per line; `parse_program` reads it back."""
    return "\n".join(str(op) for op in ops)


def parse_program(text: str) -> list[Op]:
    """Ops from `format_program` text ('#' starts a comment, blank lines are skipped)."""
    return [Op.parse(line) for raw in text.splitlines() if (line := raw.split("#", 1)[0].strip())]
