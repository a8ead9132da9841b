"""Profiled cost model: time every graph node on the real device, cached on disk.

Each compute node of the fx graph runs alone on the inputs it sees in a real forward pass:
forward and backward timed separately, warm-up runs first, the median of several repeats
kept. Results are keyed by the graph, its parameter and input shapes and dtypes, the
device's name, the torch version, the thread count and the clock, and stored as JSON
under `cache_dir()`; a second run with the same key reads the file and measures nothing.

Two corrections keep the sum of isolated nodes equal to the whole graph's time (see
`timing.Rounds`): nodes run in rounds, and the fixed cost of one `autograd.backward` call,
which an isolated node pays and a node inside the graph does not, is measured and subtracted.

On CUDA, CUDA events time each node and a round waits for the device once. A model whose
weights do not fit the device is profiled chunk by chunk (`cost_model.chunks`); nodes that
still do not fit are left to the fallback model, and the log says so.
"""

from __future__ import annotations

import copy
import itertools
import logging
import platform
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from cost_model.analytic import AnalyticCostModel
from cost_model.cache import cache_dir as default_cache_dir, cache_key, read_json, write_json
from cost_model.chunks import default_budget, measure_chunks, model_bytes
from cost_model.devices import device_index, device_present
from cost_model.interface import CostModel, forward_time
from cost_model.progress import phase, say
from cost_model.rounds import Rounds, record, time_in_forward
from cost_model.timing import Clock, Timer, is_out_of_memory, release_cached, timer_for

__all__ = ["Profile", "ProfiledCostModel", "graph_fingerprint", "profile_graph"]

log = logging.getLogger(__name__)

_COMPUTE_OPS = ("call_function", "call_method", "call_module")
_NO_WORK = {"_guards_fn"}


@dataclass
class Profile:
    """Measured seconds per node name on one device (one micro-batch).

    `unmeasured`: compute nodes the device could not hold (out of memory, or one node alone
    over the memory budget); they have no entry here and the cost model's fallback times them.
    """

    device: str
    forward: dict[str, float]
    backward: dict[str, float]
    key: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    unmeasured: list[str] = field(default_factory=list)
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
            unmeasured=[str(n) for n in data.get("unmeasured", [])],
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
    memory_budget_bytes: int | None = None,
) -> Profile:
    """Time every compute node of `gm` on `device`, or read the result from the disk cache.

    Args:
        gm: the traced graph; node names key the result.
        flat_inputs: one value per placeholder, in graph order (one micro-batch).
        device: where to run; the graph is copied there (whole, or chunk by chunk) when its
            weights live elsewhere. `gm` itself is left where it is, with the same values.
        warmup, repeats: untimed runs, then timed runs whose median is kept.
        cache: read and write the disk cache (folder: `cache_dir`, else $PARTITIONER_CACHE_DIR,
            else ~/.cache/partitioner).
        progress: show a progress bar on stderr while measuring.
        clock: "wall" time, or "cpu" time of this thread (CPU with one torch thread only;
            steady on a machine shared with other processes). See `timing.make_timer`. On CUDA
            nodes are timed by CUDA events.
        memory_budget_bytes: what the device may hold at once. Models over it are profiled in
            chunks of nodes (`cost_model.chunks`); a node alone over it is not timed (see
            `Profile.unmeasured`). Default: on CUDA the free memory less a margin, elsewhere
            no limit. Chunking never changes the result's key or its nodes.

    Raises:
        ValueError: warmup < 0, repeats < 1, a negative budget, a device that is not present
            here, or a clock that cannot time it.
    """
    device = torch.device(device)
    if device.type == "cuda" and device_index(device) is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if warmup < 0 or repeats < 1:
        raise ValueError(f"warmup={warmup}, repeats={repeats}: use warmup >= 0 and repeats >= 1")
    if memory_budget_bytes is not None and memory_budget_bytes < 0:
        raise ValueError(f"memory_budget_bytes={memory_budget_bytes}: use a number of bytes >= 0, or None")
    if not device_present(device):
        raise ValueError(
            f"cannot profile on {device}: it is not present here; use AnalyticCostModel for absent devices"
        )
    timer = timer_for(device, clock)
    inputs = [_describe(x) for x in pytree.tree_leaves(list(flat_inputs))]
    # CUDA events time differently from the host clocks profiles on CUDA were once taken with.
    method = "cuda-events" if device.type == "cuda" else clock
    key = cache_key(
        "profile-v2", graph_fingerprint(gm), inputs, _device_name(device), torch.__version__, torch.get_num_threads(),
        method,
    )
    path = default_cache_dir(cache_dir) / "profiles" / f"{key}.json"
    if cache:
        data = read_json(path)
        if data is not None and data.get("key") == key:
            profile = Profile.from_dict(data)
            profile.from_cache = True
            say(f"profiling on {device}: {len(profile.forward)} nodes read from the cache ({path})")
            return profile

    # An explicit budget bounds what the device holds, so chunks from the start; by default the
    # whole graph goes at once when its weights fit, and chunk by chunk otherwise or after running out.
    budget = memory_budget_bytes if memory_budget_bytes is not None else default_budget(gm, device)
    whole = memory_budget_bytes is None and (budget is None or model_bytes(gm) <= budget)
    forward, backward, unmeasured, inside = _measure(
        gm, flat_inputs, device, warmup, repeats, progress, timer, budget, whole
    )
    profile = Profile(
        device=str(device),
        forward=forward,
        backward=backward,
        key=key,
        meta={"device_name": _device_name(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "clock": clock, **({"timed_in_forward": inside} if inside else {})},
        unmeasured=unmeasured,
    )
    if cache and not unmeasured:  # a partial profile may be complete next time (more free memory)
        write_json(path, profile.to_dict())
    return profile


def _measure(
    gm: torch.fx.GraphModule,
    flat_inputs: Sequence[Any],
    device: torch.device,
    warmup: int,
    repeats: int,
    progress: bool,
    timer: Timer,
    budget: int | None,
    whole: bool,
) -> tuple[dict[str, float], dict[str, float], list[str], list[str]]:
    """Forward and backward seconds per node, the nodes not timed and the nodes timed inside whole
    forwards: the `whole` graph on the device at once, or (also when that runs out of memory)
    chunk by chunk within `budget`."""
    nodes = [n for n in gm.graph.nodes if n.op in _COMPUTE_OPS and n.target not in _NO_WORK]
    buffers = {name: b.detach().clone() for name, b in gm.named_buffers()}
    home = next((t.device for t in itertools.chain(gm.parameters(), gm.buffers())), device)
    skipped: dict[str, str] = {}  # node name -> why it was not timed
    what = f"profiling {len(nodes)} nodes on {device} ({warmup + repeats} runs each)"
    try:
        with phase(what, total=len(nodes), bar=progress) as bar, torch.random.fork_rng(
            devices=sorted({d for d in (device, home) if d.type == "cuda"}, key=str)
        ):
            rounds = Rounds(device, warmup, repeats, timer, bar)
            if whole:
                try:
                    skipped = _measure_whole(gm, flat_inputs, device, nodes, rounds)
                except Exception as exc:  # noqa: BLE001 - only out-of-memory is handled; the rest re-raised
                    if not is_out_of_memory(exc):
                        raise
                    log.info("profiling the whole graph on %s ran out of memory; profiling it chunk by chunk", device)
                    whole = False
            if not whole:
                release_cached(device)  # after the except block: the failed attempt's copies are gone
                bar.reset()
                rounds = Rounds(device, warmup, repeats, timer, bar)
                skipped = measure_chunks(gm, flat_inputs, device, home, nodes, budget, rounds)
    finally:
        with torch.no_grad():
            for name, b in gm.named_buffers():
                b.copy_(buffers[name])
    if skipped:
        names = list(skipped)
        log.warning(
            "profiling on %s timed %d of %d nodes; the fallback cost model times the other %d (%s): %s%s",
            device, len(nodes) - len(skipped), len(nodes), len(skipped), "; ".join(sorted(set(skipped.values()))),
            ", ".join(names[:10]), ", ..." if len(names) > 10 else "",
        )
    forward, backward = rounds.times(nodes)
    inside = [n.name for n in nodes if n.name in rounds.in_forward]
    return forward, backward, [n.name for n in nodes if n.name in skipped], inside


def _measure_whole(
    gm: torch.fx.GraphModule, flat_inputs: Sequence[Any], device: torch.device, nodes: list[torch.fx.Node],
    rounds: Rounds,
) -> dict[str, str]:
    """The whole graph on `device` at once (a copy when its weights live elsewhere): every node alone,
    then the nodes that cannot run alone inside whole forwards. Returns the nodes not timed, with why."""
    whole, inputs = _on_device(gm, flat_inputs, device)
    failed = rounds.time(whole, nodes, record(whole, inputs, device))
    if not failed:
        return {}
    alone = "; ".join(f"{name}: {why}" for name, why in itertools.islice(failed.items(), 3))
    log.info("profiling on %s: %d nodes cannot run alone on the values the example gave them (%s%s); timing them "
             "inside whole forwards of the example", device, len(failed), alone, "; ..." if len(failed) > 3 else "")
    try:
        time_in_forward(rounds, whole, inputs, [n for n in nodes if n.name in failed])
    except Exception as exc:  # noqa: BLE001 - never an error to the user: the fallback prices them; OOM re-raised
        if is_out_of_memory(exc):
            raise
        return {name: f"it cannot run alone ({why}) nor be timed in a whole forward ({type(exc).__name__}: {exc})"
                for name, why in failed.items()}  # fmt: skip
    return {}


class ProfiledCostModel:
    """Node times measured on the device itself; `fallback` (analytic) for absent devices and
    for nodes the device could not hold (`Profile.unmeasured`, said in the log).

    Give the traced graph and one micro-batch of flat inputs here or later with `prepare`
    (the planner's front door calls it). Profiles are taken lazily, once per device; the
    options are `profile_graph`'s.
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
        memory_budget_bytes: int | None = None,
    ) -> None:
        self.fallback = fallback if fallback is not None else AnalyticCostModel()
        self._options: dict[str, Any] = {
            "warmup": warmup, "repeats": repeats, "cache": cache, "cache_dir": cache_dir, "progress": progress,
            "clock": clock, "memory_budget_bytes": memory_budget_bytes,
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
        prepare = getattr(self.fallback, "prepare", None)
        if callable(prepare):  # the fallback prices absent devices from the same graph (module kinds, autocast)
            prepare(graph_module, flat_inputs)

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
        if name in profile.unmeasured:  # out of memory: profile_graph logged it
            return None
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
            return forward_time(self.fallback, node, device)
        return profile.forward.get(str(node["name"]), 0.0)

    def transfer_time(self, nbytes: float, src: torch.device, dst: torch.device) -> float:
        return self.fallback.transfer_time(nbytes, src, dst)

    def allreduce_time(self, nbytes: float, devices: Sequence[torch.device]) -> float:
        """Ring all-reduce time, from the fallback model's links."""
        method = getattr(self.fallback, "allreduce_time", None)
        return float(method(nbytes, devices)) if callable(method) else 0.0
