"""Where a plan's cuts fall in the module tree: the module each stage begins with, or the module a cut falls inside."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from runtime.plan import Plan

__all__ = ["SplitPoints", "split_points"]

_NO_WORK = ("placeholder", "output")


@dataclass(frozen=True)
class SplitPoints:
    """A plan's cuts as module qualified names (torch's `SplitPoint.BEGINNING`, torchtitan's split points).

    Attributes:
        begins: for each stage after the first, the outermost module it begins with, or None
            where the cut before it does not fall on a module boundary.
        modules: for each stage, the outermost modules it holds whole, in graph order
            (torchtitan's `module_fqns_per_model_part`); code of forward outside any
            submodule (an `x + y` in the model's own forward) is not listed.
        off_boundary: one sentence per cut that is not on a module boundary, saying where it falls.
    """

    begins: list[str | None]
    modules: list[list[str]]
    off_boundary: list[str]

    @property
    def on_boundaries(self) -> bool:
        """Whether every cut falls where a module begins."""
        return not self.off_boundary

    def names(self) -> list[str]:
        """The module each stage after the first begins with.

        Raises:
            ValueError: a cut is not on a module boundary (the message names each).
        """
        if self.off_boundary:
            raise ValueError("the plan's cuts are not all on module boundaries:\n"
                             + "\n".join(f"- {line}" for line in self.off_boundary)
                             + "\nplan with split_spec={'<module>': SplitPoint.BEGINNING, ...} to cut where "
                             "modules begin")
        return [name for name in self.begins if name is not None]


def split_points(plan: Plan) -> SplitPoints:
    """The module each stage of `plan` begins with, read from the module paths in `plan.graph`.

    The cut before stage s is on a module boundary when the graph's nodes before it (in graph
    order) all run in earlier stages, the nodes from it on in stage s or later, and stage s's
    first node begins a module none of whose nodes runs before stage s; the outermost such
    module is the split point.
    """
    stages = len(plan.stages)
    if plan.graph is None:
        why = ("the plan carries no graph, so its module paths are unknown (plans made by plan() and partition() "
               "carry one; attach one with partitioner.predict.graph_data.attach_graph)")
        return SplitPoints([None] * max(0, stages - 1), [[] for _ in range(stages)],
                           [why] if stages > 1 else [])
    work = sorted((n for n in plan.graph["nodes"] if n.get("op") not in _NO_WORK), key=lambda n: n["position"])
    begins: list[str | None] = []
    off: list[str] = []
    for s in range(1, stages):
        name, problem = _begins(work, s)
        begins.append(name)
        if problem:
            off.append(problem)
    return SplitPoints(begins, [_whole_modules(work, s) for s in range(stages)], off)


def _members(work: Sequence[Mapping[str, Any]], module: str) -> list[Mapping[str, Any]]:
    return [n for n in work if n["module"] == module or n["module"].startswith(module + ".")]


def _prefixes(path: str) -> list[str]:
    """'a.b.c' -> ['a', 'a.b', 'a.b.c'] (outermost first)."""
    parts = path.split(".") if path else []
    return [".".join(parts[: k + 1]) for k in range(len(parts))]


def _begins(work: Sequence[Mapping[str, Any]], s: int) -> tuple[str | None, str | None]:
    """(the module stage s begins with, None) or (None, where the cut before it falls)."""
    mine = [n for n in work if n["stage"] == s]
    if not mine:
        return None, f"stage {s} runs no node of the graph"
    first = mine[0]
    before = [n for n in work if n["position"] < first["position"]]
    after = [n for n in work if n["position"] >= first["position"]]
    late = [n for n in before if n["stage"] >= s]
    early = [n for n in after if n["stage"] < s]
    if late or early:
        odd = (late or early)[0]
        return None, (f"stage {s} is not one run of the graph's order: {odd['name']} (stage {odd['stage']}) sits "
                      f"{'before' if late else 'after'} its first node {first['name']}")
    if not first["module"]:
        return None, (f"the cut before stage {s} falls before {first['name']} ({first['target']}), code of the "
                      "model's own forward outside any submodule")
    for module in _prefixes(first["module"]):
        if all(n["stage"] >= s for n in _members(work, module)):
            return module, None
    inner = first["module"]
    held = [n["name"] for n in _members(work, inner) if n["stage"] < s]
    return None, (f"the cut before stage {s} falls inside {inner}: {held[-1]} runs in stage {s - 1} and "
                  f"{first['name']} in stage {s}")


def _whole_modules(work: Sequence[Mapping[str, Any]], s: int) -> list[str]:
    """The outermost modules all of whose nodes run in stage s, in graph order."""
    found: list[str] = []
    for node in work:
        if node["stage"] != s:
            continue
        for module in _prefixes(node["module"]):
            if all(n["stage"] == s for n in _members(work, module)):
                if module not in found:
                    found.append(module)
                break
    return found
