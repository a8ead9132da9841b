"""DTensors as torch.distributed.checkpoint writes them and back: strided splits saved as plain ones.

A fused q/k/v weight split over tensor ranks is a strided shard (each rank holds its part of q, of k
and of v); DCP saves plain row splits, so `savable` redistributes it (a collective of its mesh) and
`unsaved` cuts what DCP read back into the live weight's placements. Sharded by FSDP2 as well, the
weight lives on a 2-D (data, tensor) mesh with nested strided shards, which DTensor's one-step
redistribution puts in the wrong order (torch 2.13): there the data dimension is gathered first on
save, and on load this rank's part is cut from the whole, as FSDP2 cuts it.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["savable", "unsaved"]


def savable(t: torch.Tensor) -> torch.Tensor:
    """`t` as torch.distributed.checkpoint saves it: a fused q/k/v weight's strided split (or its optimizer state)
    redistributed to a plain row split (a collective of its mesh), any other tensor itself.

    On a 2-D (data, tensor) mesh (FSDP2 over a split stage) the data dimension is gathered first, then the
    tensor one made plain: nested strided shards redistributed in one step come back permuted (torch 2.13).
    """
    if isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements):
        t = _gathered_outer(t, t.placements[-1])
        return t.redistribute(t.device_mesh, [Shard(p.dim) if isinstance(p, _StridedShard) else p
                                              for p in t.placements])
    return t


def unsaved(loaded: DTensor, like: DTensor) -> DTensor:
    """`loaded` (a DTensor as `savable` wrote it) in the placements of `like`, the inverse of `savable`.

    On a 2-D (data, tensor) mesh the whole tensor is gathered (one weight at a time) and this rank's part cut
    from it: its tensor rank's part by `like`'s tensor placement, then FSDP2's piece of that (torch.chunk along
    the sharded dimension); DTensor's own redistribution into nested strided shards comes back permuted.
    """
    if tuple(loaded.placements) == tuple(like.placements):
        return loaded
    mesh = like.device_mesh
    outer = like.placements[0]
    if mesh.ndim != 2 or not isinstance(outer, (Shard, _StridedShard)):
        return loaded.redistribute(mesh, like.placements)
    part = _part(loaded.full_tensor(), like.placements[1], mesh.get_local_rank(1), mesh.size(1))
    pieces = part.chunk(mesh.size(0), dim=outer.dim)
    index = mesh.get_local_rank(0)
    mine = pieces[index] if index < len(pieces) else part.narrow(outer.dim, 0, 0)
    return DTensor.from_local(mine.contiguous(), mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def _part(whole: torch.Tensor, where: Placement, index: int, ranks: int) -> torch.Tensor:
    """Rank `index` of `ranks`' part of `whole` under one placement (a strided shard: its piece of each of
    split_factor blocks, as a fused q/k/v weight is split)."""
    if isinstance(where, _StridedShard):
        return torch.cat([block.chunk(ranks, dim=where.dim)[index]
                          for block in whole.chunk(int(where.split_factor), dim=where.dim)], dim=where.dim)
    if isinstance(where, Shard):
        return whole.chunk(ranks, dim=where.dim)[index]
    return whole


def _gathered_outer(t: DTensor, inner: Placement) -> DTensor:
    """`t` replicated over every mesh dimension but the last, placed as `inner` on that one."""
    if t.device_mesh.ndim < 2:
        return t
    return t.redistribute(t.device_mesh, [*[Replicate()] * (t.device_mesh.ndim - 1), inner])
