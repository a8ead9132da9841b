"""Timing graph nodes in rounds: each node alone on the values one real forward recorded, or, for a
node that cannot run alone, inside whole runs of the graph.

    record(gm, inputs, d)   one real forward: every node's value, each input as its node read it
                            (where a later in-place op changed it: a second run keeps copies), and
                            the nodes seen writing into an input (cloned inputs when run alone)
    Rounds.time(nodes)      round r: n0 fwd+bwd, n1 fwd+bwd, ..., probe   (r = warmup + repeats)
                            -> per-node runs; the nodes that raised alone, with their errors
    time_in_forward(nodes)  round r: whole forward (timer around each listed node), whole backward
                            (hooks on the autograd nodes the listed nodes made) -> their runs

The profiler times every node alone first (`Rounds.time`): exact forward and backward per node,
with the backward call's fixed cost measured and subtracted (`BackwardCallProbe`). A node that
raises alone (an input made up for it that the real forward never gives it) is timed inside
whole forwards instead, never an error to the user.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from cost_model.progress import Progress
from cost_model.timing import NodeRunner, Submodules, Timer, is_out_of_memory
from rules.device_args import on_device

__all__ = ["BackwardCallProbe", "Recorded", "Rounds", "record", "time_in_forward"]


def _tensors(value: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


def _copy(x: Any) -> Any:
    """A tensor's own copy, still flagged requires_grad as the original is (other values as they are)."""
    if not isinstance(x, torch.Tensor):
        return x
    copy = x.detach().clone()
    return copy.requires_grad_() if x.requires_grad else copy


def _version(t: torch.Tensor) -> int:
    """The tensor's in-place write counter (-1 where there is none: inference tensors)."""
    try:
        return int(t._version)
    except RuntimeError:
        return -1


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


@dataclass
class Recorded:
    """Node values from one real forward, as `NodeRunner` needs them: `values` by node name (after the
    whole run); `seen[node][input]`, an input as the node read it where a later in-place op changed
    it; `writes`, the nodes seen writing into an input."""

    values: Mapping[str, Any]
    seen: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    writes: frozenset[str] = frozenset()


class Rounds:
    """Times groups of nodes in rounds (the whole graph, or chunk by chunk), collecting each
    node's runs and the backward-call cost (see `BackwardCallProbe`).

    Rounds rather than back-to-back repeats of one node: a burst of load from another
    process then spoils a few rounds of every node instead of all repeats of one node, and
    caches and the allocator see the same sequence of work as in training. On CUDA one
    round runs without a wait and synchronizes once at its end (`CudaTimer`). `progress`
    counts nodes: a group of k nodes advances it by k over its rounds.
    """

    def __init__(self, device: torch.device, warmup: int, repeats: int, timer: Timer, progress: Progress) -> None:
        self.device, self.warmup, self.repeats, self.timer = device, warmup, repeats, timer
        self.progress = progress
        self.probe = BackwardCallProbe(device, timer=timer)
        self.runs: dict[str, list[tuple[float, float]]] = {}
        self.in_forward: set[str] = set()  # timed inside whole runs: no backward call of their own to subtract
        self.call_costs: list[float] = []

    def time(self, modules: Submodules, nodes: Sequence[torch.fx.Node], recorded: Recorded) -> dict[str, str]:
        """Time `nodes` on `recorded` values (on the device), `modules` resolving their modules.

        Returns the nodes that raised when run alone (not out of memory: that propagates), each
        with its error: they have no runs here (`time_in_forward` times them inside whole runs).
        """
        runners: list[NodeRunner] = []
        failed: dict[int, str] = {}
        try:
            runners = [
                NodeRunner(node, modules, recorded.values, self.device, self.timer, seen=recorded.seen.get(node.name),
                           writes=node.name in recorded.writes)
                for node in nodes
            ]  # fmt: skip
            runs: list[list[tuple[float, float]]] = [[] for _ in runners]
            costs: list[float] = []
            for round_ in range(self.warmup + self.repeats):
                spans = [self._run(i, runner, failed) for i, runner in enumerate(runners)]
                probe = self.probe.run_once()
                seconds = self.timer.results()
                if round_ >= self.warmup:
                    for run, span in zip(runs, spans):
                        if span is not None:
                            run.append((seconds[span[0]], 0.0 if span[1] is None else seconds[span[1]]))
                    costs.append(self.probe.estimate(seconds, probe))
                self.progress.advance(len(runners) / (self.warmup + self.repeats))
        finally:
            self.timer.results()  # drop a failed round's intervals
            for runner in reversed(runners):
                runner.restore()
        self.runs.update((node.name, run) for i, (node, run) in enumerate(zip(nodes, runs)) if i not in failed)
        self.call_costs += costs
        return {nodes[i].name: why for i, why in failed.items()}

    @staticmethod
    def _run(i: int, runner: NodeRunner, failed: dict[int, str]) -> tuple[int, int | None] | None:
        """One run of `runner` (the timer's interval indices), or None once it has raised (noted in `failed`)."""
        if i in failed:
            return None
        try:
            return runner.run_once()
        except Exception as exc:  # noqa: BLE001 - a node that cannot run alone is timed another way; OOM re-raised
            if is_out_of_memory(exc):
                raise
            failed[i] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            return None  # its gradients are put back with every runner's, after the rounds

    def times(self, nodes: Sequence[torch.fx.Node]) -> tuple[dict[str, float], dict[str, float]]:
        """Median forward and backward seconds of the timed nodes (backward less the call cost, for
        nodes timed alone)."""
        call_cost = max(statistics.median(self.call_costs), 0.0) if self.call_costs else 0.0
        timed = [(n.name, self.runs[n.name]) for n in nodes if n.name in self.runs]
        forward = {name: statistics.median(r[0] for r in rs) for name, rs in timed}
        backward = {
            name: max(statistics.median(r[1] for r in rs) - (0.0 if name in self.in_forward else call_cost), 0.0)
            if any(r[1] for r in rs) else 0.0
            for name, rs in timed
        }  # fmt: skip
        return forward, backward


class _OnDevice(torch.fx.Interpreter):
    """Runs a graph on `device`: a node's `device=` argument (the device it was traced on) is read as `device`."""

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device, garbage_collect_values: bool = True) -> None:
        super().__init__(gm, garbage_collect_values=garbage_collect_values)
        self.device = device

    def fetch_args_kwargs_from_env(self, n: torch.fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        return args, on_device(kwargs, self.device)


class _Recorder(_OnDevice):
    """One run of the graph that notes which inputs each node saw change, and copies the inputs of `keep` nodes."""

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device, keep: frozenset[str]) -> None:
        super().__init__(gm, device, garbage_collect_values=False)
        self.keep = keep
        self.seen: dict[str, dict[str, Any]] = {}
        self.writes: set[str] = set()
        self._after: dict[str, list[tuple[torch.Tensor, int]]] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        inputs = {i.name: self.env[i] for i in n.all_input_nodes}
        if n.name in self.keep:
            self.seen[n.name] = {name: pytree.tree_map(_copy, v) for name, v in inputs.items()}
        tensors = [t for v in inputs.values() for t in _tensors(v)]
        before = [_version(t) for t in tensors]
        out = super().run_node(n)
        after = [_version(t) for t in tensors]
        if after != before:
            self.writes.add(n.name)
        self._after[n.name] = list(zip(tensors, after))
        return out

    def stale(self) -> frozenset[str]:
        """Nodes an input of which a later node changed in place (their recorded inputs are not what they read)."""
        return frozenset(name for name, pairs in self._after.items() if any(_version(t) != v for t, v in pairs))

    def values(self) -> dict[str, Any]:
        return {node.name: value for node, value in self.env.items()}


def record(gm: torch.fx.GraphModule, flat_inputs: Sequence[Any], device: torch.device) -> Recorded:
    """Every node's value from one real forward of `gm` on `device` (where its weights and `flat_inputs`
    are; autograd on), as `Rounds.time` needs them.

    The graph runs on copies of `flat_inputs` (an in-place op on an input leaves the caller's
    as it was). Where a node reads a value that a later node changes in place (`b = zeros(n);
    e = emb(b); b += k`), the value after the run is not what it read: a second run keeps a
    copy of such nodes' inputs as they read them (`Recorded.seen`).
    """
    first = _Recorder(gm, device, frozenset())
    with torch.enable_grad():
        first.run(*[pytree.tree_map(_copy, x) for x in flat_inputs])
    stale = first.stale()
    if not stale:
        return Recorded(first.values(), {}, frozenset(first.writes))
    second = _Recorder(gm, device, stale)
    with torch.enable_grad():
        second.run(*[pytree.tree_map(_copy, x) for x in flat_inputs])
    return Recorded(second.values(), second.seen, frozenset(second.writes))


class _TimedRun(_OnDevice):
    """One whole forward that times the `names` nodes: forward around the node, backward by hooks
    on the autograd nodes it made (not those it was given: a node returning its input times nothing)."""

    def __init__(self, gm: torch.fx.GraphModule, names: frozenset[str], timer: Timer) -> None:
        super().__init__(gm, timer.device)
        self.names, self.timer = names, timer
        self.forward: dict[str, int] = {}
        self.backward: dict[str, list[int]] = {name: [] for name in names}
        self.hooked = False

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.name not in self.names:
            return super().run_node(n)
        # Held, not just their ids: an autograd node's Python object lives only while referenced,
        # and a new one (perhaps at the same address) stands for it at the next access.
        given = [t.grad_fn for i in n.all_input_nodes for t in _tensors(self.env[i]) if t.grad_fn is not None]
        self.timer.start()
        out = super().run_node(n)
        self.forward[n.name] = self.timer.stop()
        made: list[Any] = []
        for fn in (t.grad_fn for t in _tensors(out) if t.grad_fn is not None):
            if not any(fn is seen for seen in given + made):
                made.append(fn)
        for fn in made:
            fn.register_prehook(lambda grads: self.timer.start())
            fn.register_hook(lambda grads_in, grads_out, name=n.name: self.backward[name].append(self.timer.stop()))
            self.hooked = True
        return out


def time_in_forward(
    rounds: Rounds, gm: torch.fx.GraphModule, flat_inputs: Sequence[Any], nodes: Sequence[torch.fx.Node]
) -> None:
    """Time `nodes` inside whole runs of `gm` on `flat_inputs` (on the device), in `rounds`' rounds.

    Forward: the timer around the node in a real forward. Backward: the autograd nodes the
    node made, timed by hooks in the real backward from the graph's outputs (exact for one
    op; for a module, the last op's backward). Parameter gradients are put back after.
    """
    names = frozenset(n.name for n in nodes)
    saved = [(p, p.grad) for p in gm.parameters()]
    for p, _ in saved:
        p.grad = None  # the runs' gradients accumulate in tensors of their own, not in the caller's
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    total = rounds.warmup + rounds.repeats
    try:
        for round_ in range(total):
            run = _TimedRun(gm, names, rounds.timer)
            with torch.enable_grad():
                out = run.run(*[pytree.tree_map(_copy, x) for x in flat_inputs])
                outs = [t for t in _tensors(out) if t.requires_grad and t.grad_fn is not None]
                if outs and run.hooked:
                    gen = torch.Generator(device=rounds.device).manual_seed(0)
                    grads = [torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=gen) for t in outs]
                    torch.autograd.backward(outs, grads)
            seconds = rounds.timer.results()
            if round_ >= rounds.warmup:
                for name in names:
                    runs[name].append((seconds[run.forward[name]], sum(seconds[i] for i in run.backward[name])))
            rounds.progress.advance(len(nodes) / total)
            del run, out, outs
    finally:
        rounds.timer.results()  # drop a failed round's intervals
        for p, grad in saved:
            p.grad = grad
    rounds.runs.update(runs)
    rounds.in_forward |= names
