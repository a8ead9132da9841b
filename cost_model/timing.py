"""Timing helpers for the profiler: clocks, interval timers (host clocks on CPU, CUDA events
on a GPU), one graph node run alone (forward, then backward), the backward-call probe.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Literal, Protocol, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

__all__ = [
    "BackwardCallProbe", "Clock", "CudaTimer", "NodeRunner", "Rounds", "Submodules", "Timer", "is_out_of_memory",
    "make_timer", "materialize", "release_cached", "steady_host_allocator", "sync", "timer_for",
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


def sync(device: torch.device) -> None:
    """Wait for queued work on `device` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def start(self) -> None:
        self._open = self._event()

    def stop(self) -> int:
        if self._open is None:
            raise RuntimeError("CudaTimer.stop() without start(); call start() before each interval")
        self._pairs.append((self._open, self._event()))
        self._open = None
        return len(self._pairs) - 1

    def results(self) -> list[float]:
        pairs, self._pairs = self._pairs, []
        if pairs:
            torch.cuda.synchronize(self.device)
        return [begin.elapsed_time(end) / 1e3 for begin, end in pairs]


def timer_for(device: torch.device, clock: Clock = "wall") -> Timer:
    """The interval timer for `device`: CUDA events on a GPU, else the host clock `make_timer` gives.

    Raises:
        ValueError: a clock that cannot time `device` (see `make_timer`).
    """
    host = make_timer(device, clock)
    return CudaTimer(device) if device.type == "cuda" else Timer(device, host)


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
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
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
    Parameter gradients accumulate as in a pipeline's steady state; call `restore()` after.
    `modules` resolves a call_module node's target (the graph module, or device copies).
    """

    def __init__(
        self,
        node: torch.fx.Node,
        modules: Submodules,
        values: dict[str, Any],
        device: torch.device,
        timer: Timer | None = None,
    ) -> None:
        self.device = device
        self.timer = timer if timer is not None else Timer(device)
        self.fn = _callable(node, modules)
        self.inplace = _is_inplace(node, modules)
        params: list[torch.Tensor] = []
        if node.op == "call_module":
            params = [p for p in modules.get_submodule(str(node.target)).parameters() if p.requires_grad]
        self._saved_grads = [(p, p.grad) for p in params]
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
            return values[n.name]

        args = torch.fx.node.map_arg(node.args, lookup)
        kwargs = torch.fx.node.map_arg(node.kwargs, lookup)
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


class BackwardCallProbe:
    """Measures the fixed cost of one `autograd.backward` call, which an isolated node pays
    and a node inside a whole graph does not.

    With c the cost of one tiny backward node and E the call's own cost, one view takes
    E + c and a chain of k views E + k c, so E = t1 - (tk - t1) / (k - 1). The profiler
    subtracts E from every node's backward time; run it in the same rounds as the nodes so
    it sees the same load and caches.
    """

    def __init__(self, device: torch.device, chain: int = 9, timer: Timer | None = None) -> None:
        self.device = device
        self.timer = timer if timer is not None else Timer(device)
        self.chain = chain
        self.leaf = torch.zeros(4, device=device, requires_grad=True)
        self.grad = torch.ones(4, device=device)

    def _time(self, k: int) -> int:
        self.leaf.grad = None
        with torch.enable_grad():
            y = self.leaf
            for _ in range(k):
                y = y.view(4)
        self.timer.start()
        torch.autograd.backward([y], [self.grad])
        return self.timer.stop()

    def run_once(self) -> tuple[int, int]:
        """Time one view and a chain of views: the timer's interval indices, for `estimate`."""
        return self._time(1), self._time(self.chain)

    def estimate(self, seconds: list[float], spans: tuple[int, int]) -> float:
        """E in seconds from the timer's results and `run_once`'s indices (may be slightly negative under noise)."""
        one, many = seconds[spans[0]], seconds[spans[1]]
        return one - (many - one) / (self.chain - 1)


class Rounds:
    """Times groups of nodes in rounds (the whole graph, or chunk by chunk), collecting each
    node's runs and the backward-call cost (see `BackwardCallProbe`).

    Rounds rather than back-to-back repeats of one node: a burst of load from another
    process then spoils a few rounds of every node instead of all repeats of one node, and
    caches and the allocator see the same sequence of work as in training. On CUDA one
    round runs without a wait and synchronizes once at its end (`CudaTimer`).
    """

    def __init__(self, device: torch.device, warmup: int, repeats: int, timer: Timer, bar: Any) -> None:
        self.device, self.warmup, self.repeats, self.timer, self.bar = device, warmup, repeats, timer, bar
        self.probe = BackwardCallProbe(device, timer=timer)
        self.runs: dict[str, list[tuple[float, float]]] = {}
        self.call_costs: list[float] = []

    def time(self, modules: Submodules, nodes: Sequence[torch.fx.Node], values: dict[str, Any]) -> None:
        """Time `nodes` on `values` (inputs by node name, on the device), `modules` resolving their modules."""
        runners: list[NodeRunner] = []
        try:
            runners = [NodeRunner(node, modules, values, self.device, self.timer) for node in nodes]
            runs: list[list[tuple[float, float]]] = [[] for _ in runners]
            costs: list[float] = []
            for round_ in range(self.warmup + self.repeats):
                spans = [runner.run_once() for runner in runners]
                probe = self.probe.run_once()
                seconds = self.timer.results()
                if round_ >= self.warmup:
                    for run, (f, b) in zip(runs, spans):
                        run.append((seconds[f], 0.0 if b is None else seconds[b]))
                    costs.append(self.probe.estimate(seconds, probe))
                self.bar.update(len(runners))
        finally:
            self.timer.results()  # drop a failed round's intervals
            for runner in reversed(runners):
                runner.restore()
        self.runs.update((node.name, run) for node, run in zip(nodes, runs))
        self.call_costs += costs

    def times(self, nodes: Sequence[torch.fx.Node]) -> tuple[dict[str, float], dict[str, float]]:
        """Median forward and backward seconds of the timed nodes (backward less the call cost)."""
        call_cost = max(statistics.median(self.call_costs), 0.0) if self.call_costs else 0.0
        timed = [(n.name, self.runs[n.name]) for n in nodes if n.name in self.runs]
        forward = {name: statistics.median(r[0] for r in rs) for name, rs in timed}
        backward = {
            name: max(statistics.median(r[1] for r in rs) - call_cost, 0.0) if any(r[1] for r in rs) else 0.0
            for name, rs in timed
        }
        return forward, backward
