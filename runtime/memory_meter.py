"""Measured peak memory per stage: bytes of live tensor storage each stage holds during real steps.

Torch keeps no statistics of CPU allocations, so `MemoryMeter` watches tensor storage itself:

    a Python dispatch mode sees every operator's outputs ──► a storage not seen before is charged
        (forwards, the loss, backwards, recomputation,         to its stage, once (by identity);
         optimizer steps; worker threads carry the mode)       weakref.finalize uncharges it when
                                                               the storage dies (torch keeps one
                                                               Python object per live storage)

Which stage a new storage belongs to (see [Note: whose bytes]):
- inside a stage's forward (a pre-hook on the stage module): that stage;
- inside a node of a stage's autograd graph (pre- and post-hooks on every node the stage's
  forward made): that stage; gradients, recomputation and its buffers included;
- elsewhere (the loss, autograd's first gradient, the optimizer's state and its temporaries):
  the stage owning the operator's first input it knows (logits -> the last stage; a
  parameter -> its stage); with none known, `other`.
Storages alive when the meter starts are counted too: each stage module's parameters and buffers,
their gradients, and the given optimizer's state (a weight read by two stages is the first one's).

Why not the profiler's memory events: they name the thread, not the stage, and a one-thread
pipeline (`threads=False`) runs every stage on one thread. On CUDA, `CudaPeaks` reads the
allocator's own per-device peak (`torch.cuda.max_memory_allocated`) for comparison.

[Note: whose bytes]
On one CPU, a value sent from stage s to s + 1 is one storage (nothing is copied). It counts for
s, which made it, and for s + 1 once an operator of s + 1 reads it (a gradient sent back
likewise), as two devices would each hold a copy; until the storage dies, so a receiver may be
charged a little longer than its own copy would live. A storage the step's caller made (the
batch) counts for each stage reading it. The stages' sum can thus exceed the process's bytes.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CudaPeaks", "MemoryMeter", "OTHER"]

OTHER = -1  # the owner of storages no stage holds (the step's inputs, a scalar made outside any stage)
_CLAIM = "memory_meter_stage"  # autograd node metadata: the stage whose graph the node is in


class MemoryMeter:
    """Bytes of live tensor storage per stage, now and at the peak since `start` (or `reset_peaks`).

    Use as a context around real steps (`pipe.train_step(...)`, `optimizer.step()`); read `peaks`.

    Args:
        stages: the stage modules in stage order (`[s.module for s in pipe.stages]`).
        optimizer: its state (created at its first step, or present already) is counted on the
            stage of each parameter.
    """

    def __init__(self, stages: Sequence[nn.Module], *, optimizer: torch.optim.Optimizer | None = None) -> None:
        if not stages:
            raise ValueError("MemoryMeter needs at least one stage module; pass [s.module for s in pipe.stages]")
        self.stages = list(stages)
        self.optimizer = optimizer
        self._lock = threading.Lock()
        self._local = threading.local()  # .scope: stack of stage indices of this thread
        self._live: dict[int, _Held] = {}  # storage id -> who holds it, its bytes, its finalizer
        self._now: dict[int, int] = {}
        self._peak: dict[int, int] = {}
        self._hooks: list[Any] = []
        self._mode: _Watch | None = None

    # ---- results ----

    @property
    def peaks(self) -> list[int]:
        """Each stage's peak bytes since `start` or the last `reset_peaks`."""
        return [self._peak.get(s, 0) for s in range(len(self.stages))]

    @property
    def now(self) -> list[int]:
        """Each stage's bytes held now."""
        return [self._now.get(s, 0) for s in range(len(self.stages))]

    @property
    def other_peak(self) -> int:
        """Peak bytes of storages no stage holds (see OTHER)."""
        return self._peak.get(OTHER, 0)

    def reset_peaks(self) -> None:
        """Start the peaks again from what is held now (a steady-state step after a warm-up one)."""
        with self._lock:
            self._peak = dict(self._now)

    # ---- start and stop ----

    def __enter__(self) -> MemoryMeter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Count what is alive, hook the stages, and watch every operator from now on.

        Raises:
            RuntimeError: the meter is running already.
        """
        if self._mode is not None:
            raise RuntimeError("this MemoryMeter is running already; stop it (or leave its `with`) first")
        self._live, self._now, self._peak = {}, {}, {}
        for s, module in enumerate(self.stages):
            for t in [*module.parameters(), *module.buffers()]:
                self._charge(t, s)
                if t.grad is not None:
                    self._charge(t.grad, s)
        if self.optimizer is not None:
            owner = {self._key(t): s for s, m in enumerate(self.stages) for t in m.parameters()}
            for p, state in self.optimizer.state.items():
                s = owner.get(self._key(p), OTHER) if isinstance(p, torch.Tensor) else OTHER
                for t in pytree.tree_leaves(state):
                    if isinstance(t, torch.Tensor):
                        self._charge(t, s)
        for s, module in enumerate(self.stages):
            self._hooks.append(module.register_forward_pre_hook(lambda m, args, s=s: self._push(s)))
            self._hooks.append(module.register_forward_hook(lambda m, args, out, s=s: self._claim(s, out),
                                                            always_call=True))
        self._mode = _Watch(self)
        self._mode.__enter__()

    def stop(self) -> None:
        """Stop watching; the peaks stay readable. Call it on the thread that started the meter."""
        if self._mode is None:
            return
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        with self._lock:
            for held in self._live.values():
                held.finalizer.detach()
            self._live.clear()

    # ---- scopes: which stage runs on this thread ----

    def _stack(self) -> list[int]:
        stack: list[int] | None = getattr(self._local, "scope", None)
        if stack is None:
            stack = self._local.scope = []
        return stack

    def _push(self, s: int) -> None:
        self._stack().append(s)

    def _pop(self) -> None:
        stack = self._stack()
        if stack:
            stack.pop()

    def _claim(self, s: int, outputs: Any) -> None:
        """After stage s's forward: leave its scope, and mark every new node of its autograd graph as s's."""
        self._pop()
        todo: list[Any] = [t.grad_fn for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
        while todo:
            node = todo.pop()
            if node is None or _CLAIM in node.metadata or type(node).__name__ == "AccumulateGrad":
                continue  # another stage's graph (forward mode keeps boundaries attached), or a leaf's
            node.metadata[_CLAIM] = s
            node.register_prehook(lambda grads, s=s: self._push(s))
            node.register_hook(lambda grad_in, grad_out: self._pop())
            todo.extend(n for n, _ in node.next_functions)

    def _owner(self, inputs: list[torch.Tensor]) -> int:
        stack = self._stack()
        if stack:
            return stack[-1]
        for t in inputs:
            held = self._live.get(self._key(t))
            if held is not None and held.owner != OTHER:
                return held.owner
        return OTHER

    # ---- the ledger ----

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return id(t.untyped_storage())

    def _charge(self, t: torch.Tensor, owner: int) -> None:
        """Count `t`'s storage for `owner` if it is new; follow a resize of a known one."""
        if t.device.type == "meta" or t.is_sparse:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage of its own
            return
        key, nbytes = id(storage), storage.nbytes()
        known = self._live.get(key)
        if known is not None and known.nbytes == nbytes and (owner == OTHER or owner in known.holders):
            return  # the common case, without the lock
        with self._lock:
            held = self._live.get(key)
            if held is not None:
                if held.nbytes != nbytes:
                    for s in held.holders:
                        self._add(s, nbytes - held.nbytes)
                    held.nbytes = nbytes
                if owner != OTHER and owner not in held.holders:  # read by another stage: see [Note: whose bytes]
                    held.holders.add(owner)
                    self._add(owner, nbytes)
                return
            if nbytes == 0:
                return
            self._live[key] = _Held(owner, {owner}, nbytes, weakref.finalize(storage, self._free, key))
            self._add(owner, nbytes)

    def _free(self, key: int) -> None:
        with self._lock:
            held = self._live.pop(key, None)
            if held is not None:
                for s in held.holders:
                    self._add(s, -held.nbytes)

    def _add(self, owner: int, nbytes: int) -> None:
        now = self._now[owner] = self._now.get(owner, 0) + nbytes
        if now > self._peak.get(owner, 0):
            self._peak[owner] = now

    def _saw(self, args: Any, out: Any) -> None:
        inputs = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)]
        owner = self._owner(inputs)
        if owner != OTHER:
            for t in inputs:  # a stage reading a storage made elsewhere holds it too
                self._charge(t, owner)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._charge(t, owner)


class _Held:
    """A live storage in the ledger: the stage that made it, every stage holding it, its bytes."""

    __slots__ = ("finalizer", "holders", "nbytes", "owner")

    def __init__(self, owner: int, holders: set[int], nbytes: int, finalizer: weakref.finalize[Any, Any]) -> None:
        self.owner, self.holders, self.nbytes, self.finalizer = owner, holders, nbytes, finalizer


class _Watch(TorchDispatchMode):
    """Hands every operator's outputs to the meter. Pipeline workers enter the caller's dispatch
    modes (runtime.thread_state), so worker threads are watched too."""

    def __init__(self, meter: MemoryMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.meter._saw((args, kwargs), out)
        return out


class CudaPeaks:
    """The CUDA caching allocator's peak per stage: `torch.cuda.max_memory_allocated` of its device.

    Stages sharing a device share its peak. `reset` before the steps, `peaks` after them.

    Raises:
        ValueError: a stage device that is not CUDA.
    """

    def __init__(self, devices: Sequence[torch.device | str]) -> None:
        self.devices = [torch.device(d) for d in devices]
        bad = [str(d) for d in self.devices if d.type != "cuda"]
        if bad:
            raise ValueError(f"CudaPeaks reads CUDA allocator statistics, but stages sit on {bad}; "
                             "use MemoryMeter for other devices")

    def reset(self) -> None:
        for d in dict.fromkeys(self.devices):
            torch.cuda.synchronize(d)
            torch.cuda.reset_peak_memory_stats(d)

    @property
    def peaks(self) -> list[int]:
        for d in dict.fromkeys(self.devices):
            torch.cuda.synchronize(d)
        return [int(torch.cuda.max_memory_allocated(d)) for d in self.devices]
