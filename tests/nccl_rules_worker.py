"""Worker for tests/test_nccl_rules.py: run under torchrun with 2 ranks; prints one RESULT line per mode.

Modes (run in the order given, each with a fresh comm):
  safe                         NcclRulesComm passes NCCL-safe protocols and moves the right data
  safe_torch                   the same protocols through TorchComm
  gloo_allows_send_then_recv   TorchComm on gloo passes the protocol NCCL deadlocks on (why the emulator exists)
  unsafe_send_then_recv        send, then receive, as separate batches on both ranks: must be caught
  recv_first_holds_send        receive, then send, as separate batches on both ranks: must be caught
  tags_ignored                 rank 1 receives B's size first, as if matching by tag: a size mismatch
  all_reduce_overtakes         an all-reduce on the point-to-point group posted before a batch on one rank
                               and after it on the other: must be caught
Lines read 'RESULT <mode> rank=<r> ok|caught|FAIL <detail>'; exits non-zero on any FAIL.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.comm import P2P, Comm, TorchComm, Work
from runtime.nccl_rules import NcclRuleError, NcclRulesComm

WAIT = datetime.timedelta(seconds=30)  # longer than the emulator's timeout_s: the emulator must answer first


def done(work: Work) -> None:
    if not work.wait(WAIT):
        raise RuntimeError("a work did not complete in time")


def payload(rank: int, rnd: int) -> list[torch.Tensor]:
    """What `rank` sends in round `rnd`: several sizes and dtypes."""
    return [
        torch.full((3,), 100.0 * rnd + rank),
        torch.arange(50, dtype=torch.float64).reshape(5, 10) * (rank + 1) + rnd,
        torch.tensor(7 * rnd + rank, dtype=torch.int64),
        torch.tensor([rnd % 2 == rank, True, False]),
    ]


def check(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for g, w in zip(got, want, strict=True):
        if g.dtype != w.dtype or not torch.equal(g, w):
            raise RuntimeError(f"{what}: received {g} instead of {w}")


def safe(comm: Comm, rank: int) -> str:
    peer = 1 - rank
    for rnd in range(20):  # one batch with a send to and a receive from the peer, in either order
        inbox = [torch.empty(3), torch.empty(5, 10, dtype=torch.float64),
                 torch.empty((), dtype=torch.int64), torch.empty(3, dtype=torch.bool)]
        sends = [P2P("send", t, peer) for t in payload(rank, rnd)]
        recvs = [P2P("recv", t, peer) for t in inbox]
        done(comm.batch(sends + recvs if rank == 0 else recvs + sends))
        check(inbox, payload(peer, rnd), f"round {rnd}")
    # a chain: rank 0 sends in batch k, rank 1 receives in batch k; everything posted before any wait
    chain = [torch.full((k + 1,), float(k)) for k in range(6)]
    got = [torch.empty(k + 1) for k in range(6)]
    ops = [[P2P("send", t, 1)] if rank == 0 else [P2P("recv", g, 0)] for t, g in zip(chain, got, strict=True)]
    works = [comm.batch(batch) for batch in ops]
    for w in works:
        done(w)
    if rank == 1:
        check(got, chain, "chain")
    # an all-reduce on the point-to-point group, posted behind a batch; one on another group
    back = torch.empty(2)
    pair = comm.batch([P2P("send" if rank == 1 else "recv", torch.full((2,), 5.0) if rank == 1 else back, peer)])
    total = torch.tensor([rank + 1.0])
    reduced = comm.all_reduce(total, getattr(comm, "group", None))  # the emulator orders it after `pair`
    other = torch.tensor([10.0 * (rank + 1)])
    side = comm.all_reduce(other, dist.new_group([0, 1], backend="gloo"))
    for w in (pair, reduced, side):
        done(w)
    if total.item() != 3.0 or other.item() != 30.0 or (rank == 0 and back.tolist() != [5.0, 5.0]):
        raise RuntimeError(f"all-reduce gave {total.item()} and {other.item()}, receive gave {back.tolist()}")
    if isinstance(comm, NcclRulesComm):  # NCCL (and gloo) refuse non-contiguous tensors: so does the emulator
        try:
            comm.batch([P2P("recv", torch.empty(4, 4).t(), peer)])
        except ValueError:
            pass
        else:
            raise RuntimeError("a non-contiguous receive was accepted")
    return "20 rounds, a 6-batch chain and 2 all-reduces"


def send_then_recv(comm: Comm, rank: int) -> str:
    mine, theirs = torch.full((16,), float(rank)), torch.empty(16)
    works = [comm.batch([P2P("send", mine, 1 - rank)]), comm.batch([P2P("recv", theirs, 1 - rank)])]
    for w in works:
        done(w)
    if theirs.tolist() != [float(1 - rank)] * 16:
        raise RuntimeError(f"received {theirs.tolist()}")
    return "gloo completed it"


def recv_then_send(comm: Comm, rank: int) -> str:
    works = [comm.batch([P2P("recv", torch.empty(16), 1 - rank)]), comm.batch([P2P("send", torch.ones(16), 1 - rank)])]
    for w in works:
        done(w)
    return "completed"


def tags_ignored(comm: Comm, rank: int) -> str:
    if rank == 0:  # A (4 elements, "tag 1") then B (8 elements, "tag 2")
        works = [comm.batch([P2P("send", torch.ones(4), 1)]), comm.batch([P2P("send", torch.ones(8), 1)])]
    else:  # rank 1 wants B first, as if tags picked the message
        works = [comm.batch([P2P("recv", torch.empty(8), 0)]), comm.batch([P2P("recv", torch.empty(4), 0)])]
    for w in works:
        done(w)
    return "completed"


def all_reduce_overtakes(comm: Comm, rank: int) -> str:
    # rank 0: batch, then all-reduce; rank 1: all-reduce, then batch. One NCCL stream: a cycle
    group = getattr(comm, "group", None)
    if rank == 0:
        works = [comm.batch([P2P("send", torch.ones(4), 1)]), comm.all_reduce(torch.ones(1), group)]
    else:
        works = [comm.all_reduce(torch.ones(1), group), comm.batch([P2P("recv", torch.empty(4), 0)])]
    for w in works:
        done(w)
    return "completed"


MODES = {
    "safe": (True, safe),
    "safe_torch": (False, safe),
    "gloo_allows_send_then_recv": (False, send_then_recv),
    "unsafe_send_then_recv": (True, send_then_recv),
    "recv_first_holds_send": (True, recv_then_send),
    "tags_ignored": (True, tags_ignored),
    "all_reduce_overtakes": (True, all_reduce_overtakes),
}


def run(mode: str, rank: int) -> str:
    emulate, body = MODES[mode]
    safe_mode = mode.startswith(("safe", "gloo_"))
    group = dist.new_group([0, 1], backend="gloo")  # its own: a hung all-reduce breaks the group it ran on
    # unsafe modes must be caught at 3 s; safe ones get room for a loaded CI machine
    comm: Comm = NcclRulesComm(group, timeout_s=20.0 if safe_mode else 3.0) if emulate else TorchComm()
    start = time.monotonic()
    try:
        detail = body(comm, rank)
        outcome = "ok" if safe_mode else "FAIL not caught:"
    except NcclRuleError as exc:
        detail, outcome = str(exc), "FAIL unexpected NcclRuleError:" if safe_mode else "caught"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        detail, outcome = f"{type(exc).__name__}: {exc}", "FAIL"
    took = time.monotonic() - start  # before close(), which may wait for gloo to give up
    if isinstance(comm, NcclRulesComm):
        comm.close()
    detail = detail.replace("\n", " ")
    return f"RESULT {mode} rank={rank} {outcome} after={took:.2f}s {detail}"


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    failed = False
    for mode in sys.argv[1:]:
        line = run(mode, rank)
        os.write(1, (line + "\n").encode())  # one write: the two ranks share the pipe, lines must not interleave
        failed = failed or " FAIL" in line
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
