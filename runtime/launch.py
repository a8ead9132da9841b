"""Joining a torchrun job and laying stages out on its ranks (the runtime's side of partition())."""

from __future__ import annotations

import datetime
import os
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["distributed", "init_process_group", "stage_layout"]


def distributed() -> bool:
    """True under torchrun (WORLD_SIZE > 1) or once torch.distributed is initialized."""
    return dist.is_available() and (dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1)


def init_process_group(devices: Sequence[torch.device], timeout: float) -> None:
    """Join the job from torchrun's environment, in a store namespace of this restart attempt.

    After `torchrun --max-restarts` restarts the workers, keys written by the previous
    attempt (peer addresses) can still be in the store; a fresh prefix keeps them apart.
    """
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
    backend = "nccl" if rank < len(devices) and devices[rank].type == "cuda" else "gloo"
    wait = datetime.timedelta(seconds=timeout)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")),
        world, is_master=rank == 0 and not agent, timeout=wait,
    )
    prefixed = dist.PrefixStore(f"partitioner/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=wait)


def stage_layout(ranks: int, schedule: str, replicas: Sequence[int] | None, virtual_stages: int) -> list[list[int]]:
    """The ranks of each stage: stage by stage with replicas; round robin for interleaved.

    Raises:
        ValueError: replicas that do not add up to `ranks`, or interleaving with replicas.
    """
    if schedule == "interleaved":
        if replicas is not None and any(r != 1 for r in replicas):
            raise ValueError("schedule='interleaved' runs one replica per stage; drop replicas or use '1f1b'")
        if virtual_stages < 2:
            raise ValueError(f"virtual_stages={virtual_stages}; interleaving needs 2 or more stages per rank")
        return [[s % ranks] for s in range(ranks * virtual_stages)]
    counts = list(replicas) if replicas is not None else [1] * ranks
    if any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in counts) or sum(counts) != ranks:
        raise ValueError(f"replicas={counts} must be positive integers adding up to the {ranks} ranks of the job")
    starts = [sum(counts[:s]) for s in range(len(counts))]
    return [list(range(a, a + r)) for a, r in zip(starts, counts)]
