"""How each stage of a plan is split across ranks: replicas, tensor, context and expert degrees, sharding, memory."""

from __future__ import annotations

from partitioner.predict.memory_kinds import KINDS, memory_kinds
from partitioner.predict.replica_fold import rank_span
from runtime.plan import Plan, human_bytes

__all__ = ["split_summary"]


def split_summary(plan: Plan) -> str:
    """A fixed-width table of each stage's ranks, replicas, tensor degree (context and expert degrees where a stage
    splits its sequence or experts), sharding and memory by kind, and the training precision; "" for a plan no
    stage of which is replicated, split or sharded (nor a precision given)."""
    if not plan.precision and all(s.replicas == 1 and s.width == 1 and s.expert == 1 and s.sharding == "none"
                                  for s in plan.stages):
        return ""
    axes = [(name, key) for name, key in (("context", "context"), ("expert", "expert"))
            if any(getattr(s, key) > 1 for s in plan.stages)]
    header = ("stage", "ranks", "replicas", "tensor", *(name for name, _ in axes), "sharding", *KINDS, "memory")
    rows = []
    for s in plan.stages:
        kinds = memory_kinds(plan, s)
        rows.append((str(s.index), rank_span(s.all_ranks) if s.all_ranks else str(s.index), str(s.replicas),
                     str(s.tensor), *(str(getattr(s, key)) for _, key in axes), s.sharding,
                     *(human_bytes(kinds[k]) for k in KINDS), human_bytes(s.memory_bytes)))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [line.format(*header), line.format(*("-" * w for w in widths)), *(line.format(*r) for r in rows)]
    if plan.precision:
        name = plan.precision.get("name") or ""
        dtypes = "/".join(plan.precision.get(k, "?") for k in ("compute", "param", "grad", "state"))
        out.append(f"precision {name} (compute/param/grad/state {dtypes}, {plan.precision.get('optimizer')}); "
                   f"data split {plan.data_split}")
    return "\n".join(out)
