"""Our cost-based split as a `split_policy` for torch.distributed.pipelining.pipeline(...).

PyTorch's `pipeline(module, mb_args, split_policy=policy)` exports the model, calls
`policy(graph_module)` and then cuts the graph after every `torch.ops.pippy._pipe_split`
call (see `Pipe._from_traced` in torch/distributed/pipelining/_IR.py): nodes before the
first marker form stage 0, and so on. This policy measures the exported graph once on
inputs shaped like the micro-batch, plans one stage per device with the hybrid planner
(no replicas: PiPPy runs one stage per rank) and inserts one marker before the first node
of every stage after the first:

    x ─ linear ─ gelu ─ linear ─ _pipe_split ─ gelu ─ linear ─ _pipe_split ─ linear ─ out
        └──────── stage 0 ────┘               └── stage 1 ──┘               └ stage 2 ┘
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from cost_model.analytic import AnalyticCostModel
from cost_model.devices import DeviceLike
from cost_model.interface import CostModel
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.errors import PartitionError
from partitioner.place.replicated import plan_hybrid
from partitioner.place.search.space import SearchSpace
from runtime.plan import Plan

__all__ = ["CostSplitPolicy", "split_policy"]


def _pipe_split_op() -> Any:
    import torch.distributed.pipelining  # noqa: F401  (registers torch.ops.pippy._pipe_split)

    return torch.ops.pippy._pipe_split.default


def _example_inputs(gm: torch.fx.GraphModule) -> list[Any]:
    """One tensor per placeholder, shaped like the exported example (zeros: valid indices too)."""
    values = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise PartitionError(
                f"input {node.name!r} of the exported graph has no example tensor (meta['val']); "
                "pass tensors only as pipeline inputs, or split with split_spec instead"
            )
        values.append(torch.zeros(tuple(int(s) for s in val.shape), dtype=val.dtype))
    return values


class CostSplitPolicy:
    """Callable GraphModule -> GraphModule inserting pipe_split markers at our planner's stage boundaries.

    After a call, `plan` holds the Plan it followed (stage s on devices[s]).
    """

    def __init__(
        self,
        devices: Sequence[DeviceLike],
        cost_model: CostModel | None = None,
        micro_batches: int = 4,
        schedule: str = "1f1b",
        memory_bytes: Sequence[float] | None = None,
        optimizer: str = "adam",
    ) -> None:
        if isinstance(devices, (str, torch.device)) or len(devices) < 1:
            raise PartitionError(f"devices={devices!r}: pass one device per pipeline stage, e.g. ['cuda:0', 'cuda:1']")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise PartitionError(
                f"micro_batches must be an integer >= 1 (PiPPy's n_microbatches), got {micro_batches!r}"
            )
        if schedule not in ("gpipe", "1f1b"):
            raise PartitionError(f"schedule={schedule!r}; use 'gpipe' (ScheduleGPipe) or '1f1b' (Schedule1F1B)")
        self.devices = [torch.device(d) for d in devices]
        self.cost_model = cost_model
        self.micro_batches = micro_batches
        self.schedule = schedule
        self.memory_bytes = memory_bytes
        self.optimizer = optimizer
        self.plan: Plan | None = None

    def __call__(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        graph = build_graph(gm, _example_inputs(gm))
        for _, attrs in graph.nodes(data=True):  # the example is one micro-batch; plan for the whole step
            attrs["flops"] = attrs.get("flops", 0) * self.micro_batches
            attrs["out_bytes"] = attrs.get("out_bytes", 0) * self.micro_batches
        nodes = compute_nodes(gm)
        if len(nodes) < len(self.devices):
            raise PartitionError(
                f"the exported graph has {len(nodes)} operations for {len(self.devices)} stages; "
                f"pass at most {len(nodes)} devices"
            )
        self.plan = plan_hybrid(
            graph, [n.name for n in nodes], self.devices, self.cost_model or AnalyticCostModel(),
            space=SearchSpace(micro_batches=self.micro_batches, schedules=(self.schedule,)), replicate=False,
            memory_bytes=self.memory_bytes, optimizer=self.optimizer,
        )
        by_name = {n.name: n for n in nodes}
        for stage in self.plan.stages[1:]:
            with gm.graph.inserting_before(by_name[stage.nodes[0]]):
                gm.graph.call_function(_pipe_split_op(), ())
        gm.recompile()
        return gm


def split_policy(
    devices: Sequence[DeviceLike],
    cost_model: CostModel | None = None,
    micro_batches: int = 4,
    schedule: str = "1f1b",
    memory_bytes: Sequence[float] | None = None,
    optimizer: str = "adam",
) -> CostSplitPolicy:
    """A split_policy for `torch.distributed.pipelining.pipeline(module, mb_args, split_policy=...)`.

    Args:
        devices: the device of each pipeline stage (one stage per rank), in stage order.
        cost_model: predicts node and transfer times; analytic, measured here, by default.
        micro_batches: the schedule's n_microbatches (mb_args is one micro-batch).
        schedule: "gpipe" or "1f1b", for the activation memory each stage holds.
        memory_bytes: usable bytes per device (default: 90% of what the cost model knows).

    Raises:
        PartitionError: bad arguments; InfeasibleError (at split time) when no split fits memory.
    """
    return CostSplitPolicy(devices, cost_model, micro_batches, schedule, memory_bytes, optimizer)
