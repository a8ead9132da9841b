"""Checkpoints of a multi-process pipeline with torch.distributed.checkpoint, keyed like the model.

Each rank saves the weights it holds under the model's own state_dict keys (replicas of a
weight are written once), plus its optimizer state as `optim/<key>/<name>`. A checkpoint
loads into the same plan or a different one (each rank reads the keys it now holds), and
`consolidate` turns it into one plain state_dict that the un-partitioned model loads with
strict=True.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

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
    state: dict[str, Any] = dict(_held(pipe))
    if optimizer is not None:
        for key, p in _param_keys(pipe).items():
            for name, value in optimizer.state.get(p, {}).items():
                state[f"{_OPTIM}{key}/{name}"] = value
    dcp.save(state, checkpoint_id=str(path))


def load(pipe: Any, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load the weights (and optimizer state) this rank holds; every rank calls it.

    Raises:
        KeyError: the checkpoint lacks a weight this rank needs (a checkpoint of another model?).
    """
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state: dict[str, Any] = dict(_held(pipe))
    missing = [k for k in state if k not in metadata]
    if missing:
        raise KeyError(f"checkpoint {path} has no {missing[:3]}; was it saved from this model?")
    slots: list[tuple[nn.Parameter, str, str]] = []
    if optimizer is not None:
        for key, p in _param_keys(pipe).items():
            prefix = f"{_OPTIM}{key}/"
            for entry, meta in metadata.items():
                if entry.startswith(prefix):
                    name = entry[len(prefix):]
                    if isinstance(meta, TensorStorageMetadata):
                        state[entry] = torch.empty(meta.size, dtype=meta.properties.dtype, device=p.device)
                    else:
                        state[entry] = None
                    slots.append((p, name, entry))
    dcp.load(state, checkpoint_id=str(path))
    for p, name, entry in slots:
        optimizer.state[p][name] = state[entry]  # type: ignore[union-attr]


def consolidate(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The model's full state_dict from a checkpoint, offline (no process group needed)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        target = os.path.join(tmp, "model.pt")
        dcp_to_torch_save(str(path), target)
        full = torch.load(target, weights_only=False)
    return {k: v for k, v in full.items() if not k.startswith(_OPTIM)}
