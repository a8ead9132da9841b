"""The Plan: plain data saying which graph nodes run on which device, and what that should cost.

The planner writes it, the runtime reads it, the visualizer draws it. It holds names and
numbers only (no tensors, no modules), so it can be saved, edited by hand and loaded back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Mapping, Sequence, get_args

from rules.kernels import KERNEL_SETS, KernelSet
from rules.schedules import schedule_names
from rules.sharding import GradientSync, ShardingMode
from runtime.ops import Op, Program
from runtime.plan_axes import axis_problems, rank_problems
from runtime.program_check import program_problems
from runtime.tensor_parallel_spec import TensorParallelGroup

__all__ = ["DATA_SPLITS", "RECOMPUTE_MODES", "UPDATES", "DataSplit", "Placement", "Plan", "RecomputeMode", "Schedule",
           "StagePlan", "Update", "human_bytes", "micro_batch_words"]

# A schedule's name: a built-in ("gpipe", "1f1b", "interleaved", "zb1", "zbv", "dualpipev") or one
# registered later (rules.schedules.register), so a string, not a closed Literal; `Plan.check` checks
# it against the registry when a plan is made or loaded.
Schedule = str
Placement = Literal["pipeline", "branches", "hybrid"]
SCHEDULES: tuple[str, ...] = schedule_names()  # the built-ins; schedule_names() also has those registered later
PLACEMENTS: tuple[str, ...] = get_args(Placement)
# What a stage keeps for backward (runtime.recompute): everything autograd saves ("none"), matmul and
# convolution outputs ("selective"), or only its inputs ("full"); the rest runs again in backward.
RecomputeMode = Literal["none", "selective", "full"]
RECOMPUTE_MODES: tuple[str, ...] = get_args(RecomputeMode)
# How weights update (runtime.versions): after each whole step ("sync", the caller steps the optimizer), or
# with no pipeline flush: PipeDream-2BW ("2bw", two weight versions, gradients applied one step late) or
# PipeDream's weight stashing ("stash", an update per micro-batch, each backward on its forward's weights).
Update = Literal["sync", "2bw", "stash"]
UPDATES: tuple[str, ...] = get_args(Update)
DataSplit = Literal["deal", "slice"]
DATA_SPLITS: tuple[str, ...] = get_args(DataSplit)


@dataclass
class StagePlan:
    """One pipeline stage: a run of graph nodes (topological order) on one device.

    `ranks` are the programs running a replica of the stage each: process ranks under
    torchrun, worker slots in one process (micro-batch i runs on ranks[i % len(ranks)]; with
    the plan's `data_split="slice"`, every replica runs every micro-batch, each on its slice).
    `reads_from` are the stages whose values it reads (a chain: the one before it).

    Inside a replica ([Note: ranks of a split stage] in runtime/plan_axes.py): `tensor` ranks run each replica, its
    layers split by `tensor_groups` (runtime.tensor_parallel); `sharding` says how FSDP2 shards its
    weights, gradients and optimizer state over its replicas (rules.sharding; "none": whole on each).
    `expert`: the experts of each layer in `expert_layers` split over that many of its replicas, tokens
    dispatched to them and back by all-to-all (runtime.expert_parallel); `context`: each replica's
    sequence split over that many ranks, attention over all-gathered keys and values
    (runtime.context_parallel) for the causal attentions of `context_attention`.
    """

    index: int
    device: str
    nodes: list[str]
    predicted_ms: float = 0.0  # forward + backward + transfers of one micro-batch, divided by the replicas
    compute_ms: float = 0.0
    forward_ms: float = 0.0  # compute_ms split into its forward and backward parts
    backward_ms: float = 0.0
    comm_ms: float = 0.0
    allreduce_ms: float = 0.0  # the gradient all-reduce over the replicas, once per step
    optimizer_ms: float = 0.0  # the optimizer step over the weights one rank steps, once per step (0: not priced)
    param_bytes: int = 0  # one rank's weights at the compute dtype (split groups: its 1/tensor share)
    activation_bytes: int = 0  # activations held for backward across all micro-batches in flight
    memory_bytes: int = 0  # predicted peak on each device of the stage (0: not predicted)
    capacity_bytes: int | None = None  # usable bytes of that device, where the planner knew them
    recv_bytes: int = 0  # per micro-batch, forward direction
    send_bytes: int = 0
    ranks: list[int] = field(default_factory=list)
    reads_from: list[int] = field(default_factory=list)
    cut_from_marker: bool = False  # the cut before this stage is a pipe_split() marker / split_spec point
    recompute: RecomputeMode = "none"  # activation recomputation (runtime.recompute); its cost is in the numbers
    tensor: int = 1  # ranks per replica, its layers split across them (1: none)
    tensor_groups: list[TensorParallelGroup] = field(default_factory=list)  # what those ranks split
    sharding: ShardingMode = "none"  # FSDP2 over the replicas (rules.sharding)
    # When a sharded stage reduces its gradients: "last" accumulates them whole and reduce-scatters once a step,
    # "every" reduce-scatters after each micro-batch's backward and keeps the shard (FSDP's FULL_SHARD).
    gradient_sync: GradientSync = "last"
    expert: int = 1  # replicas each layer's experts are split over (1: every replica holds every expert)
    expert_layers: list[str] = field(default_factory=list)  # module paths of the stacks of experts split
    context: int = 1  # ranks per replica its sequence is split over (1: whole)
    context_attention: list[str] = field(default_factory=list)  # module paths of its causal attentions split

    @property
    def replicas(self) -> int:
        return max(1, len(self.ranks))

    @property
    def width(self) -> int:
        """Ranks per replica: its context ranks, each holding `tensor` ranks (tensor innermost)."""
        return self.tensor * self.context if isinstance(self.tensor, int) and isinstance(self.context, int) else 1

    @property
    def rank_groups(self) -> list[list[int]]:
        """The ranks of each replica: `width` consecutive ranks from each entry of `ranks`."""
        return [list(range(r, r + self.width)) for r in self.ranks]

    @property
    def all_ranks(self) -> list[int]:
        """Every rank that holds (a part of) this stage."""
        return [r for group in self.rank_groups for r in group]


@dataclass
class Plan:
    """A placement of a traced model onto devices plus the schedule to run it with."""

    stages: list[StagePlan]
    micro_batches: int = 1
    schedule: Schedule = "gpipe"
    predicted_step_ms: float = 0.0
    placement: Placement = "pipeline"
    virtual_stages: int = 1  # stages per rank of a loop or V layout (interleaved: 2 or more; zbv: 2)
    update: Update = "sync"  # asynchronous updates run the 1F1B stream of runtime.flushless, not `programs`
    # Bounded staleness (torchrun, runtime.staleness): the update of step t uses the all-reduced
    # gradients of step t - staleness for weights held by several ranks; 0 is synchronous.
    staleness: int = 0
    # GPUs per host of the cluster the plan is for (ranks are host-major: rank r is on host r // it);
    # 0: not planned for a cluster (one machine, or unknown).
    gpus_per_host: int = 0
    # What each rank (worker) runs in one training step, with predicted times: see runtime.program.
    programs: list[Program] = field(default_factory=list)
    # Predicted step ms of the candidates an "auto" choice compared, by name ({} when none).
    alternatives: dict[str, float] = field(default_factory=dict)
    # The model graph for drawing, as plain node-link data (JSON-ready), or None:
    # {"nodes": [{name, op, module, stage, shapes, out_bytes, param_bytes, flops, time}, ...],
    #  "edges": [{src, dst, bytes}, ...], "capacity": {device: bytes or None}};
    # filled by partitioner.show.visualizer.attach_graph.
    graph: dict[str, Any] | None = None
    # How stages with several replicas share a step's micro-batches: dealt in turn ("deal": micro-batch i
    # runs on replica i mod r) or every micro-batch sliced over them ("slice": d pipelines in lockstep,
    # replica j of every stage forming pipeline j, as sharded data parallelism needs).
    data_split: DataSplit = "deal"
    # The dtypes training keeps each state in ({"compute", "param", "grad", "state", "optimizer", "name"},
    # cost_model.precision.Precision.to_dict()); None: everything at the model's dtype.
    precision: dict[str, str] | None = None
    # The structure the plan was made on: (name, key) of each compute node of the traced graph, in order, a key
    # saying what the node calls in which module. A graph traced otherwise (on meta, with other versions) names
    # its nodes otherwise; the plan binds to it by these ([Note: binding a plan by structure], partitioner/make/
    # bind.py). Empty: bind by node names only (plans saved before).
    node_keys: list[tuple[str, str]] = field(default_factory=list)
    # The kernel set the plan is priced for (cost_model/fused_kernels.py): "eager" (this project's runtime: each
    # operation its own kernel) or "fused" (engines it is exported to: flash attention, fused SwiGLU and norms).
    kernels: KernelSet = "eager"

    @property
    def devices(self) -> list[str]:
        return [s.device for s in self.stages]

    @property
    def bottleneck_ms(self) -> float:
        return max((s.predicted_ms for s in self.stages), default=0.0)

    @property
    def pieces(self) -> int:
        """The micro-batches of one step over all replicas, as `partition(micro_batches=...)` counts them.

        Dealt replicas share the plan's `micro_batches` (micro-batch i on replica i mod r); sliced
        ones (`data_split="slice"`) each run every one of them on their slice, so a step runs
        `micro_batches` x replicas micro-batches of batch / that many samples. A stage's replicas
        each run `pieces // replicas`.
        """
        if self.data_split == "slice":
            return self.micro_batches * max((s.replicas for s in self.stages), default=1)
        return self.micro_batches

    @property
    def recomputes(self) -> bool:
        """Whether any stage recomputes activations in backward (runtime.recompute)."""
        return any(s.recompute != "none" for s in self.stages)

    def stage_of(self) -> dict[str, int]:
        """Node name -> stage index."""
        return {n: s.index for s in self.stages for n in s.nodes}

    @property
    def ranks(self) -> int:
        """How many programs (processes under torchrun, workers in one process) the plan runs on."""
        last = max((r for s in self.stages for r in s.all_ranks), default=len(self.stages) - 1)
        return len(self.programs) or 1 + last

    def host_of(self, rank: int) -> int:
        """The host of `rank` on the cluster the plan is for (0 when `gpus_per_host` is not known)."""
        return rank // self.gpus_per_host if self.gpus_per_host > 0 else 0

    def to_json(self) -> str:
        data = asdict(self)
        for stage in data["stages"]:  # fields a plan that does not split layers leaves at their defaults are
            for key, default in _STAGE_DEFAULTS.items():  # not written, so older readers read it
                if stage[key] == default:
                    del stage[key]
        for key, default in _PLAN_DEFAULTS.items():
            if data[key] == default:
                del data[key]
        if self.node_keys:  # one line each: "name key"
            data["node_keys"] = [f"{name} {key}" for name, key in self.node_keys]
        data["programs"] = [
            {"rank": p.rank, "device": p.device, "ops": [str(op) for op in p.ops], "predicted": p.predicted}
            for p in self.programs
        ]
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read `to_json` output back (a hand-edited file too); unknown keys are an error."""
        data = json.loads(text)
        data.pop("notes", None)  # written by 0.1; its facts are typed fields now
        stages = []
        for s in data.pop("stages"):
            groups = [TensorParallelGroup.from_dict(g) for g in s.pop("tensor_groups", [])]
            stages.append(StagePlan(**s, tensor_groups=groups))
        programs = [
            Program(p["rank"], p["device"], [Op.parse(o) for o in p["ops"]], [tuple(x) for x in p.get("predicted", [])])
            for p in data.pop("programs", [])
        ]
        keys = [(name, key) for name, _, key in (str(e).partition(" ") for e in data.pop("node_keys", []))]
        plan = cls(stages=stages, programs=programs, node_keys=keys, **data)
        plan.check()
        return plan

    def check(self, graph: Mapping[str, Sequence[str]] | None = None) -> None:
        """Raise ValueError naming every field that holds a value the runtime cannot run, and every node in two
        stages. With `graph` ({compute node: nodes it reads}; runtime.stage.stage_io, where the plan meets its
        graph) every compute node must be in exactly one stage, after the nodes it reads."""
        problems = _node_problems(self.stages, graph)
        if self.schedule not in schedule_names():
            problems.append(f"schedule={self.schedule!r}; use one of {', '.join(schedule_names())}")
        if self.placement not in PLACEMENTS:
            problems.append(f"placement={self.placement!r}; use one of {', '.join(PLACEMENTS)}")
        if self.update not in UPDATES:
            problems.append(f"update={self.update!r}; use one of {', '.join(UPDATES)}")
        elif self.update != "sync" and self.schedule != "1f1b":
            problems.append(f"update={self.update!r} with schedule={self.schedule!r}; asynchronous updates stream "
                            "1F1B: use schedule='1f1b'")
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int) or self.staleness < 0:
            problems.append(f"staleness={self.staleness!r}; use an integer >= 0 (0: the synchronous all-reduce)")
        if isinstance(self.gpus_per_host, bool) or not isinstance(self.gpus_per_host, int) or self.gpus_per_host < 0:
            problems.append(f"gpus_per_host={self.gpus_per_host!r}; use an integer >= 0 (0: not planned for a cluster)")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            problems.append(f"micro_batches={self.micro_batches!r}; use an integer >= 1")
        for k, s in enumerate(self.stages):
            if s.index != k:
                problems.append(f"stages[{k}].index is {s.index}; number stages 0, 1, 2, ... in order")
            if any(p >= k or p < 0 for p in s.reads_from):
                problems.append(f"stage {k} reads from stages {s.reads_from}; a stage reads only earlier stages")
            if s.recompute not in RECOMPUTE_MODES:
                problems.append(f"stages[{k}].recompute={s.recompute!r}; use one of {', '.join(RECOMPUTE_MODES)}")
            problems += axis_problems(k, s, self.data_split)
        if self.data_split not in DATA_SPLITS:
            problems.append(f"data_split={self.data_split!r}; use one of {', '.join(DATA_SPLITS)}")
        elif self.data_split == "slice" and len({s.replicas for s in self.stages}) > 1:
            problems.append(f"data_split='slice' runs replica j of every stage as pipeline j, so every stage needs "
                            f"as many replicas; they have {[s.replicas for s in self.stages]}")
        problems += rank_problems(self.stages)
        contexts = sorted({s.context for s in self.stages if isinstance(s.context, int)})
        if len(contexts) > 1:
            problems.append(f"stages split their sequence {[s.context for s in self.stages]} ways; the sequence is "
                            "split alike through the whole pipeline (positions, masks and sizes cross stages): give "
                            f"every stage context={contexts[-1]}, or 1")
        if self.staleness and any(s.context > 1 or s.expert > 1 for s in self.stages):
            problems.append(f"staleness={self.staleness} with experts or a sequence split: their gradients are summed "
                            "over their ranks at the end of each step; use staleness=0")
        if not any(p.startswith("micro_batches=") for p in problems):  # programs against stages, ranks, devices
            problems += program_problems(self.programs, [s.ranks for s in self.stages], self.devices,
                                         self.pieces, self.data_split == "deal" and  # sliced: m x replicas
                                         all(s.width == 1 for s in self.stages))
        if self.kernels not in KERNEL_SETS:
            problems.append(f"kernels={self.kernels!r}; use one of {', '.join(map(repr, KERNEL_SETS))}")
        if self.precision is not None and not set(self.precision) <= _PRECISION_KEYS:
            problems.append(f"precision names {sorted(set(self.precision) - _PRECISION_KEYS)}; it holds "
                            f"{', '.join(sorted(_PRECISION_KEYS))}")
        if problems:
            raise ValueError("invalid plan:\n" + "\n".join(f"- {p}" for p in problems))

    def summary(self) -> str:
        """The plan as a fixed-width table, one row per stage."""
        header = (
            "stage", "device", "nodes", "first .. last node", "cut", "pred ms", "comm ms", "params", "activations"
        )
        rows = [
            (
                str(s.index),
                s.device,
                str(len(s.nodes)),
                f"{s.nodes[0]} .. {s.nodes[-1]}" if s.nodes else "-",
                "marker" if s.cut_from_marker else "-" if s.index == 0 else "cost",
                f"{s.predicted_ms:.3f}",
                f"{s.comm_ms:.3f}",
                human_bytes(s.param_bytes),
                human_bytes(s.activation_bytes),
            )
            for s in self.stages
        ]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        line = "  ".join(f"{{:<{w}}}" for w in widths)
        out = [line.format(*header), line.format(*("-" * w for w in widths))]
        out += [line.format(*r) for r in rows]
        replicated = any(s.replicas > 1 for s in self.stages)
        out.append(
            f"{len(self.stages)} stages ({self.placement}), {micro_batch_words(self)}, "
            f"schedule {self.schedule}; "
            + (f"update {self.update}; " if self.update != "sync" else "")
            + (f"staleness {self.staleness}; " if self.staleness else "")
            + (f"recompute {', '.join(s.recompute for s in self.stages)}; " if self.recomputes else "")
            + (f"kernels {self.kernels}; " if self.kernels != "eager" else "")
            + ("gradients reduce-scattered every micro-batch; " if any(s.gradient_sync == "every" for s in self.stages)
               else "")
            + _axis_words(self.stages)
            + f"bottleneck {self.bottleneck_ms:.3f} ms per micro-batch"
            + (" (a stage's time over its replicas)" if replicated else "")
            + f", predicted step {self.predicted_step_ms:.3f} ms"
        )
        return "\n".join(out)

    def __str__(self) -> str:
        return self.summary()


_STAGE_DEFAULTS: dict[str, Any] = {"optimizer_ms": 0.0,
                                   "tensor": 1, "tensor_groups": [], "sharding": "none", "gradient_sync": "last",
                                   "expert": 1,
                                   "expert_layers": [], "context": 1, "context_attention": []}
_PLAN_DEFAULTS: dict[str, Any] = {"data_split": "deal", "precision": None, "node_keys": [], "kernels": "eager"}
_PRECISION_KEYS = {"compute", "param", "grad", "state", "optimizer", "name", "matmul"}  # Precision.to_dict()


def _node_problems(stages: list[StagePlan], graph: Mapping[str, Sequence[str]] | None) -> list[str]:
    """Nodes in two stages (or twice in one); with `graph`, nodes in none, unknown, or before one they read."""
    at: dict[str, list[int]] = {}
    for s in stages:
        for name in s.nodes:
            at.setdefault(name, []).append(s.index)
    problems = [f"node {n!r} is in stages {', '.join(map(str, a))}; a node runs in exactly one stage: keep it in one"
                for n, a in at.items() if len(a) > 1]
    missing, unknown = [n for n in graph or () if n not in at], [n for n in at if graph is not None and n not in graph]
    if missing:
        problems.append(f"nodes {', '.join(map(repr, missing[:5]))} ({len(missing)} in all) are in no stage; every "
                        "node of the graph runs in one: add each to the stage of the nodes it reads or that read it")
    if unknown:
        problems.append(f"the plan names nodes the graph does not have: {', '.join(map(repr, unknown[:5]))}")
    order = {n: k for k, n in enumerate(n for s in stages for n in s.nodes)}
    for n, k in order.items():
        for p in [p for p in (graph or {}).get(n, ()) if order.get(p, -1) > k][:1]:
            problems.append(f"node {n!r} (stage {at[n][0]}) reads {p!r}, which the plan runs after it (stage "
                            f"{at[p][0]}); list {p!r} before {n!r}, in an order the graph allows")
    return problems


def _axis_words(stages: list[StagePlan]) -> str:
    """'experts split 2 ways (stages 0, 1); sequence split 2 ways; ' for the summary line ('' where none is)."""
    words = ""
    for name, degrees in (("experts", [s.expert for s in stages]), ("sequence", [s.context for s in stages])):
        split = [(k, d) for k, d in enumerate(degrees) if isinstance(d, int) and d > 1]
        if split:
            ways = "/".join(sorted({str(d) for _, d in split}))
            where = "" if len(split) == len(stages) else f" (stages {', '.join(str(k) for k, _ in split)})"
            words += f"{name} split {ways} ways{where}; "
    return words


def micro_batch_words(plan: Plan, batch: int | None = None) -> str:
    """How a step's batch is cut, in the words every view of a plan uses (summary, CLI, pictures, simulate).

    '512 micro-batches (8 per replica x 64 replicas) of 3 samples': the count is the step's
    (`Plan.pieces`, what `partition(micro_batches=...)` and `--micro-batches` give), then each replica's
    share, then the samples one replica's micro-batch holds (on every GPU of that replica). The samples
    are `batch // pieces` where `batch` is given and divides evenly (else left out), without `batch`
    the first micro-batch's, read off the plan's graph (dim 0 of its first batched input).
    """
    n = plan.pieces
    words = f"{n} micro-batch{'es' if n != 1 else ''}"
    replicas = [s.replicas for s in plan.stages]
    if len(set(replicas)) == 1 and replicas[0] > 1:
        words += f" ({n // replicas[0]} per replica x {replicas[0]} replicas)"
    elif len(set(replicas)) > 1:
        words += f" (dealt over {'/'.join(map(str, replicas))} replicas)"
    samples = (batch // n if batch % n == 0 else None) if batch is not None else _graph_samples(plan.graph)
    return words + (f" of {samples} sample{'s' if samples != 1 else ''}" if samples else "")


def _graph_samples(graph: dict[str, Any] | None) -> int | None:
    """Dim 0 of the first input with a dimension in a plan's drawn graph (one micro-batch's), or None."""
    inputs = sorted((n for n in (graph or {}).get("nodes", []) if n.get("op") == "placeholder"),
                    key=lambda n: n.get("position", 0))
    for node in inputs:
        for shape in node.get("shapes") or []:
            if shape:
                return int(shape[0])
    return None


def human_bytes(nbytes: float) -> str:
    """1536 -> '1.5 KiB' (the unit of the plan table and the pictures)."""
    for unit in ("B", "KiB", "MiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"
