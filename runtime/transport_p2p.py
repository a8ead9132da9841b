"""The peer-to-peer transport: messages between pipeline ranks under NCCL's rules (and gloo's).

Each batch of a program's SEND/RECV ops goes out as one `Comm.batch` (one batch_isend_irecv)
in the order of [Note: one agreed order] (runtime.program): no tags, nothing posted early,
so no two ranks can wait on each other. A message is its tensors, one transfer each; their
shapes, dtypes and the structure around them (tuples, dicts, None, plain values) must be
known before the receive is posted. The first step with a new input signature (shapes and
non-tensor values of the step's inputs) sends that description as a header on a CPU (gloo)
side group, in the same order; later steps with that signature reuse it, so a step has no
per-message host synchronization, and a step whose batch size or sequence length differs
from the example's just sends headers once more.

A peer that dies or stops answering turns into a PeerError naming its rank and stage; the
first rank to see a failure records it in the rendezvous store so ranks further away name
the same (original) failed rank.
"""

from __future__ import annotations

import datetime
import pickle
from collections import OrderedDict
from typing import Any, Callable, Hashable, Mapping, Sequence

import torch
import torch.distributed as dist

from runtime.comm import P2P, Comm, Work
from runtime.program import Op

__all__ = ["P2PTransport", "PeerError"]

Key = tuple[int, int, int]
Meta = tuple[Any, list[tuple[tuple[int, ...], torch.dtype]]]  # (structure with slots, tensor shapes and dtypes)
_FAILURE_KEY = "partitioner/failure"
_SIGNATURES = 64  # input signatures whose message descriptions are kept


class PeerError(RuntimeError):
    """Another rank of the pipeline failed or did not answer in time."""


class _Batch:
    """A posted batch: waited on once, by the first message taken from it or by `flush`."""

    def __init__(self, work: Work, peer: int, buffers: list[torch.Tensor]) -> None:
        self.work = work
        self.peer = peer
        self.buffers = buffers  # kept alive until the batch is done
        self.done = False


class P2PTransport:
    """Sends and receives this rank's messages; keeps send buffers alive until `flush`."""

    def __init__(
        self,
        comm: Comm,
        wire: Callable[[int], torch.device],
        header_group: Any,
        timeout_s: float,
        describe_rank: Callable[[int], str],
    ) -> None:
        self.comm = comm
        self.wire = wire  # the device tensors to and from a peer travel on (GPU for NCCL, CPU for gloo)
        self.header_group = header_group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.describe_rank = describe_rank
        self._base = 0
        self._sent: dict[tuple[Hashable, Key], Meta] = {}
        self._known: dict[tuple[Hashable, Key], Meta] = {}
        self._signature: Hashable = None
        self._signatures: OrderedDict[Hashable, None] = OrderedDict()
        self._fresh = True
        self._batches: list[_Batch] = []
        self._headers: list[tuple[Any, torch.Tensor, int]] = []  # (gloo work, buffer kept alive, peer)
        self._incoming: dict[Key, tuple[_Batch, Any, list[torch.Tensor], int]] = {}

    def begin_step(self, signature: Hashable, *, carry: bool = False, base: int = 0) -> None:
        """Start a step whose inputs have `signature` (equal on every rank): headers go out if it is new.

        `carry`: keep received values not yet taken (a call of an asynchronous stream: a value
        received at the last tick of one call is taken by the first op of the next). `base`: the
        call's first micro-batch; headers are known by micro-batch relative to it, so the calls
        of a stream's steady state, shifted copies of one another, share one signature's headers.
        """
        self._signature = signature
        self._base = base
        self._fresh = signature not in self._signatures
        self._signatures[signature] = None
        self._signatures.move_to_end(signature)
        if len(self._signatures) > _SIGNATURES:  # every rank sees the same signatures: same eviction
            old, _ = self._signatures.popitem(last=False)
            for cache in (self._sent, self._known):
                for k in [k for k in cache if k[0] == old]:
                    del cache[k]
        if not carry:
            self._incoming.clear()

    @property
    def can_post_early(self) -> bool:
        """Receives may be posted ahead of their turn once no header must be waited for."""
        return not self._fresh

    def post(self, ops: Sequence[Op], outgoing: Mapping[Key, list[Any]], device: Any) -> None:
        sends: dict[Key, list[torch.Tensor]] = {}
        for op in ops:  # header sends first, so two ranks never both wait for the other's header
            if op.kind == "SEND":
                found: list[torch.Tensor] = []
                meta = _describe(outgoing[op.key()], found)
                self._check_same(op, meta)
                if self._fresh:
                    self._send_header(meta, op.peer)
                sends[op.key()] = self._to_comm(found, op.peer)
        receives: dict[Key, tuple[Any, list[torch.Tensor]]] = {}
        for op in ops:
            if op.kind == "RECV":
                if self._fresh:
                    self._known[self._cached(op)] = self._receive_header(op.peer)
                structure, shapes = self._known[self._cached(op)]
                receives[op.key()] = (structure, [torch.empty(s, dtype=d, device=self.wire(op.peer))
                                                 for s, d in shapes])
        transfers = [  # in the ops' order, which both ranks of a pair share
            P2P("send", t, op.peer) if op.kind == "SEND" else P2P("recv", t, op.peer)
            for op in ops
            for t in (sends[op.key()] if op.kind == "SEND" else receives[op.key()][1])
        ]
        try:
            work = self.comm.batch(transfers)
        except Exception as exc:  # noqa: BLE001 - gloo raises at once when a peer is gone
            raise self.failure(ops[0].peer, f"while posting a batch: {type(exc).__name__}: {exc}") from None
        batch = _Batch(work, ops[0].peer, [t.tensor for t in transfers])
        self._batches.append(batch)
        for op in ops:
            if op.kind == "RECV":
                structure, tensors = receives[op.key()]
                self._incoming[op.key()] = (batch, structure, tensors, op.peer)

    def take(self, key: Key, device: Any) -> list[Any]:
        """The values of message `key`, on `device`, once its batch has arrived."""
        batch, structure, tensors, peer = self._incoming.pop(key)
        if not batch.done:
            self.wait(batch.work, peer, f"the message of stage {key[0]} to stage {key[1]}, micro-batch {key[2]}")
            batch.done = True
        values: list[Any] = _fill(structure, [t.to(device) for t in tensors])
        return values

    def flush(self) -> None:
        """Wait for every batch and header of this step to complete."""
        batches, self._batches = self._batches, []
        for batch in batches:
            if not batch.done:
                self.wait(batch.work, batch.peer, "a send to complete")
                batch.done = True
        headers, self._headers = self._headers, []
        for work, _, peer in headers:
            self.wait(work, peer, "a header send to complete")

    # ---- headers (first step of a signature only) ----

    def _send_header(self, meta: Meta, peer: int) -> None:
        body = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8)
        size = torch.tensor([body.numel()], dtype=torch.int64)
        for t in (size, body):
            self._headers.append((self._call(dist.isend, t, peer), t, peer))

    def _receive_header(self, peer: int) -> Meta:
        size = torch.empty(1, dtype=torch.int64)
        self.wait(self._call(dist.irecv, size, peer), peer, "a message header")
        body = torch.empty(int(size.item()), dtype=torch.uint8)
        self.wait(self._call(dist.irecv, body, peer), peer, "a message header")
        meta: Meta = pickle.loads(body.numpy().tobytes())
        return meta

    def _call(self, fn: Callable[..., Any], tensor: torch.Tensor, peer: int) -> Any:
        try:
            return fn(tensor, peer, group=self.header_group)
        except Exception as exc:  # noqa: BLE001 - gloo raises at once when the peer is gone
            raise self.failure(peer, f"while exchanging a header: {type(exc).__name__}: {exc}") from None

    def _check_same(self, op: Op, meta: Meta) -> None:
        before = self._sent.setdefault(self._cached(op), meta)
        if before[1] != meta[1]:
            raise RuntimeError(
                f"stage {op.src} sends stage {op.dst} tensors of shapes {[s for s, _ in meta[1]]} for micro-batch "
                f"{op.microbatch}, but {[s for s, _ in before[1]]} in an earlier step with the same input shapes: "
                "shapes that depend on the data (not only on input shapes) cannot cross a stage boundary; "
                "cut elsewhere (plan= with other stages) or pad to a fixed shape"
            )

    def _cached(self, op: Op) -> tuple[Hashable, Key]:
        src, dst, mb = op.key()
        return self._signature, (src, dst, mb - self._base)

    def _to_comm(self, tensors: list[torch.Tensor], peer: int) -> list[torch.Tensor]:
        device = self.wire(peer)
        return [t.detach().to(device).contiguous() for t in tensors]

    # ---- failures ----

    def wait(self, work: Any, peer: int, what: str) -> None:
        """Wait for `work` (from this transport or a collective); a peer that fails or stays silent is a PeerError."""
        try:
            ok = work.wait(self.timeout)
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError subclasses of many kinds
            raise self.failure(peer, f"while waiting for {what}: {type(exc).__name__}: {exc}") from None
        if ok is False:
            seconds = self.timeout.total_seconds()
            raise self.failure(peer, f"did not answer within {seconds:.0f} s while waiting for {what}")

    def group_failure(self, ranks: Any, exc: BaseException) -> PeerError:
        """A collective over `ranks` broke: name the first failure reported, else the group."""
        return self.failure(-1, f"during a collective over ranks {list(ranks)}: {type(exc).__name__}: {exc}")

    def failure(self, peer: int, detail: str) -> PeerError:
        """Name the failed rank: the first one reported in the store, else `peer`."""
        mine = f"{self.describe_rank(peer)} failed or stopped answering" if peer >= 0 else "a rank failed"
        first = _first_failure(mine)
        me = self.describe_rank(dist.get_rank())
        return PeerError(f"{first}; {me} stops ({detail}). Restart the job; with torchrun --max-restarts and a "
                         "checkpoint it resumes.")


class _Slot:
    """Stands for the k-th tensor of a message inside its pickled structure."""

    def __init__(self, k: int) -> None:
        self.k = k

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Slot) and other.k == self.k

    def __hash__(self) -> int:
        return self.k


def _describe(values: Any, found: list[torch.Tensor]) -> Meta:
    structure = _strip(values, found)
    return structure, [(tuple(t.shape), t.dtype) for t in found]


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
            return str(store.get(_FAILURE_KEY).decode())
        store.compare_set(_FAILURE_KEY, "", mine)
        return str(store.get(_FAILURE_KEY).decode())
    except Exception:  # noqa: BLE001 - the store may live in the rank that died
        return mine


def _store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001
        return None
