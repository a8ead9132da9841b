"""Each stage's compute by operator group (matmul, convolution, attention, normalization, memory-bound, view):
the per-kind attribution that compute factors are fitted against and applied to.

A stage's predicted forward (or backward) time is shared among the groups of its nodes by
each node's predicted time (the plan's stored graph: `plan.graph["nodes"][i]["time"]`, the
cost model's forward + backward ms, from the profiler on a device that is here):

    share(stage, group) = sum of the group's node times / sum of the stage's node times

so that sum over groups of factor(group) x share x the stage's time is the calibrated time,
and a calibration fitted on one model's mix of groups prices another's (cost_model/run_fit.py).
Groups come from cost_model.ops.classify with the module class of each call_module node.
"""

from __future__ import annotations

from typing import Any, Mapping

from cost_model.ops import classify

__all__ = ["GROUPS", "Shares", "module_kinds", "op_group", "stage_shares"]

GROUPS = ("gemm", "conv", "attention", "norm", "memory", "view")
Shares = dict[str, float]  # group -> share of a stage's compute (they sum to 1)

_GROUP_OF = {"gemm": "gemm", "conv": "conv", "layernorm": "norm", "batchnorm": "norm", "view": "view",
             "python": "view"}  # every other class moves bytes: "memory"
_ATTENTION = ("attention", "sdpa", "flash")


def op_group(node: Mapping[str, Any], kind: str | None = None) -> str:
    """The group of a graph node (`kind`: its module class, for a call_module node)."""
    cls = classify(node, kind)
    if cls == "gemm" and any(a in str(kind or node.get("target", "")).lower() for a in _ATTENTION):
        return "attention"
    return _GROUP_OF.get(cls, "memory")


def module_kinds(model: Any) -> dict[str, str]:
    """Module path -> class name of every submodule of `model` (an nn.Module): call_module nodes' kinds."""
    return {name: type(module).__name__ for name, module in model.named_modules()}


def stage_shares(plan: Mapping[str, Any], kinds: Mapping[str, str] | None = None) -> list[Shares] | None:
    """Each stage's compute shared by group, from a plan's to_json dict (see the module docstring); None when
    the plan stores no graph with node times. `kinds`: module path -> class (`module_kinds(model)`)."""
    nodes = (plan.get("graph") or {}).get("nodes") or []
    stages = plan.get("stages", [])
    times: list[dict[str, float]] = [{} for _ in stages]
    for node in nodes:
        s, ms = int(node.get("stage", -1)), float(node.get("time", 0.0) or 0.0)
        if not 0 <= s < len(stages) or ms <= 0:
            continue
        kind = (kinds or {}).get(str(node.get("target", ""))) if node.get("op") == "call_module" else None
        group = op_group(node, kind)
        times[s][group] = times[s].get(group, 0.0) + ms
    if not any(times):
        return None
    shares = []
    for by_group in times:
        total = sum(by_group.values())
        shares.append({g: ms / total for g, ms in by_group.items()} if total > 0 else {})
    return shares

