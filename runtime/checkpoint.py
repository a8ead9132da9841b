"""Checkpoints of a multi-process pipeline with torch.distributed.checkpoint, keyed like the model.

Each rank saves the weights it holds under the model's own state_dict keys (replicas of a
weight are written once), plus its optimizer state as `optim/<key>/<name>`. A checkpoint
loads into the same plan or a different one (each rank reads the keys it now holds), and
`consolidate` turns it into one plain state_dict that the un-partitioned model loads with
strict=True. A weight split over tensor ranks or sharded by FSDP2 is a DTensor under its model
key: DCP writes each rank's part of the whole (a fused q/k/v weight's strided split as a plain row
split, runtime.dtensor_save.savable) and reads back whatever part a rank holds now.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from runtime.dtensor_save import savable, unsaved

__all__ = ["consolidate", "load", "save"]

_OPTIM = "optim/"


def _held(pipe: Any) -> dict[str, torch.Tensor]:
    """model.state_dict() entries this rank holds, sharing storage with the live tensors."""
    held = pipe.held_tensor_ids()
    return {k: v.detach() for k, v in pipe.model.state_dict(keep_vars=True).items() if id(v) in held}


def _param_keys(pipe: Any) -> dict[str, nn.Parameter]:
    held = pipe.held_tensor_ids()
    return {k: p for k, p in pipe.model.named_parameters() if id(p) in held}


def save(pipe: Any, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write this rank's share of the checkpoint; every rank calls it with the same path."""
    state: dict[str, Any] = {k: savable(v) for k, v in sorted(_held(pipe).items())}
    if optimizer is not None:
        for key, p in sorted(_param_keys(pipe).items()):
            for name, value in optimizer.state.get(p, {}).items():
                state[f"{_OPTIM}{key}/{name}"] = savable(value) if isinstance(value, torch.Tensor) else value
    dcp.save(state, checkpoint_id=str(path))


def load(pipe: Any, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load the weights (and optimizer state) this rank holds; every rank calls it.

    Raises:
        KeyError: the checkpoint lacks a weight this rank needs (a checkpoint of another model?).
    """
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    live = dict(sorted(_held(pipe).items()))
    state: dict[str, Any] = {k: savable(v) for k, v in live.items()}  # loaded in place, or into a copy (strided)
    missing = [k for k in state if k not in metadata]
    if missing:
        raise KeyError(f"checkpoint {path} has no {missing[:3]}; was it saved from this model?")
    slots: list[tuple[nn.Parameter, str, str]] = []
    if optimizer is not None:
        for key, p in sorted(_param_keys(pipe).items()):
            prefix = f"{_OPTIM}{key}/"
            for entry, meta in metadata.items():
                if entry.startswith(prefix):
                    name = entry[len(prefix):]
                    if isinstance(meta, TensorStorageMetadata) and isinstance(p, DTensor) and meta.size == p.shape:
                        state[entry] = savable(torch.zeros_like(p, dtype=meta.properties.dtype))  # p's part
                    elif isinstance(meta, TensorStorageMetadata):
                        state[entry] = torch.empty(meta.size, dtype=meta.properties.dtype, device=p.device)
                    else:
                        state[entry] = None
                    slots.append((p, name, entry))
    dcp.load(state, checkpoint_id=str(path))
    with torch.no_grad():
        for key, t in live.items():  # a redistributed copy (a strided split) back into the live weight
            if state[key] is not t and isinstance(t, DTensor):
                t.copy_(unsaved(state[key], t))
    for p, name, entry in slots:
        value = state[entry]
        if isinstance(p, DTensor) and isinstance(value, DTensor):
            value = unsaved(value, p)
        optimizer.state[p][name] = value  # type: ignore[union-attr]


def consolidate(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The model's full state_dict from a checkpoint, offline (no process group needed)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        target = os.path.join(tmp, "model.pt")
        dcp_to_torch_save(str(path), target)
        full = torch.load(target, weights_only=False)
    return {k: v for k, v in full.items() if not k.startswith(_OPTIM)}
