"""Every worker's program in one thread, tick by tick; the order is worked out once per set of programs.

    tick 0:  worker 0: F s0 mb0, post [SEND s0->s1 mb0]     worker 1: (nothing)
    tick 1:  worker 0: F s0 mb1, ...                        worker 1: F s1 mb0 (takes what tick 0 sent)
             ... then every batch a worker left at the end of the tick, in worker order

A worker's SEND/RECV ops of one tick form one batch. A batch is posted before the worker's next
compute op of the same tick, or else after every worker's ops of that tick: so a value is always
sent before the tick that reads it, and a one-thread run needs no waiting and no locks. Between
stages on one device there is nothing to move: unless a trace is recorded, their SEND and RECV ops
are left out and the values go through the workers' shared dict. The order depends only on the
programs, not on the batch, so a step replays a list worked out on the first (`InlineOrders`).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from runtime.ops import Op, Program

__all__ = ["InlineOrders", "Worker", "run_inline", "tick_order"]

Item = Op | tuple[Op, ...]  # a compute op, or a batch of SEND/RECV ops posted together


class Worker(Protocol):
    """What the one-thread run needs of a worker (runtime.interpreter.Interpreter)."""

    tracing: bool

    def compute(self, op: Op) -> None: ...

    def post(self, batch: Sequence[Op]) -> None: ...


def tick_order(programs: Sequence[Program]) -> list[tuple[int, Item]]:
    """(rank, op or batch) of every program in the order one thread runs them (STEP ops left out)."""
    by_tick: dict[int, list[tuple[int, Op]]] = {}
    for p in programs:
        for op in p.ops:
            if op.kind != "STEP":
                by_tick.setdefault(op.tick, []).append((p.rank, op))
    order: list[tuple[int, Item]] = []
    for t in sorted(by_tick):
        pending: dict[int, list[Op]] = {}  # each worker's batch not yet posted
        for rank, op in by_tick[t]:
            if op.is_p2p:
                pending.setdefault(rank, []).append(op)
                continue
            batch = pending.pop(rank, None)
            if batch:
                order.append((rank, tuple(batch)))
            order.append((rank, op))
        order += [(rank, tuple(pending[rank])) for rank in sorted(pending)]
    return order


def run_inline(order: Sequence[tuple[int, Item, bool]], workers: Sequence[Worker]) -> None:
    """Run an `InlineOrders` list on `workers` (indexed by rank). In one process a receive posts
    nothing (the value is taken from the mailbox when it is read), so a batch of receives only is
    posted only while its worker traces, for the event it records."""
    for rank, item, sends in order:
        if not isinstance(item, tuple):
            workers[rank].compute(item)
        elif sends or workers[rank].tracing:
            workers[rank].post(item)


class InlineOrders:
    """`tick_order` of each set of programs a pipeline runs, computed on its first step.

    `shared` (src, dst) stage pairs hand their values over through the workers' shared dict
    (runtime.interpreter, `begin`): their SEND and RECV ops are left out. A plan's programs
    are the same list every step; an asynchronous stream's calls are new lists each call
    (runtime.flushless), so only a few entries are kept.
    """

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._orders: dict[tuple[int, frozenset[tuple[int, int]]],
                           tuple[Sequence[Program], list[tuple[int, Item, bool]]]] = {}

    def of(self, programs: Sequence[Program], shared: frozenset[tuple[int, int]] = frozenset()
           ) -> list[tuple[int, Item, bool]]:
        """(rank, op or batch, whether the batch sends) in the order one thread runs them."""
        found = self._orders.get((id(programs), shared))
        if found is not None and found[0] is programs:
            return found[1]
        if len(self._orders) >= self._keep:
            self._orders.clear()
        order: list[tuple[int, Item, bool]] = []
        for rank, item in tick_order(programs):
            if isinstance(item, tuple):
                item = tuple(op for op in item if (op.src, op.dst) not in shared)
                if item:
                    order.append((rank, item, any(op.kind == "SEND" for op in item)))
            else:
                order.append((rank, item, False))
        self._orders[(id(programs), shared)] = (programs, order)  # holding `programs` keeps its id from being reused
        return order
