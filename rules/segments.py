"""Recomputation segments: the nodes one checkpoint covers (the runtime cuts by this rule, the cost model prices it).

[Note: recomputation segments]
A node's segment key is the shortest prefix of its owning module path that ends in an index
('blocks.2.mlp.0' -> 'blocks.2', 'layers.0' -> 'layers.0'); a node without one ('ln', the root's
own functions) joins the segment before it. Consecutive nodes with one key form a segment.
runtime/recompute_segments.py cuts a stage's graph by it (module paths from torch.fx's
nn_module_stack); cost_model/recompute_cost.py applies it to the graph's `module` attribute to
price the same cut. Both call these functions, so the rule cannot drift between them.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["segment_key", "segments"]


def segment_key(path: str) -> str | None:
    """'blocks.2.mlp.0' -> 'blocks.2'; a path without an index component -> None (see the Note)."""
    parts = path.split(".")
    for k, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: k + 1])
    return None


def segments(nodes: Iterable[tuple[str, str]]) -> dict[str, int]:
    """Each node's segment index (0, 1, ...) from (name, module path) pairs in graph order (see the Note)."""
    found: dict[str, int] = {}
    key: str | None = None
    index = -1
    for name, path in nodes:
        own = segment_key(path)
        if index < 0 or (own is not None and own != key):
            index += 1
            key = own if own is not None else key
        found[name] = index
    return found
