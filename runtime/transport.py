"""What the interpreter needs of a transport, and the batches of sends and receives it posts.

A rank's program holds its SEND/RECV ops of one tick side by side; they are posted together as
one batch (one `batch_isend_irecv` under torchrun), see [Note: one agreed order] in runtime/program.py.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

from runtime.ops import Op

__all__ = ["Key", "Span", "Transport", "batch_spans"]

Key = tuple[int, int, int]  # (src stage, dst stage, micro-batch)
Span = tuple[int, int, bool]  # a batch of a program: (first op, end, has a send)


class Transport(Protocol):
    """Moves values between ranks: `post` a batch of SEND/RECV ops, then `take` what arrived.

    `can_post_early`: receive-only batches may be posted ahead of their turn (in order) now.
    """

    @property
    def can_post_early(self) -> bool: ...

    def post(self, ops: Sequence[Op], outgoing: Mapping[Key, list[Any]], device: Any) -> None: ...

    def take(self, key: Key, device: Any) -> list[Any]: ...


def batch_spans(ops: Sequence[Op]) -> list[Span]:
    """(first op, end, has a send) of each batch of `ops`: consecutive SEND/RECV ops of one tick."""
    spans: list[Span] = []
    k = 0
    while k < len(ops):
        end = k + 1
        if ops[k].is_p2p:
            while end < len(ops) and ops[end].is_p2p and ops[end].tick == ops[k].tick:
                end += 1
            spans.append((k, end, any(op.kind == "SEND" for op in ops[k:end])))
        k = end
    return spans
