"""State-dict sources read one tensor at a time: safetensors, DCP, torch.save files, or a mapping.

`open_weights(path_or_mapping)` detects the kind and returns a `WeightSource`, which answers
what a key holds (`spec`: shape and dtype, from headers or metadata, no tensor data) and copies
one key's values into a tensor the caller allocated (`read_into`). Nothing here holds the whole
model: a stage reads its own keys and the host keeps at most one tensor more than the stage.

[Note: reading safetensors without mmap] `safe_open(...).get_tensor` maps the file, and the
pages it touches count in the process's RSS while mapped: reading a whole stage through one
mapping costs up to twice the stage's bytes. We parse the header ourselves and `readinto` each
tensor's bytes straight into its destination (CPU) or a bounded staging buffer (other devices).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Mapping, Protocol, Union

import torch

from runtime.errors import PartitionError

__all__ = ["WeightSource", "Weights", "open_weights"]

Weights = Union[str, "os.PathLike[str]", Mapping[str, torch.Tensor]]

_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_STAGING_BYTES = 64 << 20  # reads for a non-CPU destination go through a CPU buffer of at most this size
_TORCH_SAVE_REOPEN_BYTES = 256 << 20  # a torch.save file is re-mapped after this many bytes (see below)
KINDS = ("a .safetensors file", "a folder of *.safetensors (with or without model.safetensors.index.json)",
         "a torch.distributed.checkpoint (DCP) folder", "a torch.save file (.pt/.pth/.bin)",
         "a Mapping[str, Tensor]")


class WeightSource(Protocol):
    """Tensors by state-dict key, read one at a time."""

    def keys(self) -> list[str]: ...

    def spec(self, key: str) -> tuple[tuple[int, ...], torch.dtype]: ...

    def read_into(self, key: str, out: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class MappingSource:
    """An in-memory state dict (what `model.state_dict()` returns); values are copied, never aliased."""

    def __init__(self, mapping: Mapping[str, torch.Tensor]) -> None:
        self.mapping = mapping

    def keys(self) -> list[str]:
        return list(self.mapping)

    def spec(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        value = self.mapping[key]
        return tuple(value.shape), value.dtype

    def read_into(self, key: str, out: torch.Tensor) -> None:
        with torch.no_grad():
            out.copy_(self.mapping[key])

    def close(self) -> None:
        pass


def _header(path: Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data section, header dict) of a safetensors file."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


class SafetensorsSource:
    """One or more .safetensors files, each tensor read with plain file reads.

    See [Note: reading safetensors without mmap].
    """

    def __init__(self, files: list[Path], weight_map: Mapping[str, str] | None = None) -> None:
        self.entries: dict[str, tuple[Path, int, int, tuple[int, ...], torch.dtype]] = {}
        wanted = {f.name for f in files} if weight_map is None else set(weight_map.values())
        for path in files:
            if path.name not in wanted:
                continue
            start, header = _header(path)
            for key, info in header.items():
                if weight_map is not None and weight_map.get(key) != path.name:
                    continue
                dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
                if dtype is None:
                    raise PartitionError(f"{path}: tensor {key!r} has dtype {info['dtype']}, which this reader does "
                                         f"not know; known: {', '.join(_SAFETENSORS_DTYPES)}")
                begin, end = info["data_offsets"]
                self.entries[key] = (path, start + begin, end - begin, tuple(info["shape"]), dtype)

    def keys(self) -> list[str]:
        return list(self.entries)

    def spec(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        _, _, _, shape, dtype = self.entries[key]
        return shape, dtype

    def read_into(self, key: str, out: torch.Tensor) -> None:
        path, offset, size, _, _ = self.entries[key]
        if size != out.numel() * out.element_size():
            raise PartitionError(f"{path}: tensor {key!r} holds {size} bytes, the model's takes "
                                 f"{out.numel() * out.element_size()}; the header and the data disagree")
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            if out.device.type == "cpu" and out.is_contiguous():
                _read_exactly(f, _bytes_of(out), key, path)
                return
            flat = out.view(-1) if out.is_contiguous() else None
            staging = torch.empty(min(size, _STAGING_BYTES), dtype=torch.uint8)
            done = 0
            while done < size:
                n = min(size - done, staging.numel())
                _read_exactly(f, staging[:n].numpy(), key, path)
                part = staging[:n].view(out.dtype)
                first = done // out.element_size()
                with torch.no_grad():
                    if flat is not None:
                        flat[first : first + part.numel()].copy_(part)
                    else:  # pragma: no cover - our destinations are contiguous
                        out.view(-1)[first : first + part.numel()].copy_(part)
                done += n

    def close(self) -> None:
        pass


def _bytes_of(t: torch.Tensor) -> Any:
    """A writable uint8 numpy view of a contiguous CPU tensor's storage, any dtype (bf16 included)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _read_exactly(f: Any, buffer: Any, key: str, path: Path) -> None:
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise PartitionError(f"{path}: the file ends inside tensor {key!r}; it is truncated, write it again")
        done += n


class TorchSaveSource:
    """A torch.save'd state dict, loaded with mmap=True and weights_only=True.

    Touched pages of the mapping count in RSS while it is mapped, so the file is mapped again
    (the old mapping dropped) after every `_TORCH_SAVE_REOPEN_BYTES` read: the host holds at most
    that much of the file on top of the destination tensors.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._state: dict[str, Any] | None = None
        self._read = 0
        self._specs = {k: (tuple(v.shape), v.dtype) for k, v in self._open().items() if isinstance(v, torch.Tensor)}

    def _open(self) -> dict[str, Any]:
        if self._state is None:
            try:
                state = torch.load(self.path, mmap=True, weights_only=True, map_location="cpu")
            except Exception as exc:  # noqa: BLE001 - any failure: name the file and the kinds we read
                raise PartitionError(f"weights={str(self.path)!r} cannot be read by torch.load(weights_only=True): "
                                     f"{type(exc).__name__}: {exc}") from None
            if not isinstance(state, Mapping):
                raise PartitionError(f"weights={str(self.path)!r} holds a {type(state).__name__}, not a state dict "
                                     "(a mapping of names to tensors); save model.state_dict()")
            self._state = dict(state)
        return self._state

    def keys(self) -> list[str]:
        return list(self._specs)

    def spec(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self._specs[key]

    def read_into(self, key: str, out: torch.Tensor) -> None:
        with torch.no_grad():
            out.copy_(self._open()[key])
        self._read += out.numel() * out.element_size()
        if self._read >= _TORCH_SAVE_REOPEN_BYTES:
            self.close()

    def close(self) -> None:
        self._state, self._read = None, 0


class DcpSource:
    """A torch.distributed.checkpoint folder; keys are read with `dcp.load(..., no_dist=True)`, so
    each rank reads only its own keys and no collective runs."""

    def __init__(self, path: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        metadata = FileSystemReader(str(path)).read_metadata()
        self._specs = {
            key: (tuple(meta.size), meta.properties.dtype)
            for key, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)
        }

    def keys(self) -> list[str]:
        return list(self._specs)

    def spec(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        return self._specs[key]

    def read_into(self, key: str, out: torch.Tensor) -> None:
        import torch.distributed.checkpoint as dcp

        target = out if out.device.type == "cpu" else torch.empty_like(out, device="cpu")
        dcp.load({key: target}, checkpoint_id=str(self.path), no_dist=True)
        if target is not out:
            with torch.no_grad():
                out.copy_(target)

    def close(self) -> None:
        pass


def open_weights(weights: Weights) -> WeightSource:
    """The source `weights` names: a path (its kind detected from its contents) or a mapping.

    Raises:
        PartitionError: the path does not exist or is none of the kinds read here (named in the message).
    """
    if isinstance(weights, Mapping):
        bad = [k for k, v in weights.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise PartitionError(f"weights maps {bad[0]!r} to a {type(weights[bad[0]]).__name__}; every value "
                                 "must be a tensor (a state dict)")
        return MappingSource(weights)
    if not isinstance(weights, (str, os.PathLike)):
        raise PartitionError(f"weights is a {type(weights).__name__}; pass one of: {'; '.join(KINDS)}")
    path = Path(weights)
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return SafetensorsSource([path / name for name in sorted(set(weight_map.values()))], weight_map)
        files = sorted(path.glob("*.safetensors"))
        if files:
            return SafetensorsSource(files)
        if (path / ".metadata").exists():
            return DcpSource(path)
        raise PartitionError(f"weights={str(path)!r} is a folder with no *.safetensors files and no DCP .metadata; "
                             f"pass one of: {'; '.join(KINDS)}")
    if not path.exists():
        raise PartitionError(f"weights={str(path)!r} does not exist; pass one of: {'; '.join(KINDS)}")
    with open(path, "rb") as f:
        head = f.read(9)
    if path.suffix == ".safetensors" or (len(head) == 9 and head[8:9] == b"{"):
        return SafetensorsSource([path])
    if head[:2] == b"PK" or head[:1] == b"\x80":  # torch.save's zip format, or the legacy pickle
        return TorchSaveSource(path)
    raise PartitionError(f"weights={str(path)!r} is none of the kinds read here; pass one of: {'; '.join(KINDS)}")
