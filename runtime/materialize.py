"""Give a meta model's weights storage on their stage's device, filled from a source or an init.

`Materializer(model, weights=..., init=...)` is handed to `runtime.stage.build_stages`, which
calls it with the (tensor, device) pairs its stages hold once it knows where each lives; only
those tensors get storage, on that device, so a rank never allocates another rank's weights.
Each tensor keeps its identity (`torch.utils.swap_tensors`): tied weights stay one Parameter,
and the stage graphs, the model and an optimizer all see the new values.

Rules (the README's "meta models" section says the same):
- `weights` is read by state-dict key, one tensor at a time (runtime.weights); a Hugging Face
  model's legacy names and layouts as `from_pretrained` reads them (runtime.weight_names). A tied
  weight is found under any of its names. Shapes and dtypes must equal the model's.
- `init` runs first, on every module owning a tensor being materialized: a callable
  `init(module)` (which fills what it likes), or "reset_parameters" (each module's own method).
  Each module's call runs under its own seed (`torch.initial_seed()` + a hash of its path), so
  the values depend neither on the split nor on the rank: a weight two ranks hold is equal on both.
- What no rule fills is an error: a persistent key missing from `weights`, a parameter whose
  module has no reset_parameters(), or a non-persistent buffer on meta (no checkpoint holds one:
  build it for real, e.g. `with partitioner.meta.empty_weights():` keeps buffers real, or fill it
  in `init`). Every problem is listed at once, before anything is allocated, with the checkpoint's
  keys that name no tensor of the model (a few, most like the missing ones first, and their count).
- A tensor that is not on meta is loaded from `weights` too when given (`load_real=True`).
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import zlib
from typing import Any, Callable, Iterator, Literal

import torch
from torch import nn

from runtime.errors import PartitionError
from runtime.weight_names import NamedSource, named_as_model
from runtime.weights import WeightSource

__all__ = ["Init", "Materializer", "swap", "tensor_names"]

_SHOWN = 5  # unmatched checkpoint keys named in an error

Init = Callable[[nn.Module], Any] | Literal["reset_parameters"]


def tensor_names(model: nn.Module) -> dict[int, list[tuple[str, str, bool]]]:
    """Every parameter and buffer (by id): its (qualified name, owning module path, persistent) entries,
    several for a tied weight, in `named_parameters(remove_duplicate=False)` order."""
    found: dict[int, list[tuple[str, str, bool]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        for name, p in module._parameters.items():
            if p is not None:
                found.setdefault(id(p), []).append((prefix + name, path, True))
        for name, b in module._buffers.items():
            if b is not None:
                persistent = name not in module._non_persistent_buffers_set
                found.setdefault(id(b), []).append((prefix + name, path, persistent))
    return found


def swap(a: torch.Tensor, b: torch.Tensor) -> None:
    """`torch.utils.swap_tensors(a, b)`; where a weak reference is in the way (a finished tracer's, garbage
    not yet collected) after a collection, and a RuntimeError naming the tensor where one is still alive."""
    try:
        torch.utils.swap_tensors(a, b)
        return
    except RuntimeError:
        gc.collect()
    try:
        torch.utils.swap_tensors(a, b)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot swap a tensor of shape {tuple(a.shape)} on {a.device} for one on {b.device}: "
                           f"{exc} (something still holds a weak reference to it)") from exc


@contextlib.contextmanager
def _seeded(base: int, path: str, device: torch.device) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed((base + zlib.crc32(path.encode())) % (2**63))
        yield


class Materializer:
    """Fills the tensors `build_stages` places, once each; see the module docstring for the rules."""

    def __init__(self, model: nn.Module, *, weights: WeightSource | None, init: Init | None,
                 load_real: bool = False) -> None:
        if weights is None and init is None:
            raise PartitionError("nothing to materialize the model from: pass weights= (a checkpoint) or init=")
        self.model = model
        self.source = named_as_model(weights, model) if weights is not None else None  # legacy names resolved
        self.init = init
        self.load_real = load_real
        self.names = tensor_names(model)
        self.modules = dict(model.named_modules(remove_duplicate=False))
        self.keys = set(self.source.keys()) if self.source is not None else set()
        self.done: set[int] = set()
        self.seed = torch.initial_seed()  # read once: manual_seed (ours, per module) changes it

    def _key(self, t: torch.Tensor) -> str | None:
        return next((name for name, _, _ in self.names.get(id(t), []) if name in self.keys), None)

    def _persistent(self, t: torch.Tensor) -> bool:
        return any(persistent for _, _, persistent in self.names.get(id(t), []))

    def _has_reset(self, path: str) -> bool:
        return callable(getattr(self.modules[path], "reset_parameters", None))

    def _problem(self, t: torch.Tensor) -> str | None:
        """Why `t` cannot be filled (None: it can)."""
        entries = self.names.get(id(t))
        if not entries:
            return f"a tensor of shape {tuple(t.shape)} that is no parameter or buffer of the model is on meta"
        name, path, persistent = entries[0]
        key = self._key(t)
        if key is not None:
            assert self.source is not None
            shape, dtype = self.source.spec(key)
            if shape != tuple(t.shape) or dtype != t.dtype:
                return (f"{key!r}: the checkpoint holds shape {shape} {dtype}, the model expects {tuple(t.shape)} "
                        f"{t.dtype}; build the model with the checkpoint's configuration and dtype")
            return None
        if t.device.type != "meta":  # loaded into a real model: strict, as load_state_dict
            return f"{name!r} is not in weights (a real tensor, which weights= must give like every other)"
        if callable(self.init):
            return None
        is_param = isinstance(t, nn.Parameter)
        if self.init == "reset_parameters" and any(self._has_reset(p) for _, p, _ in entries):
            return None
        if not persistent:
            return (f"buffer {name!r} is on meta and non-persistent, so no checkpoint holds it; build it for real "
                    "(with partitioner.meta.empty_weights(): parameters on meta, buffers real) or fill it in an "
                    "init= callable")
        if self.init == "reset_parameters":
            kind = "parameter" if is_param else "buffer"
            return (f"{kind} {name!r}: module {path or type(self.model).__name__!r} has no reset_parameters(); "
                    "put it in weights= or pass an init= callable that fills it")
        return f"{name!r} is missing from weights; pass a checkpoint that has it, or an init= that fills it"

    def _unmatched(self, missing: list[str]) -> str:
        """The weights' keys that name no tensor of the model, a few (those most like `missing` first) and their
        count ('' if none)."""
        if self.source is None:
            return ""
        if isinstance(self.source, NamedSource):
            unused = self.source.unused
        else:
            names = {name for entries in self.names.values() for name, _, _ in entries}
            unused = sorted(k for k in self.keys if k not in names)
        if not unused:
            return ""
        if missing and len(unused) * len(missing) <= 100_000:
            unused = sorted(unused, key=lambda k: -max(difflib.SequenceMatcher(None, k, m).ratio() for m in missing))
        shown = ", ".join(repr(k) for k in unused[:_SHOWN])
        more = f" and {len(unused) - _SHOWN} more" if len(unused) > _SHOWN else ""
        return (f"\nweights holds {len(unused)} key(s) that name no tensor of the model: {shown}{more}; a checkpoint "
                "of another model or configuration, or names to map (load it into the model and pass its state_dict())")

    def __call__(self, placed: list[tuple[torch.Tensor, torch.device]]) -> tuple[set[int], Callable[[], None]]:
        """Give storage to every placed tensor that needs it; return their ids and an undo."""
        targets = [(t, d) for t, d in placed if id(t) not in self.done
                   and (t.device.type == "meta" or (self.load_real and self._persistent(t)))]
        found = [(t, self._problem(t)) for t, _ in targets]
        problems = [p for _, p in found if p is not None]
        if problems:
            missing = [self.names[id(t)][0][0] for t, p in found if p is not None and id(t) in self.names]
            raise PartitionError("cannot materialize the model's weights:\n" + "\n".join(f"- {p}" for p in problems)
                                 + self._unmatched(missing))
        swapped: list[tuple[torch.Tensor, torch.Tensor]] = []

        def undo() -> None:
            for t, old in reversed(swapped):
                swap(t, old)
            self.done.difference_update(id(t) for t, _ in swapped)

        try:
            for t, device in targets:
                fresh = torch.empty(t.shape, dtype=t.dtype, device=device)
                holder = nn.Parameter(fresh, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fresh
                swap(t, holder)  # `holder` now holds the old (meta) tensor, for undo
                swapped.append((t, holder))
                self.done.add(id(t))
            with torch.no_grad():
                self._run_init(targets)
                for t, _ in targets:
                    key = self._key(t)
                    if key is not None:
                        assert self.source is not None
                        self.source.read_into(key, t)
            if self.source is not None:
                self.source.close()
        except BaseException:
            undo()
            raise
        return {id(t) for t, _ in targets}, undo

    def _run_init(self, targets: list[tuple[torch.Tensor, torch.device]]) -> None:
        if self.init is None:
            return
        paths: dict[str, torch.device] = {}
        for t, device in targets:
            for _, path, _ in self.names.get(id(t), []):
                paths.setdefault(path, device)
        for path in sorted(paths):
            module = self.modules[path]
            with _seeded(self.seed, path, paths[path]):
                if self.init == "reset_parameters":
                    if self._has_reset(path):
                        module.reset_parameters()
                else:
                    self.init(module)
