"""Joining a torchrun job: each rank's device, one backend spec, checks every rank agrees, stage layout.

    devices=["cuda"] * world       rank r takes cuda:LOCAL_RANK (its node's r-th GPU)
    devices=["cuda:0", "cpu", ...] entry r is rank r's device, checked on rank r's node only

Before the process group starts, every rank writes what it was given and what it resolved to
into the job's store and reads everyone else's, so a job whose ranks disagree on the device
list, or where two NCCL ranks would drive the same GPU, stops with an error on every rank
instead of hanging inside NCCL.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from rules.schedules import stage_ranks
from runtime.errors import PartitionError

__all__ = ["backend_for", "check_ranks", "distributed", "init_process_group", "job_devices", "joined_devices",
           "own_device", "rank_device", "stage_layout", "wire_device"]  # fmt: skip


def distributed() -> bool:
    """True under torchrun (WORLD_SIZE > 1) or once torch.distributed is initialized."""
    return dist.is_available() and (dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1)


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_device(entry: str | torch.device, local_rank: int, cuda_count: int, rank: int = 0) -> torch.device:
    """This rank's device from its entry of `devices`: an index-less 'cuda' means cuda:LOCAL_RANK.

    Raises:
        PartitionError: an unknown name, or a GPU index this node does not have.
    """
    try:
        device = torch.device(entry)
    except (RuntimeError, TypeError) as exc:
        raise PartitionError(f"devices[{rank}]={entry!r} is not a device name ('cpu', 'cuda', 'cuda:N'): {exc}") \
            from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise PartitionError(f"devices[{rank}]={str(device)!r}: under torchrun a rank runs on 'cpu' or 'cuda[:N]'")
    index = local_rank if device.index is None else device.index
    if index >= cuda_count:
        how = f"LOCAL_RANK={local_rank} takes cuda:{local_rank}" if device.index is None else f"asks for cuda:{index}"
        raise PartitionError(
            f"rank {rank} {how} but only {cuda_count} CUDA devices are visible on {socket.gethostname()}; "
            f"start at most {cuda_count} processes per node (torchrun --nproc_per_node={max(cuda_count, 1)}) "
            "or check CUDA_VISIBLE_DEVICES"
        )
    return torch.device("cuda", index)


def job_devices(devices: Sequence[str | torch.device]) -> list[torch.device]:
    """The job's devices as given, parsed: each rank resolves and checks its own entry when it joins
    (`init_process_group`), where a problem reaches every rank instead of leaving them waiting."""
    if isinstance(devices, (str, torch.device)):
        raise PartitionError(f"devices must be a list such as ['{devices}'] * world_size, got the single value "
                             f"{devices!r}")
    out: list[torch.device] = []
    for r, entry in enumerate(devices):
        try:
            out.append(torch.device(entry))
        except (RuntimeError, TypeError) as exc:
            raise PartitionError(f"devices[{r}]={entry!r} is not a device name ('cpu', 'cuda', 'cuda:N'): {exc}") \
                from None
    return out


def own_device(given: Sequence[str | torch.device], rank: int, world: int) -> torch.device:
    """This rank's device from torchrun's environment (LOCAL_RANK) and its entry of `given`."""
    if len(given) != world:
        raise PartitionError(f"devices lists {len(given)} devices but the job has {world} ranks; "
                             "pass one device per rank, e.g. devices=['cuda'] * world_size")
    return rank_device(given[rank], int(os.environ.get("LOCAL_RANK", "0")), _cuda_count(), rank)


def backend_for(devices: Sequence[torch.device]) -> str:
    """One backend spec for every rank: gloo for CPU tensors, NCCL for CUDA ones where any rank has a GPU."""
    return "cpu:gloo,cuda:nccl" if any(torch.device(d).type == "cuda" for d in devices) else "gloo"


def wire_device(own: torch.device, peers: Sequence[torch.device]) -> torch.device:
    """Where tensors travel between `own` and `peers`: the GPU when every end is a GPU (NCCL), else the CPU (gloo)."""
    if own.type == "cuda" and all(torch.device(p).type == "cuda" for p in peers):
        return own
    return torch.device("cpu")


def _gpu_id(device: torch.device) -> str:
    """An identity of the physical GPU that survives CUDA_VISIBLE_DEVICES renumbering."""
    try:
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        if uuid is not None:
            return str(uuid)
    except Exception:  # noqa: BLE001 - no driver: fall back to the visible index
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return f"{socket.gethostname()}:{visible}:{device.index}"


def _record(given: Sequence[str | torch.device], rank: int, world: int) -> dict[str, Any]:
    """What this rank tells the others: its list, its device, its GPU's identity, or why it has none."""
    record: dict[str, Any] = {"given": [str(d) for d in given], "host": socket.gethostname(), "gpu": None}
    try:
        own = own_device(given, rank, world)
    except PartitionError as exc:
        return {**record, "device": None, "error": str(exc)}
    return {**record, "device": str(own), "gpu": _gpu_id(own) if own.type == "cuda" else None, "error": None}


def check_ranks(records: Sequence[Mapping[str, Any]]) -> list[torch.device]:
    """Every rank's device from what each rank wrote (rank order); raises where ranks disagree.

    Raises:
        PartitionError: a rank could not resolve its device, ranks passed different device
            lists, or two ranks would drive one GPU.
    """
    for r, rec in enumerate(records):
        if rec.get("error"):
            raise PartitionError(f"rank {r}: {rec['error']}")
    first = list(records[0]["given"])
    for r, rec in enumerate(records):
        if list(rec["given"]) != first:
            raise PartitionError(f"rank {r} passed devices={list(rec['given'])} but rank 0 passed devices={first}; "
                                 "every rank must pass the same list (one entry per rank)")
    users: dict[str, int] = {}
    for r, rec in enumerate(records):
        if rec.get("gpu") is None:
            continue
        other = users.setdefault(str(rec["gpu"]), r)
        if other != r:
            raise PartitionError(
                f"ranks {other} and {r} would both run on {rec['device']} of host {rec['host']}; NCCL needs one GPU "
                "per rank: pass devices=['cuda'] * world_size (rank r takes cuda:LOCAL_RANK), or start at most one "
                "process per GPU"
            )
    return [torch.device(rec["device"]) for rec in records]


def init_process_group(given: Sequence[str | torch.device], timeout: float) -> list[torch.device]:
    """Join the job from torchrun's environment; returns every rank's device once all ranks agree.

    The store lives in a namespace of this restart attempt: after `torchrun --max-restarts`
    restarts the workers, keys of the previous attempt (peer addresses) can still be there.
    `torch.cuda.set_device` runs before the group starts, and the group is told its GPU
    (`device_id`) where every rank has one, so NCCL starts on the right device at once.
    """
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    wait = datetime.timedelta(seconds=timeout)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")),
        world, is_master=rank == 0 and not agent, timeout=wait,
    )
    prefixed = dist.PrefixStore(f"partitioner/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    prefixed.set(f"devices/{rank}", json.dumps(_record(given, rank, world)))
    records = [json.loads(prefixed.get(f"devices/{r}")) for r in range(world)]
    resolved = check_ranks(records)
    own = resolved[rank]
    if own.type == "cuda":
        torch.cuda.set_device(own)
    all_cuda = all(d.type == "cuda" for d in resolved)
    dist.init_process_group(backend_for(resolved), store=prefixed, rank=rank, world_size=world, timeout=wait,
                            device_id=own if all_cuda else None)
    return resolved


def joined_devices(given: Sequence[str | torch.device]) -> list[torch.device]:
    """Every rank's device in a process group the user started: the same checks, over the group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = _record(given, rank, world)
    if mine["device"] is not None and mine["device"].startswith("cuda"):
        torch.cuda.set_device(torch.device(mine["device"]))  # before the gather: NCCL picks the current device
    records: list[Any] = [None] * world
    dist.all_gather_object(records, mine)
    return check_ranks(records)


def stage_layout(ranks: int, schedule: str, replicas: Sequence[int] | None, virtual_stages: int) -> list[list[int]]:
    """The ranks of each stage: stage by stage with replicas; round robin for interleaved; a V for zbv and dualpipev.

    The schedule's layout decides (`rules.schedules.stage_ranks`, which registered schedules follow too).

    Raises:
        ValueError: an unknown schedule, replicas that do not add up to `ranks`, or interleaving (or a V)
            with replicas.
    """
    return stage_ranks(schedule, ranks, replicas, virtual_stages)
