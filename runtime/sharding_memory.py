"""Measured bytes of live tensor storage on one rank of a sharded stage, now and at the peak, FSDP2's shards included.

runtime.memory_meter.MemoryMeter charges storages to stages but misses what FSDP2 does:
its weights, gradients and optimizer states are DTensors (no storage of their own: the local
shard has it), and it frees a gathered weight by resizing its storage to 0 bytes (the storage
object lives on, so no finalizer runs) and gathers it again by resizing it back. `RankMemory`
counts every storage of this process (one stage per rank, so no attribution is needed):

    start: the given tensors (the stage's weights, buffers, gradients, optimizer state; a DTensor's
           local shard) ──► a dispatch mode sees every operator: the storages of its inputs and
           outputs are counted once (by identity), weakref.finalize uncounts a storage when it dies,
           and after every operator the counted storages' sizes are read again (FSDP2's resizes)

Torch keeps no statistics of CPU allocations, and the profiler's memory events lose a free made
on another thread (gloo's) and any free of a block allocated before it started, so this is the
CPU measure; on CUDA, torch.cuda.max_memory_allocated is the allocator's own. Buffers a
communication backend allocates inside a collective (gloo's) are not tensors and not counted.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["RankMemory"]


class RankMemory(TorchDispatchMode):
    """Bytes of live tensor storage of this process since `start`, and their peak.

    Use as a context around real steps (forwards, backwards, optimizer steps); read `peak`.

    Args:
        held: tensors alive at the start that the rank holds (`stage.parameters()`, buffers, the
            optimizer's state tensors): counted from the start.
    """

    def __init__(self, held: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._held = list(held)
        self._live: dict[int, tuple[weakref.ref[Any], int]] = {}  # id(storage) -> (storage, bytes counted)
        self._finalizers: list[weakref.finalize[Any, Any]] = []
        self.now = 0
        self.peak = 0

    def __enter__(self) -> RankMemory:
        self._live, self.now, self.peak = {}, 0, 0
        for t in self._held:
            self._count(t)
        self.peak = self.now
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        self._live.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                self._count(t)
        self._resized()
        self.peak = max(self.peak, self.now)
        return out

    def _count(self, t: torch.Tensor) -> None:
        if isinstance(t, DTensor):
            t = t.to_local()
        if t.device.type == "meta" or t.is_sparse:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage of its own
            return
        key = id(storage)
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = (weakref.ref(storage), nbytes)
        self._finalizers.append(weakref.finalize(storage, self._free, key))
        self.now += nbytes

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.now -= entry[1]

    def _resized(self) -> None:
        for key, (ref, counted) in list(self._live.items()):
            storage = ref()
            if storage is None:
                continue
            nbytes = storage.nbytes()
            if nbytes != counted:
                self._live[key] = (ref, nbytes)
                self.now += nbytes - counted
