"""Timing helpers for the profiler: clocks, interval timers (host clocks on CPU, CUDA events on a GPU
through `rules.timing`), one graph node run alone (forward, then backward); rounds of them: `cost_model.rounds`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Literal, Mapping, Protocol

import torch
import torch.fx
import torch.utils._pytree as pytree

from rules.device_args import on_device
from rules.timing import elapsed_s, record_event, sync, uses_events

__all__ = [
    "Clock", "CudaTimer", "NodeRunner", "Submodules", "Timer", "is_out_of_memory", "make_timer", "materialize",
    "release_cached", "steady_host_allocator", "sync", "timer_for",
]  # fmt: skip

Clock = Literal["wall", "cpu"]


def make_timer(device: torch.device, clock: Clock = "wall") -> Callable[[], float]:
    """A seconds counter: wall time, or ("cpu") this thread's CPU time.

    CPU time ignores time taken by other processes on a shared machine, so timings stay
    steady under load; it equals the op's time only on CPU with one torch thread (all work,
    backward included, then runs in the calling thread).

    Raises:
        ValueError: clock='cpu' for another device or with several torch threads.
    """
    if clock == "wall":
        return time.perf_counter
    if clock != "cpu":
        raise ValueError(f"clock={clock!r}; use 'wall' or 'cpu'")
    if device.type != "cpu" or torch.get_num_threads() != 1:
        raise ValueError(
            f"clock='cpu' measures this thread only, so it needs device 'cpu' and torch.set_num_threads(1) "
            f"(got {device}, {torch.get_num_threads()} threads); use clock='wall'"
        )
    return time.thread_time


_INPLACE_OPERATORS = {
    "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul",
    "iand", "ior", "ixor", "ilshift", "irshift",
}


def steady_host_allocator(limit_bytes: int = 1 << 30) -> bool:
    """Keep freed host memory for reuse (glibc), as CUDA's caching allocator does on a GPU.

    By default glibc returns large freed blocks to the OS and the next allocation of that
    size page-faults again, which can double a CPU layer's time at random. This raises the
    mmap and trim thresholds to `limit_bytes` for the whole process, so repeated runs see
    steady times. Returns False (and changes nothing) where glibc is not the allocator.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(
            libc.mallopt(m_mmap_threshold, int(limit_bytes)) and libc.mallopt(m_trim_threshold, int(limit_bytes))
        )
    except (OSError, AttributeError):
        return False


def release_cached(device: torch.device) -> None:
    """Give the CUDA caching allocator's free blocks back (a no-op elsewhere), e.g. after running out of memory."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a device running out of memory: `torch.cuda.OutOfMemoryError`, or a RuntimeError that says so."""
    return isinstance(exc, torch.cuda.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc)
    )


class Timer:
    """Intervals timed by a host clock: `start()`, `stop()` (an interval's index), `results()`.

    The profiler's CPU timing, unchanged: wait for the device (a no-op on CPU) and read the
    clock at `start()`, wait and read it again at `stop()`. `results()` gives the seconds of
    every interval stopped since the last call, in order, and starts a new list.
    """

    def __init__(self, device: torch.device | str = "cpu", clock: Callable[[], float] = time.perf_counter) -> None:
        self.device = torch.device(device)
        self.clock = clock
        self._began = 0.0
        self._seconds: list[float] = []

    def start(self) -> None:
        """Begin an interval."""
        sync(self.device)
        self._began = self.clock()

    def stop(self) -> int:
        """End the interval begun last; its index in the next `results()`."""
        sync(self.device)
        self._seconds.append(self.clock() - self._began)
        return len(self._seconds) - 1

    def results(self) -> list[float]:
        """Seconds of the intervals stopped since the last call, in order (waits for the device once)."""
        seconds, self._seconds = self._seconds, []
        return seconds


class CudaTimer(Timer):
    """Intervals timed by CUDA event pairs on the current stream: no wait between intervals,
    one `synchronize` in `results()` (so a round of nodes runs back to back, as in training).
    """

    def __init__(self, device: torch.device | str) -> None:
        super().__init__(device)
        self._open: torch.cuda.Event | None = None
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def start(self) -> None:
        self._open = record_event(self.device)

    def stop(self) -> int:
        if self._open is None:
            raise RuntimeError("CudaTimer.stop() without start(); call start() before each interval")
        self._pairs.append((self._open, record_event(self.device)))
        self._open = None
        return len(self._pairs) - 1

    def results(self) -> list[float]:
        pairs, self._pairs = self._pairs, []
        if pairs:
            sync(self.device)
        return [elapsed_s(begin, end) for begin, end in pairs]


def timer_for(device: torch.device, clock: Clock = "wall") -> Timer:
    """The interval timer for `device`: CUDA events on a GPU, else the host clock `make_timer` gives.

    Raises:
        ValueError: a clock that cannot time `device` (see `make_timer`).
    """
    host = make_timer(device, clock)
    return CudaTimer(device) if uses_events(device) else Timer(device, host)


def materialize(gm: torch.fx.GraphModule, flat_inputs: list[Any]) -> dict[str, Any]:
    """Run `gm` once with autograd on and return every node's value, by node name."""
    interp = torch.fx.Interpreter(gm, garbage_collect_values=False)
    with torch.enable_grad():
        interp.run(*flat_inputs)
    return {node.name: value for node, value in interp.env.items()}


class Submodules(Protocol):
    """Where a node's module is found: the graph module, or the device copies of a chunk of it."""

    def get_submodule(self, target: str) -> torch.nn.Module: ...


def _is_inplace(node: torch.fx.Node, gm: Submodules) -> bool:
    """Whether `node` writes into an input: by its schema for an ATen op (torch.export's `aten.add_.Tensor`,
    whose name does not end in "_"), by its name or an `inplace` flag otherwise."""
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    if isinstance(node.target, torch._ops.OpOverload):
        return any(a.alias_info is not None and a.alias_info.is_write for a in node.target._schema.arguments)
    name = str(getattr(node.target, "__name__", node.target))
    return name in _INPLACE_OPERATORS or (name.endswith("_") and not name.startswith("_"))


def _callable(node: torch.fx.Node, gm: Submodules) -> Callable[..., Any]:
    if node.op == "call_module":
        return gm.get_submodule(str(node.target))
    if node.op == "call_method":
        method = str(node.target)
        return lambda self_, *a, **k: getattr(self_, method)(*a, **k)
    return node.target  # type: ignore[return-value]


def _tensors(value: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


class NodeRunner:
    """Runs one fx node on stored inputs and times its forward and its backward separately.

    Inputs that required grad in the real run become fresh leaves (cloned per run when the
    op writes in place), so the backward reaches exactly what it reaches in the graph.
    Parameter gradients start from none and accumulate as in a pipeline's steady state;
    `restore()` puts the caller's back. `modules` resolves a call_module node's target (the
    graph module, or device copies).
    `seen`: inputs as the node read them where `values` holds what a later in-place op made
    of them; `writes`: the node was seen writing into an input (whatever its name says).
    """

    def __init__(
        self,
        node: torch.fx.Node,
        modules: Submodules,
        values: Mapping[str, Any],
        device: torch.device,
        timer: Timer | None = None,
        *,
        seen: Mapping[str, Any] | None = None,
        writes: bool = False,
    ) -> None:
        self.device = device
        self.timer = timer if timer is not None else Timer(device)
        self.fn = _callable(node, modules)
        self.inplace = writes or _is_inplace(node, modules)
        params: list[torch.Tensor] = []
        if node.op == "call_module":
            params = [p for p in modules.get_submodule(str(node.target)).parameters() if p.requires_grad]
        self._saved_grads = [(p, p.grad) for p in params]
        for p in params:
            p.grad = None  # the runs' gradients accumulate in tensors of their own, not in the caller's
        self._leaves: list[torch.Tensor] = []

        def prepare(x: Any) -> Any:
            if not isinstance(x, torch.Tensor):
                return x
            if x.requires_grad and (x.is_floating_point() or x.is_complex()):
                leaf = x.detach().requires_grad_()
                self._leaves.append(leaf)
                return leaf
            return x.detach()

        def lookup(n: torch.fx.Node) -> Any:
            return seen[n.name] if seen is not None and n.name in seen else values[n.name]

        args = torch.fx.node.map_arg(node.args, lookup)
        kwargs = on_device(torch.fx.node.map_arg(node.kwargs, lookup), device)  # as a stage on `device` runs it
        self.args, self.kwargs = pytree.tree_map(prepare, (args, kwargs))
        out = values.get(node.name)
        self.needs_backward = bool(params or self._leaves) and any(
            t.requires_grad and t.is_floating_point() for t in _tensors(out)
        )
        self._grads: list[torch.Tensor] | None = None

    def _inputs(self) -> tuple[Any, Any]:
        for leaf in self._leaves:
            leaf.grad = None
        if not self.inplace:
            return self.args, self.kwargs
        args, kwargs = pytree.tree_map(
            lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (self.args, self.kwargs)
        )
        return args, kwargs

    def run_once(self) -> tuple[int, int | None]:
        """One forward and (when anything needs gradients) one backward, timed by `self.timer`.

        Returns the timer's interval indices (forward, backward or None); read the seconds
        from `timer.results()` after the round (on CUDA nothing waits until then).
        """
        args, kwargs = self._inputs()
        with torch.enable_grad():
            self.timer.start()
            out = self.fn(*args, **kwargs)
            forward = self.timer.stop()
        if not self.needs_backward:
            return forward, None
        outs = [t for t in _tensors(out) if t.requires_grad and t.grad_fn is not None]
        if not outs:
            return forward, None
        if self._grads is None:
            gen = torch.Generator(device=self.device).manual_seed(0)
            self._grads = [torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=gen) for t in outs]
        self.timer.start()
        torch.autograd.backward(outs, self._grads)
        return forward, self.timer.stop()

    def measure(self, warmup: int, repeats: int) -> tuple[float, float]:
        """Median forward and median backward seconds over `repeats` runs after `warmup` runs."""
        runs: list[tuple[float, float]] = []
        for round_ in range(warmup + repeats):
            forward, backward = self.run_once()
            seconds = self.timer.results()
            if round_ >= warmup:
                runs.append((seconds[forward], 0.0 if backward is None else seconds[backward]))
        return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)

    def restore(self) -> None:
        """Put the parameters' gradients back as they were before timing."""
        for p, grad in self._saved_grads:
            p.grad = grad
        for leaf in self._leaves:
            leaf.grad = None
