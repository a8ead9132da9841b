"""A model's repeated blocks read from its nodes' module paths: cut candidates at their edges, and each node's block.

A block is a module path up to its first numeric part ("blocks.3" of "blocks.3.attn.qkv"); the
container holding the most of them ("blocks") is the model's stack, if it has 4 or more. The
searches cut between blocks (`block_cuts`), and FSDP2 shards a stage block by block
(runtime/sharding.py), so a block is also the unit whose weights are gathered at once (`block_ids`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["block_cuts", "block_ids"]


def block_ids(modules: Sequence[str]) -> list[int]:
    """Per node, the index of its block in the model's stack (-1: outside it, or no stack of 4 blocks or more)."""
    ids: list[str | None] = []
    count: dict[str, set[str]] = {}
    for path in modules:
        parts = path.split(".") if path else []
        k = next((i for i, x in enumerate(parts) if x.isdigit()), None)
        if k is None:
            ids.append(None)
            continue
        ids.append(".".join(parts[: k + 1]))
        count.setdefault(".".join(parts[:k]), set()).add(parts[k])
    if not count or max(len(v) for v in count.values()) < 4:
        return [-1] * len(modules)
    container = max(count, key=lambda c: len(count[c]))
    number: dict[str, int] = {}
    out = []
    for b in ids:
        if b is None or b.rsplit(".", 1)[0] != container:
            out.append(-1)
        else:
            out.append(number.setdefault(b, len(number)))
    return out


def block_cuts(modules: Sequence[str]) -> np.ndarray | None:
    """Cut candidates of a model with repeated blocks: the first node of each block, and every position
    outside them. `modules[i]` is node i's owning module path ("blocks.3.attn"); see the module docstring.
    None: no repeats."""
    block = block_ids(modules)
    if all(b < 0 for b in block):
        return None
    n = len(modules)
    out = {0, n}
    for i in range(n):
        if block[i] < 0:  # outside the blocks: every position around it
            out |= {i, i + 1}
        elif i == 0 or block[i] != block[i - 1]:  # a block starts
            out.add(i)
    return np.array(sorted(out), dtype=np.int64)
