"""What a schedule is made of: actions (forward, backward, weight gradient of a stage on a micro-batch) in lists."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

__all__ = ["Action", "Kind", "check_counts", "format_schedule", "parse_schedule", "peak_in_flight"]

Kind = Literal["F", "B", "W"]


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work on `microbatch` of `stage`; prints as '1F0'.

    'F' forward; 'B' backward; 'W' the weight gradients of a split backward (zero-bubble
    schedules): where a schedule lists a W, its B computes only the inputs' gradients.
    """

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        for kind in ("F", "B", "W"):
            stage, sep, mb = text.partition(kind)
            if sep and stage.isdigit() and mb.isdigit():
                return cls(int(stage), kind, int(mb))
        raise ValueError(f"cannot parse action {text!r}; expected e.g. '1F0', '0B3' or '2W1'")


def check_counts(micro_batches: int, stages: int) -> None:
    """Raise ValueError unless there is at least one micro-batch and one stage (or rank)."""
    if micro_batches < 1 or stages < 1:
        raise ValueError(f"need micro_batches >= 1 and stages >= 1, got {micro_batches} and {stages}")


def peak_in_flight(lists: Iterable[Iterable[tuple[int, str, bool]]], stages: int) -> list[int]:
    """Per stage, the most micro-batches whose activations one list holds at once, counted from the lists.

    Each item is (stage, kind, split): a micro-batch's activations live from its F to its backward,
    or to its W where the backward is split (a split B keeps them for the W); `split` is ignored on
    F and W. The one count the simulators make, from a schedule's actions or from programs' ops;
    `rules.schedules.in_flight` is the closed form planners use before any list exists.
    """
    peak = [0] * stages
    for items in lists:
        live = [0] * stages
        for stage, kind, split in items:
            if kind == "F" or kind == "W" or (kind == "B" and not split):
                live[stage] += 1 if kind == "F" else -1
                peak[stage] = max(peak[stage], live[stage])
    return peak


def format_schedule(schedule: Sequence[Sequence[Action]]) -> str:
    """One line per device, 'd: 0F0 0F1 0B0 ...'; `parse_schedule` reads it back."""
    return "\n".join(f"{d}: " + " ".join(str(a) for a in actions) for d, actions in enumerate(schedule))


def parse_schedule(text: str) -> list[list[Action]]:
    """Read `format_schedule` text: one line per device, an optional 'd:' prefix, '#' comments.

    Raises:
        ValueError: a line's prefix is not its device index, or an action does not parse.
    """
    lists: list[list[Action]] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        prefix, colon, rest = line.partition(":")
        if colon:
            if prefix.strip() != str(len(lists)):
                raise ValueError(
                    f"line {number} is labelled device {prefix.strip()!r} but is device {len(lists)}; "
                    "list devices in order 0, 1, 2, ..."
                )
            line = rest
        lists.append([Action.parse(token) for token in line.split()])
    return lists
