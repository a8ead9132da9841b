"""A `Comm` over gloo that imposes NCCL's point-to-point rules, so CI on CPU proves a protocol cannot hang under NCCL.

See ../shared/design.md, "NCCL's point-to-point rules". Each rank runs its batches on one
worker thread, one after another, as ProcessGroupNCCL runs them on one stream. A batch posts
every handshake at once, then one thread per (peer, direction) moves that pair's messages in
posting order. A send completes only once the peer has started the receive it pairs with.

    caller: batch(ops) / all_reduce(group=p2p group)
       │ (queue, posting order)
       ▼
    worker thread ── batch k: post all handshakes ──► chain (peer 1, send) ─┐ wait header/ack,
       │  (k+1 starts when k completed,               chain (peer 1, recv) ─┤ check sizes,
       │   or fails when k hung past timeout_s)        chain (peer 2, ...)  ─┘ move the bytes
       ▼
    Work.wait ◄── done / NcclRuleError

    control group, tags 1 and 2:  sender ──header(bytes, dtype)──► receiver
                                  sender ◄──ack(bytes, dtype)───── receiver  (when its receive starts)
    data group, tag 0 (tags ignored, FIFO per rank pair):  sender ──bytes──► receiver

Rule 5 (collectives in one order on every rank of a group) for the groups of split layers (tensor and
data-parallel groups, whose collectives DTensor and FSDP2 post) and of gradient all-reduces:
`collective_checks` creates them as PyTorch's ProcessGroupWrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL's
checker), which before every collective compares its fingerprint (sequence number, op, shapes,
dtypes) across the group's ranks on a gloo helper group, so a collective posted out of order is an
error naming both ranks' collectives, before it runs, instead of a hang or a wrong sum.

That checker compares an all-to-all's op only (its splits may differ by rank): two all-to-alls posted
in another order on two ranks, or a send count its peer does not expect, pass it and then move the
wrong rows under NCCL. `check_all_to_all` adds what it leaves out (rules 4 and 5 for all-to-all): before
each all-to-all of expert dispatch, every rank of the group shares what it is about to post (which
exchange, the rows it sends to and expects from each peer, row shape, dtype), and each checks that its
peers post the same exchange and that every count it sends is the count the peer expects from it.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist

from runtime.comm import P2P, Work

__all__ = ["NcclRuleError", "NcclRulesComm", "check_all_to_all", "collective_checks"]

_HEADER, _ACK = 1, 2  # control-group tags: the sender's description, the receiver's answer
_META_BYTES = 32  # byte count (8), batch number (4), op index (4), dtype name (16)
_P2P_HANG = (
    "a receive or send posted earlier to the same peer holds it back, or the peer never posts the matching operation"
)
_REDUCE_HANG = "a batch posted before it holds it back, or a rank of the group never posts it"


class NcclRuleError(RuntimeError):
    """The protocol breaks one of NCCL's point-to-point rules: under NCCL it would hang or corrupt data."""


@contextlib.contextmanager
def collective_checks(on: bool) -> Iterator[None]:
    """While inside (and `on`), new process groups check NCCL's rule 5 before each collective (module docstring).

    Every rank must create the same groups inside it. The debug level is the process's own, so it is set
    only for the groups made here and put back after.
    """
    if not on:
        yield
        return
    before = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        yield
    finally:
        dist.set_debug_level(before)


def check_all_to_all(group: Any, label: str, sends: Sequence[int], expects: Sequence[int], row: Sequence[int],
                     dtype: torch.dtype) -> None:
    """Rules 4 and 5 for the all-to-all `label` about to be posted on `group` (module docstring): every rank
    calls it at the same point with `sends[p]` rows of shape `row` for the group's rank p and `expects[p]`
    from it; raises NcclRuleError on every rank, naming both sides, where they do not pair up."""
    mine = (label, [int(n) for n in sends], [int(n) for n in expects], [int(d) for d in row], str(dtype))
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    me = dist.get_rank(group)
    problems = []
    for peer, (theirs, their_sends, their_expects, their_row, their_dtype) in enumerate(everyone):
        if theirs != label:
            problems.append(f"group rank {peer} posts {theirs!r} where group rank {me} posts {label!r}")
        elif (their_row, their_dtype) != (mine[3], mine[4]):
            problems.append(f"{label}: group rank {peer} moves rows {their_row} ({their_dtype}), group rank {me} "
                            f"rows {mine[3]} ({mine[4]})")
        elif their_sends[me] != mine[2][peer] or their_expects[me] != mine[1][peer]:
            problems.append(f"{label}: group rank {me} sends {mine[1][peer]} rows to group rank {peer}, which expects "
                            f"{their_expects[me]}, and expects {mine[2][peer]} from it, which sends {their_sends[me]}")
    if problems:
        raise NcclRuleError(f"rank {dist.get_rank()}: all-to-alls that do not pair up (NCCL moves the wrong rows or "
                            "hangs; post each exchange in one order on every rank, with the counts its peers "
                            "expect): " + "; ".join(problems))


class _Meta(NamedTuple):
    """What one side of a send/receive pair says about itself in a header or an ack."""

    nbytes: int
    dtype: str
    batch: int
    position: int

    def encode(self) -> torch.Tensor:
        raw = self.nbytes.to_bytes(8, "little") + self.batch.to_bytes(4, "little") + self.position.to_bytes(4, "little")
        return torch.frombuffer(bytearray(raw + self.dtype.encode()[:16].ljust(16, b"\0")), dtype=torch.uint8)

    @staticmethod
    def decode(t: torch.Tensor) -> _Meta:
        raw = t.numpy().tobytes()
        num = [int.from_bytes(raw[a:b], "little") for a, b in ((0, 8), (8, 12), (12, 16))]
        return _Meta(num[0], raw[16:].rstrip(b"\0").decode(), num[1], num[2])


class _Half(NamedTuple):
    """This rank's side of one send/receive pair: its handshake works and the two descriptions."""

    position: int
    op: P2P
    said: Any  # the work sending `mine` (a header for a send, an ack for a receive)
    heard: Any  # the work receiving `theirs`
    mine: torch.Tensor
    theirs: torch.Tensor


def _size(t: torch.Tensor) -> tuple[int, str]:
    return t.numel() * t.element_size(), str(t.dtype).removeprefix("torch.")


def _gloo_group(ranks: list[int]) -> dist.ProcessGroup:
    """A new gloo group of `ranks`, which hold this rank (new torch types `new_group` as a group or a non-member)."""
    group = dist.new_group(ranks, backend="gloo")
    if not isinstance(group, dist.ProcessGroup):
        raise RuntimeError(f"rank {dist.get_rank()} is not in the new group of ranks {ranks}")
    return group


def _describe(op: P2P) -> str:
    nbytes = _size(op.tensor)[0]
    return f"{op.op} {nbytes} B to rank {op.peer}" if op.op == "send" else f"recv {nbytes} B from rank {op.peer}"


class _Posted:
    """One posted batch or ordered all-reduce: the caller's `Work`, finished by the worker thread."""

    def __init__(self, rank: int, name: str, ops: Sequence[P2P], start: Callable[[float], list[Callable[[], None]]]):
        self.rank, self.name, self.ops, self.start = rank, name, list(ops), start
        self.why = _P2P_HANG if ops else _REDUCE_HANG
        self.pending: set[str] = set()  # what the chains still wait for, for the hang message
        self.errors: list[BaseException] = []
        self.failure: tuple[type[RuntimeError], str, BaseException | None] | None = None
        self.done = threading.Event()
        self.lock = threading.Lock()

    def note(self, add: str = "", drop: str = "") -> None:
        with self.lock:
            self.pending.discard(drop)
            if add:
                self.pending.add(add)

    def hang(self, seconds: float) -> str:
        waiting = f"; still waiting for: {', '.join(sorted(self.pending))}" if self.pending else ""
        hangs = f"under NCCL's rules this hangs ({self.why})"
        return f"rank {self.rank}: {self.name} did not complete within {seconds:g} s: {hangs}{waiting}"

    def fail(self, cls: type[RuntimeError], message: str, cause: BaseException | None = None) -> None:
        self.failure = (cls, message, cause)
        self.done.set()

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(minutes=30)) -> bool:
        if not self.done.wait(max(timeout.total_seconds(), 0.0)):
            raise NcclRuleError(self.hang(timeout.total_seconds()))
        if self.failure is not None:
            cls, message, cause = self.failure
            raise cls(message) from cause  # a fresh exception for every wait
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


class NcclRulesComm:
    """`runtime.comm.Comm` on gloo with NCCL's rules: tags ignored, one ordered stream, rendezvous, equal sizes.

    Args:
        group: the group whose collectives are ordered with the point-to-point batches (as on one
            NCCL communicator); None is the default group.
        timeout_s: a batch still incomplete this long after it started is reported as a hang
            (`NcclRuleError`), and every later batch fails at once.

    Every rank must construct it at the same point of its program: it creates two process groups.
    """

    def __init__(self, group: Any = None, timeout_s: float = 30.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        self.group, self.timeout_s = group, timeout_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        ranks = list(range(self.world))
        self._control = _gloo_group(ranks)  # headers and acks
        self._data = _gloo_group(ranks)  # the tensors' bytes, tag 0
        self._queue: queue.Queue[_Posted | None] = queue.Queue()
        self._batches = self._reduces = 0
        self._broken: str | None = None
        self._closed = False
        self._grace_s = max(1.0, timeout_s / 3)  # gloo gives up this long after a hang is reported
        self._stragglers: list[threading.Thread] = []  # chains of a hung item, until gloo gives up
        self._thread = threading.Thread(target=self._run, name=f"nccl-rules-rank{self.rank}", daemon=True)
        self._thread.start()

    def batch(self, ops: Sequence[P2P]) -> Work:
        """Post `ops` as one group: they progress together, after every batch posted before."""
        for op in ops:
            if op.op not in ("send", "recv") or not 0 <= op.peer < self.world or op.peer == self.rank:
                bad = f"bad point-to-point op {op.op!r} with peer {op.peer}"
                raise ValueError(f"rank {self.rank}: {bad} (world size {self.world}; no sends to oneself)")
            if not op.tensor.is_contiguous():  # as ProcessGroupNCCL (and gloo) demand
                raise ValueError(f"rank {self.rank}: {_describe(op)}: the tensor must be contiguous (.contiguous())")
        number, self._batches = self._batches, self._batches + 1
        name = f"batch #{number} [{', '.join(_describe(op) for op in ops)}]"
        posted = _Posted(self.rank, name, ops, lambda deadline: self._start_batch(posted, number, deadline))
        if not ops:
            posted.done.set()  # nothing to pair: done at once, as for NCCL and TorchComm
            return posted
        return self._post(posted)

    def all_reduce(self, tensor: torch.Tensor, group: Any) -> Work:
        """Sum `tensor` over `group`; on the point-to-point group it runs after the batches posted before."""
        world = dist.group.WORLD
        if (group if group is not None else world) is not (self.group if self.group is not None else world):
            return cast(Work, dist.all_reduce(tensor, group=group, async_op=True))
        number, self._reduces = self._reduces, self._reduces + 1
        name = f"all-reduce #{number} of {tensor.numel() * tensor.element_size()} B on the point-to-point group"

        def start(deadline: float) -> list[Callable[[], None]]:
            work = dist.all_reduce(tensor, group=group, async_op=True)
            return [lambda: self._wait(work, deadline)]

        return self._post(_Posted(self.rank, name, [], start))

    def close(self) -> None:
        """Stop the threads once the posted work has finished or failed; call it before destroy_process_group.

        A thread still inside a gloo wait when the default group is destroyed aborts the process,
        so after a hang this waits (at most timeout_s plus a grace period) until gloo gives up.
        """
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join(timeout=self.timeout_s + self._grace_s + 1.0)
            for t in self._stragglers:
                t.join(timeout=self.timeout_s + self._grace_s + 1.0)

    def _post(self, posted: _Posted) -> _Posted:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: NcclRulesComm is closed; cannot post {posted.name}")
        self._queue.put(posted)
        return posted

    def _run(self) -> None:
        """The worker thread: one posted item at a time, in posting order, as on one NCCL stream."""
        while (item := self._queue.get()) is not None:
            if self._broken is not None:
                item.fail(NcclRuleError, f"rank {self.rank}: {item.name} never started: {self._broken}")
                continue
            deadline = time.monotonic() + self.timeout_s
            try:
                fns = item.start(deadline)
                chains = [threading.Thread(target=self._chain, args=(item, fn), daemon=True) for fn in fns]
            except Exception as exc:  # noqa: BLE001 - gloo refuses to post when a peer is gone
                chains, item.errors = [], [exc]
            for t in chains:
                t.start()
            for t in chains:
                t.join(max(deadline - time.monotonic(), 0.0))
            if any(t.is_alive() for t in chains):
                self._stragglers += chains
                self._broken = f"{item.name} hung"
                item.fail(NcclRuleError, item.hang(self.timeout_s))
            elif item.errors:
                first = item.errors[0]
                self._broken = f"{item.name} failed"
                if isinstance(first, NcclRuleError):
                    item.fail(NcclRuleError, str(first))
                else:
                    why = f"{type(first).__name__}: {first}"
                    item.fail(RuntimeError, f"rank {self.rank}: {item.name} failed: {why}", first)
            else:
                item.done.set()

    def _chain(self, item: _Posted, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported through the item's Work
            with item.lock:
                item.errors.append(exc)

    def _wait(self, work: Any, deadline: float) -> None:
        # the worker reports a hang at the deadline; gloo gives up (and closes the pair) a grace period later
        work.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.0) + self._grace_s))

    def _start_batch(self, item: _Posted, number: int, deadline: float) -> list[Callable[[], None]]:
        """Post every handshake of the batch at once; return one chain per (peer, direction)."""
        chains: dict[tuple[int, str], list[_Half]] = {}
        for index, op in enumerate(item.ops):
            mine = _Meta(*_size(op.tensor), number, index).encode()
            theirs = torch.zeros(_META_BYTES, dtype=torch.uint8)
            out, back = (_HEADER, _ACK) if op.op == "send" else (_ACK, _HEADER)
            said = dist.isend(mine, op.peer, group=self._control, tag=out)
            heard = dist.irecv(theirs, op.peer, group=self._control, tag=back)
            chains.setdefault((op.peer, op.op), []).append(_Half(index, op, said, heard, mine, theirs))
        return [functools.partial(self._run_chain, item, chain, deadline) for chain in chains.values()]

    def _run_chain(self, item: _Posted, chain: list[_Half], deadline: float) -> None:
        """One peer and direction in posting order: wait until the peer starts the matching op, check, move bytes."""
        moving: list[tuple[Any, str]] = []
        for half in chain:
            op, index = half.op, half.position
            verb = "start the matching receive" if op.op == "send" else "post the matching send"
            waiting = f"rank {op.peer} to {verb} ({_describe(op)}, op {index})"
            item.note(add=waiting)
            self._wait(half.said, deadline)
            self._wait(half.heard, deadline)
            other, (nbytes, dtype) = _Meta.decode(half.theirs), _size(op.tensor)
            if (other.nbytes, other.dtype) != (nbytes, dtype):
                me, peer = ("sends", "receive") if op.op == "send" else ("receives", "send")
                pair = f"rank {op.peer}'s batch #{other.batch}, op {other.position}"
                raise NcclRuleError(
                    f"rank {self.rank}: {item.name}: op {index} {me} {nbytes} B ({dtype}) with rank {op.peer}, but "
                    f"the {peer} it pairs with ({pair}) moves {other.nbytes} B ({other.dtype}): NCCL pairs the "
                    "operations of two ranks in posting order, ignoring tags, and both sides must move the same bytes"
                )
            moved = f"the bytes of {_describe(op)} (op {index})"
            item.note(add=moved, drop=waiting)
            if nbytes:  # the bytes of the caller's own (contiguous) tensor: a receive lands in place
                post = dist.isend if op.op == "send" else dist.irecv
                raw = op.tensor.detach().reshape(-1).view(torch.uint8)
                moving.append((post(raw, op.peer, group=self._data, tag=0), moved))
        for work, moved in moving:
            self._wait(work, deadline)
            item.note(drop=moved)
