"""Profiled cost model: time every graph node on the real device, cached on disk.

Each compute node of the fx graph runs alone on the inputs it sees in a real forward pass:
forward and backward timed separately, warm-up runs first, the median of several repeats
kept. Results are keyed by the graph, its parameter and input shapes and dtypes, the
device's name, the torch version, the thread count and the clock, and stored as JSON
under `cache_dir()`; a second run with the same key reads the file and measures nothing.

Two corrections keep the sum of isolated nodes equal to the whole graph's time (see
`_measure`): nodes run in rounds, and the fixed cost of one `autograd.backward` call, which
an isolated node pays and a node inside the graph does not, is measured and subtracted.
"""

from __future__ import annotations

import copy
import platform
import statistics
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from cost_model.cache import cache_dir as default_cache_dir, cache_key, read_json, write_json
from cost_model.devices import device_index, device_present
from cost_model.interface import CostModel
from cost_model.timing import BackwardCallProbe, Clock, NodeRunner, make_timer, materialize

__all__ = ["Profile", "ProfiledCostModel", "graph_fingerprint", "profile_graph"]

_COMPUTE_OPS = ("call_function", "call_method", "call_module")
_NO_WORK = {"_guards_fn"}


@dataclass
class Profile:
    """Measured seconds per node name on one device (one micro-batch)."""

    device: str
    forward: dict[str, float]
    backward: dict[str, float]
    key: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    from_cache: bool = False

    def node_time(self, name: str) -> float:
        """Forward plus backward seconds of node `name` (0 for nodes that do no work)."""
        return self.forward.get(name, 0.0) + self.backward.get(name, 0.0)

    def total(self) -> float:
        """Forward plus backward seconds of the whole graph, as the sum of its nodes."""
        return sum(self.forward.values()) + sum(self.backward.values())

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("from_cache")
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        return cls(
            device=str(data["device"]),
            forward={k: float(v) for k, v in data["forward"].items()},
            backward={k: float(v) for k, v in data["backward"].items()},
            key=str(data.get("key", "")),
            meta=dict(data.get("meta", {})),
        )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        model = ""
        try:
            with open("/proc/cpuinfo") as f:
                model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
        except OSError:
            pass
        return f"cpu:{model or platform.processor() or platform.machine()}"
    return str(device)


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return [list(value.shape), str(value.dtype)]
    return repr(value) if not isinstance(value, (int, float, bool, str, type(None))) else value


def graph_fingerprint(gm: torch.fx.GraphModule) -> list[Any]:
    """What makes two graphs time the same: code, leaf modules, parameter shapes and dtypes."""
    modules = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_module"})
    tensors = [(name, list(t.shape), str(t.dtype)) for name, t in gm.state_dict(keep_vars=True).items()]
    return [gm.code, [(m, repr(gm.get_submodule(m))) for m in modules], tensors]


def _on_device(
    gm: torch.fx.GraphModule, flat_inputs: Sequence[Any], device: torch.device
) -> tuple[torch.fx.GraphModule, list[Any]]:
    """The graph and inputs on `device`: the graph itself when its weights are already there."""
    tensors = list(gm.parameters()) + list(gm.buffers())
    if any(t.device != device for t in tensors):
        gm = copy.deepcopy(gm).to(device)
    moved = pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, list(flat_inputs))
    return gm, moved


def profile_graph(
    gm: torch.fx.GraphModule,
    flat_inputs: Sequence[Any],
    device: torch.device | str = "cpu",
    *,
    warmup: int = 2,
    repeats: int = 5,
    cache: bool = True,
    cache_dir: str | None = None,
    progress: bool = True,
    clock: Clock = "wall",
) -> Profile:
    """Time every compute node of `gm` on `device`, or read the result from the disk cache.

    Args:
        gm: the traced graph; node names key the result.
        flat_inputs: one value per placeholder, in graph order (one micro-batch).
        device: where to run; the graph is copied there when its weights live elsewhere.
        warmup, repeats: untimed runs, then timed runs whose median is kept.
        cache: read and write the disk cache (folder: `cache_dir`, else $PARTITIONER_CACHE_DIR,
            else ~/.cache/partitioner).
        progress: show a progress bar on stderr while measuring.
        clock: "wall" time, or "cpu" time of this thread (CPU with one torch thread only;
            steady on a machine shared with other processes). See `timing.make_timer`.

    Raises:
        ValueError: warmup < 0, repeats < 1, a device that is not present here, or a clock
            that cannot time it.
    """
    device = torch.device(device)
    if device.type == "cuda" and device_index(device) is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if warmup < 0 or repeats < 1:
        raise ValueError(f"warmup={warmup}, repeats={repeats}: use warmup >= 0 and repeats >= 1")
    if not device_present(device):
        raise ValueError(
            f"cannot profile on {device}: it is not present here; use AnalyticCostModel for absent devices"
        )
    timer = make_timer(device, clock)
    inputs = [_describe(x) for x in pytree.tree_leaves(list(flat_inputs))]
    key = cache_key(
        "profile-v2", graph_fingerprint(gm), inputs, _device_name(device), torch.__version__, torch.get_num_threads(),
        clock,
    )
    path = default_cache_dir(cache_dir) / "profiles" / f"{key}.json"
    if cache:
        data = read_json(path)
        if data is not None and data.get("key") == key:
            profile = Profile.from_dict(data)
            profile.from_cache = True
            return profile

    forward, backward = _measure(gm, flat_inputs, device, warmup, repeats, progress, timer)
    profile = Profile(
        device=str(device),
        forward=forward,
        backward=backward,
        key=key,
        meta={"device_name": _device_name(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "clock": clock},
    )
    if cache:
        write_json(path, profile.to_dict())
    return profile


def _measure(
    gm: torch.fx.GraphModule,
    flat_inputs: Sequence[Any],
    device: torch.device,
    warmup: int,
    repeats: int,
    progress: bool,
    timer: Callable[[], float],
) -> tuple[dict[str, float], dict[str, float]]:
    """Rounds of one forward + backward per node, in graph order; the median over rounds.

    Rounds rather than back-to-back repeats of one node: a burst of load from another
    process then spoils a few rounds of every node instead of all repeats of one node, and
    caches and the allocator see the same sequence of work as in training.
    """
    from tqdm.auto import tqdm

    gm, inputs = _on_device(gm, flat_inputs, device)
    buffers = {name: b.detach().clone() for name, b in gm.named_buffers()}
    runners: list[NodeRunner] = []
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            values = materialize(gm, inputs)
            nodes = [n for n in gm.graph.nodes if n.op in _COMPUTE_OPS and n.target not in _NO_WORK]
            runners = [NodeRunner(node, gm, values, device, timer) for node in nodes]
            del values
            probe = BackwardCallProbe(device, timer=timer)
            call_costs: list[float] = []
            runs: list[list[tuple[float, float]]] = [[] for _ in runners]
            bar = tqdm(total=(warmup + repeats) * len(runners), desc=f"profiling on {device}", unit="node",
                       disable=not progress, leave=False)
            with bar:
                for round_ in range(warmup + repeats):
                    for i, runner in enumerate(runners):
                        result = runner.run_once()
                        if round_ >= warmup:
                            runs[i].append(result)
                    call_cost = probe.run_once()
                    if round_ >= warmup:
                        call_costs.append(call_cost)
                    bar.update(len(runners))
    finally:
        for runner in reversed(runners):
            runner.restore()
        with torch.no_grad():
            for name, b in gm.named_buffers():
                b.copy_(buffers[name])
    call_cost = max(statistics.median(call_costs), 0.0) if call_costs else 0.0
    forward = {n.name: statistics.median(r[0] for r in rs) for n, rs in zip(nodes, runs)}
    backward = {
        n.name: max(statistics.median(r[1] for r in rs) - call_cost, 0.0) if any(r[1] for r in rs) else 0.0
        for n, rs in zip(nodes, runs)
    }
    return forward, backward


class ProfiledCostModel:
    """Node times measured on the device itself; `fallback` (analytic) for absent devices.

    Give the traced graph and one micro-batch of flat inputs here or later with `prepare`
    (the planner's front door calls it). Profiles are taken lazily, once per device.
    """

    def __init__(
        self,
        graph_module: torch.fx.GraphModule | None = None,
        flat_inputs: Sequence[Any] | None = None,
        *,
        fallback: CostModel | None = None,
        warmup: int = 2,
        repeats: int = 5,
        cache: bool = True,
        cache_dir: str | None = None,
        progress: bool = True,
        clock: Clock = "wall",
        present: Callable[[torch.device], bool] = device_present,
    ) -> None:
        if fallback is None:
            from cost_model.analytic import AnalyticCostModel

            fallback = AnalyticCostModel()
        self.fallback = fallback
        self._options: dict[str, Any] = {
            "warmup": warmup, "repeats": repeats, "cache": cache, "cache_dir": cache_dir, "progress": progress,
            "clock": clock,
        }
        self._present = present
        self._gm: torch.fx.GraphModule | None = None
        self._inputs: list[Any] = []
        self._profiles: dict[torch.device, Profile] = {}
        self._warned = False
        if graph_module is not None:
            self.prepare(graph_module, flat_inputs if flat_inputs is not None else [])

    def prepare(self, graph_module: torch.fx.GraphModule, flat_inputs: Sequence[Any]) -> None:
        """Set the graph to profile and one micro-batch of its flat inputs; forgets old profiles."""
        self._gm = graph_module
        self._inputs = list(flat_inputs)
        self._profiles.clear()

    def profile(self, device: torch.device) -> Profile:
        """The profile on `device`, measured (or read from the cache) on first use.

        Raises:
            RuntimeError: no graph yet; call `prepare(graph_module, flat_inputs)` first.
        """
        device = torch.device(device)
        if device not in self._profiles:
            if self._gm is None:
                raise RuntimeError(
                    "ProfiledCostModel has no graph to profile; pass graph_module and flat_inputs, "
                    "or call prepare(graph_module, flat_inputs) before planning"
                )
            same = next((p for d, p in self._profiles.items() if _device_name(d) == _device_name(device)), None)
            # Identical devices (eight of one GPU model) share one profile.
            self._profiles[device] = same or profile_graph(self._gm, self._inputs, device, **self._options)
        return self._profiles[device]

    def _profiled(self, node: Mapping[str, Any], device: torch.device) -> Profile | None:
        if self._gm is None or not self._present(device):
            return None
        profile = self.profile(device)
        name = node.get("name")
        if name in profile.forward:
            return profile
        if name not in _NO_WORK and not self._warned:
            self._warned = True
            warnings.warn(
                f"node {name!r} is not in the profiled graph, so the fallback model times it; "
                "pass prepare() the same traced graph the planner plans",
                stacklevel=3,
            )
        return None

    def node_time(self, node: Mapping[str, Any], device: torch.device) -> float:
        if node.get("op") not in _COMPUTE_OPS:
            return 0.0
        profile = self._profiled(node, device)
        if profile is None:
            return self.fallback.node_time(node, device)
        return profile.node_time(str(node["name"]))

    def forward_time(self, node: Mapping[str, Any], device: torch.device) -> float:
        """Forward part of `node_time`."""
        if node.get("op") not in _COMPUTE_OPS:
            return 0.0
        profile = self._profiled(node, device)
        if profile is None:
            from cost_model.interface import forward_time

            return forward_time(self.fallback, node, device)
        return profile.forward.get(str(node["name"]), 0.0)

    def transfer_time(self, nbytes: float, src: torch.device, dst: torch.device) -> float:
        return self.fallback.transfer_time(nbytes, src, dst)

    def allreduce_time(self, nbytes: float, devices: Sequence[torch.device]) -> float:
        """Ring all-reduce time, from the fallback model's links."""
        method = getattr(self.fallback, "allreduce_time", None)
        return float(method(nbytes, devices)) if callable(method) else 0.0
