"""Timing helpers for the profiler: clocks, one graph node run alone (forward, then backward),
the backward-call probe.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Literal

import torch
import torch.fx
import torch.utils._pytree as pytree

__all__ = ["BackwardCallProbe", "Clock", "NodeRunner", "make_timer", "materialize", "steady_host_allocator", "sync"]

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


def materialize(gm: torch.fx.GraphModule, flat_inputs: list[Any]) -> dict[str, Any]:
    """Run `gm` once with autograd on and return every node's value, by node name."""
    interp = torch.fx.Interpreter(gm, garbage_collect_values=False)
    with torch.enable_grad():
        interp.run(*flat_inputs)
    return {node.name: value for node, value in interp.env.items()}


def _is_inplace(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    name = str(getattr(node.target, "__name__", node.target))
    return name in _INPLACE_OPERATORS or (name.endswith("_") and not name.startswith("_"))


def _callable(node: torch.fx.Node, gm: torch.fx.GraphModule) -> Callable[..., Any]:
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
    """

    def __init__(
        self,
        node: torch.fx.Node,
        gm: torch.fx.GraphModule,
        values: dict[str, Any],
        device: torch.device,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.device = device
        self.timer = timer
        self.fn = _callable(node, gm)
        self.inplace = _is_inplace(node, gm)
        params: list[torch.Tensor] = []
        if node.op == "call_module":
            params = [p for p in gm.get_submodule(str(node.target)).parameters() if p.requires_grad]
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

    def run_once(self) -> tuple[float, float]:
        """One forward and (when anything needs gradients) one backward: (seconds, seconds)."""
        args, kwargs = self._inputs()
        sync(self.device)
        with torch.enable_grad():
            start = self.timer()
            out = self.fn(*args, **kwargs)
            sync(self.device)
            forward = self.timer() - start
        if not self.needs_backward:
            return forward, 0.0
        outs = [t for t in _tensors(out) if t.requires_grad and t.grad_fn is not None]
        if not outs:
            return forward, 0.0
        if self._grads is None:
            gen = torch.Generator(device=self.device).manual_seed(0)
            self._grads = [torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=gen) for t in outs]
        start = self.timer()
        torch.autograd.backward(outs, self._grads)
        sync(self.device)
        return forward, self.timer() - start

    def measure(self, warmup: int, repeats: int) -> tuple[float, float]:
        """Median forward and median backward seconds over `repeats` runs after `warmup` runs."""
        for _ in range(warmup):
            self.run_once()
        runs = [self.run_once() for _ in range(repeats)]
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

    def __init__(self, device: torch.device, chain: int = 9, timer: Callable[[], float] = time.perf_counter) -> None:
        self.device = device
        self.timer = timer
        self.chain = chain
        self.leaf = torch.zeros(4, device=device, requires_grad=True)
        self.grad = torch.ones(4, device=device)

    def _time(self, k: int) -> float:
        self.leaf.grad = None
        with torch.enable_grad():
            y = self.leaf
            for _ in range(k):
                y = y.view(4)
        sync(self.device)
        start = self.timer()
        torch.autograd.backward([y], [self.grad])
        sync(self.device)
        return self.timer() - start

    def run_once(self) -> float:
        """One estimate of E in seconds (may be slightly negative under noise)."""
        one = self._time(1)
        many = self._time(self.chain)
        return one - (many - one) / (self.chain - 1)
