"""Give every rank the whole model's weights again, before the job is rebuilt from another plan.

Under torchrun a rank keeps only the weights its stages read; the others are emptied
(runtime.stage.build_stages). A re-plan (partitioner.calibrate.decide) may give a rank stages whose
weights it dropped, so first every weight is broadcast from the first rank holding it, in
the model's own order on every rank (one collective each: the same order on every rank, as
NCCL needs; see design.md). Then building the new plan keeps what each rank needs.
"""

from __future__ import annotations

from typing import Collection

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["regather_weights"]


def regather_weights(model: nn.Module, held: Collection[int], device: torch.device) -> int:
    """Fill every parameter and buffer of `model` on this rank from the first rank that holds it.

    `held`: ids of the tensors this rank holds (DistributedPipeline.held_tensor_ids); the
    others are received onto `device`. Every rank calls it. Returns how many tensors arrived.

    Raises:
        ValueError: a weight no rank holds (it cannot be restored; load a checkpoint instead).
    """
    tensors = [t for _, t in model.named_parameters()] + [t for _, t in model.named_buffers()]
    mine = [(i, tuple(t.shape), str(t.dtype).replace("torch.", "")) for i, t in enumerate(tensors) if id(t) in held]
    everyone: list[list[tuple[int, tuple[int, ...], str]]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    owner: dict[int, tuple[int, tuple[int, ...], str]] = {}
    for rank, entries in enumerate(everyone):
        for i, shape, dtype in entries:
            owner.setdefault(i, (rank, shape, dtype))
    missing = [i for i in range(len(tensors)) if i not in owner]
    if missing:
        raise ValueError(f"{len(missing)} weights are held by no rank, so the model cannot be rebuilt from another "
                         "plan; save a checkpoint and load it into the new pipeline instead")
    arrived = 0
    me = dist.get_rank()
    for i, t in enumerate(tensors):
        rank, shape, dtype = owner[i]
        if rank == me:
            buf = t.detach()
        else:
            buf = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(buf, src=rank)
        if rank != me and id(t) not in held:
            with torch.no_grad():
                t.data = buf
            arrived += 1
    return arrived
