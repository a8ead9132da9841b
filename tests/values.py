"""Random values for planner tests: each made at a position (-1: an input) and read later (n: the output)."""

from __future__ import annotations

import numpy as np


def random_values(rng: np.random.Generator, n: int) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """(producers, sorted consumers per value, bytes per value) for n compute nodes, 1-3 readers each."""
    producers, consumers, sizes = [], [], []
    for p in range(-1, n):
        later = np.arange(max(p + 1, 0), n + 1)
        k = int(rng.integers(1, min(3, len(later)) + 1))
        producers.append(p)
        consumers.append(np.sort(rng.choice(later, size=k, replace=False)))
        sizes.append(float(rng.integers(1, 100) * 1e3))
    return np.array(producers), consumers, np.array(sizes)
