"""Point-to-point messages between pipeline ranks: any structure of tensors and plain values.

A message is a fixed-size header (the length and pickled structure of the values, with the
shape and dtype of each tensor; an overflow part when it does not fit) followed by one
transfer per tensor, all sent with isend so a sender never blocks on its receiver.

gloo moves data only once the receiver has posted a matching receive, so a receiver that
posts each part when it needs it pays a round trip per part. Instead the receiver posts
the headers of every message it expects in a step at once (`expect`), and `poll`, called
between actions, posts the tensor receives of every header that has arrived: data flows
while the rank computes. Tags keep concurrent messages apart:

    tag = (((kind * stages + src_stage) * stages + dst_stage) * micro_batches + microbatch) * PARTS + part

A peer that dies or stops answering turns into a PeerError naming its rank and stage; the
first rank to see a failure records it in the rendezvous store so ranks further away name
the same (original) failed rank.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Messenger", "PeerError"]

PARTS = 256  # header, overflow, then up to 254 tensors per message
HEADER_BYTES = 4096
_FAILURE_KEY = "partitioner/failure"


class PeerError(RuntimeError):
    """Another rank of the pipeline failed or did not answer in time."""


class Messenger:
    """Sends and receives messages for one rank; keeps isend handles alive until `flush`."""

    def __init__(self, device: torch.device, stages: int, micro_batches: int, timeout_s: float, describe_rank: Any) -> None:
        self.device = device if dist.get_backend() == "nccl" else torch.device("cpu")
        self.stages = stages
        self.micro_batches = micro_batches
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.describe_rank = describe_rank  # rank -> "rank 2 (stage 1)"
        self._pending: list[tuple[Any, Any, int]] = []  # (work, tensors kept alive, peer)
        self._incoming: dict[tuple[int, int], _Incoming] = {}  # (src, tag) -> receive under way

    def tag(self, kind: int, src_stage: int, dst_stage: int, microbatch: int) -> int:
        return (((kind * self.stages + src_stage) * self.stages + dst_stage) * self.micro_batches + microbatch) * PARTS

    def send(self, values: Any, dst: int, tag: int) -> None:
        found: list[torch.Tensor] = []
        skeleton = _strip(values, found)
        tensors = [t.detach().contiguous() for t in found]
        if len(tensors) > PARTS - 2:
            raise ValueError(f"a message holds {len(tensors)} tensors, more than {PARTS - 2}")
        meta = [(tuple(t.shape), t.dtype) for t in tensors]
        body = pickle.dumps((skeleton, meta))
        head = len(body).to_bytes(8, "little") + body[: HEADER_BYTES - 8]
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        header[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self._isend(header.to(self.device), dst, tag)
        if len(body) > HEADER_BYTES - 8:
            rest = torch.frombuffer(bytearray(body[HEADER_BYTES - 8 :]), dtype=torch.uint8)
            self._isend(rest.to(self.device), dst, tag + 1)
        for k, t in enumerate(tensors):
            self._isend(t.to(self.device) if t.device != self.device else t, dst, tag + 2 + k)

    def expect(self, src: int, tag: int) -> None:
        """Post the header receive of a message that will come from `src` with `tag`."""
        if (src, tag) not in self._incoming:
            buf = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
            self._incoming[(src, tag)] = _Incoming(self._irecv(buf, src, tag), buf)

    def poll(self) -> None:
        """Post the tensor receives of every expected message whose header has arrived."""
        for (src, tag), msg in self._incoming.items():
            if msg.tensors is None and msg.header_work.is_completed():
                self._post_tensors(src, tag, msg)

    def recv(self, src: int, tag: int, device: torch.device) -> Any:
        self.expect(src, tag)
        msg = self._incoming[(src, tag)]
        if msg.tensors is None:
            self._post_tensors(src, tag, msg)
        for w in msg.tensor_works:
            self._wait(w, src, "tensors")
        del self._incoming[(src, tag)]
        return _fill(msg.skeleton, [t.to(device) for t in msg.tensors])  # type: ignore[union-attr]

    def _post_tensors(self, src: int, tag: int, msg: "_Incoming") -> None:
        if not msg.header_done:  # a gloo work must be waited on once: a second wait blocks
            self._wait(msg.header_work, src, "a message header")
            msg.header_done = True
        raw = msg.header.cpu().numpy().tobytes()
        size = int.from_bytes(raw[:8], "little")
        body = raw[8 : 8 + min(size, HEADER_BYTES - 8)]
        if size > HEADER_BYTES - 8:
            rest = torch.empty(size - (HEADER_BYTES - 8), dtype=torch.uint8, device=self.device)
            self._wait(self._irecv(rest, src, tag + 1), src, "a message header")
            body += rest.cpu().numpy().tobytes()
        msg.skeleton, meta = pickle.loads(body)
        msg.tensors = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in meta]
        msg.tensor_works = [self._irecv(t, src, tag + 2 + k) for k, t in enumerate(msg.tensors)]

    def flush(self) -> None:
        """Wait for every send of this step to complete."""
        pending, self._pending = self._pending, []
        for work, _, peer in pending:
            self._wait(work, peer, "a send to complete")

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        try:
            work = dist.isend(tensor, dst, tag=tag)
        except Exception as exc:  # noqa: BLE001 - gloo raises at once when the peer is gone
            raise self.failure(dst, f"while sending: {type(exc).__name__}: {exc}") from None
        self._pending.append((work, tensor, dst))

    def _irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Any:
        try:
            return dist.irecv(tensor, src, tag=tag)
        except Exception as exc:  # noqa: BLE001
            raise self.failure(src, f"while receiving: {type(exc).__name__}: {exc}") from None

    def _wait(self, work: Any, peer: int, what: str) -> None:
        try:
            ok = work.wait(self.timeout)
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError subclasses of many kinds
            raise self.failure(peer, f"while waiting for {what}: {type(exc).__name__}: {exc}") from None
        if ok is False:
            raise self.failure(peer, f"did not answer within {self.timeout.total_seconds():.0f} s while waiting for {what}")

    def group_failure(self, ranks: Any, exc: BaseException) -> PeerError:
        """A collective over `ranks` broke: name the first failure reported, else the group."""
        return self.failure(-1, f"during a collective over ranks {list(ranks)}: {type(exc).__name__}: {exc}")

    def failure(self, peer: int, detail: str) -> PeerError:
        """Name the failed rank: the first one reported in the store, else `peer`."""
        mine = f"{self.describe_rank(peer)} failed or stopped answering" if peer >= 0 else "a rank failed"
        first = _first_failure(mine)
        me = self.describe_rank(dist.get_rank())
        return PeerError(f"{first}; {me} stops ({detail}). Restart the job; with torchrun --max-restarts and a checkpoint it resumes.")


class _Incoming:
    """A message being received: its header receive, then its tensors' receives."""

    def __init__(self, header_work: Any, header: torch.Tensor) -> None:
        self.header_work = header_work
        self.header = header
        self.header_done = False
        self.skeleton: Any = None
        self.tensors: list[torch.Tensor] | None = None
        self.tensor_works: list[Any] = []


class _Slot:
    """Stands for the k-th tensor of a message inside its pickled structure."""

    def __init__(self, k: int) -> None:
        self.k = k


def _strip(value: Any, found: list[torch.Tensor]) -> Any:
    """`value` with every tensor replaced by a _Slot (tensors appended to `found`)."""
    if isinstance(value, torch.Tensor):
        found.append(value)
        return _Slot(len(found) - 1)
    if type(value) is dict:
        return {k: _strip(v, found) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_strip(v, found) for v in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_strip(v, found) for v in value))
    return value


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _Slot):
        return tensors[value.k]
    if type(value) is dict:
        return {k: _fill(v, tensors) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_fill(v, tensors) for v in value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_fill(v, tensors) for v in value))
    return value


def _first_failure(mine: str) -> str:
    store = _store()
    if store is None:
        return mine
    try:
        if store.check([_FAILURE_KEY]):
            return store.get(_FAILURE_KEY).decode()
        store.compare_set(_FAILURE_KEY, "", mine)
        return store.get(_FAILURE_KEY).decode()
    except Exception:  # noqa: BLE001 - the store may live in the rank that died
        return mine


def _store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001
        return None
