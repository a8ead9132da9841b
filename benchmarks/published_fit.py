"""The fit/held-out protocol of benchmarks/published_runs.py: what a priced row carries, and the efficiency factors
fitted per GPU family on the "fit" rows only (the held-out rows judge them; issue 37 item 4)."""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["ATTENTION_DECIDES", "GRID", "NONE", "Factors", "Priced", "fitted", "shares"]

Factors = tuple[float, float]  # (GEMMs, fused attention): multipliers of the GPU type's measured fractions of peak
NONE: Factors = (1.0, 1.0)


@dataclasses.dataclass
class Priced:
    """One row's figures (tokens/s per GPU; memory per GPU in GiB; None where nothing fit)."""

    key: str
    source: str
    split: str
    family: str
    region: str
    measured: float
    forced: float | None = None
    gemm_share: float = 1.0  # of the forced step: matrix products' time (their part of the recomputed forward too)
    attention_share: float = 0.0  # attention products' time likewise
    memory: float | None = None
    capacity: float = 0.0
    over: str = ""  # why the forced configuration does not fit
    free: float | None = None
    free_config: str = ""
    axes: tuple[str, ...] = ()  # axes the free plan uses whose values the measured run did not
    forced_config: str = ""
    seconds: float = 0.0


def shares(parts: dict[str, float], step_s: float) -> Factors:
    """(GEMMs, attention) shares of a step from benchmarks/published_costs.py's parts, the recomputed forward split
    between them and the memory-bound ops as the first forward is."""
    g, a, rest = (parts.get(k, 0.0) for k in ("GEMMs", "attention products", "memory-bound ops"))
    again = parts.get("recomputed forward", 0.0)
    total = g + a + rest
    if total > 0:
        g, a = g + again * g / total, a + again * a / total
    return min(1.0, g / step_s), min(1.0, a / step_s)


GRID = np.round(np.arange(0.40, 1.601, 0.01), 2)
ATTENTION_DECIDES = 0.3  # a fit row's attention share of its step that lets attention's factor be fitted apart


def fitted(rows: list[Priced]) -> dict[str, Factors]:
    """Per GPU family, the (GEMM, attention) factors fitted on the "fit" rows that fit: least squares of the log
    ratio of predicted to measured time per token, each row's time taken as step x (g / f_g + a / f_a + rest) with
    its shares at factor 1 (a small pull toward 1). Attention gets a factor of its own only where some fit row
    spends at least ATTENTION_DECIDES of its step in it: rows at short sequences cannot tell a slow attention
    kernel from slow GEMMs (fitted apart on H100's 2,048-token rows, attention went to the grid's floor, x0.40,
    explaining with 5-20% of the step what the runs' other kernels cost, and priced 32k-131k-token runs at
    a third of their speed), so there one factor serves both."""
    out: dict[str, Factors] = {}
    fg, fa = np.meshgrid(GRID, GRID, indexing="ij")
    for family in sorted({r.family for r in rows}):
        used = [r for r in rows if r.family == family and r.split == "fit" and r.forced is not None and not r.over]
        if not used:
            continue
        loss = 1e-3 * (np.log(fg) ** 2 + np.log(fa) ** 2)
        for r in used:
            rest, forced = 1.0 - r.gemm_share - r.attention_share, float(r.forced or 0.0)
            loss = loss + np.log(r.measured / forced * (r.gemm_share / fg + r.attention_share / fa + rest)) ** 2
        if max(r.attention_share for r in used) < ATTENTION_DECIDES:
            loss = np.where(fg == fa, loss, np.inf)
        i, j = np.unravel_index(int(np.argmin(loss)), loss.shape)
        out[family] = (float(GRID[i]), float(GRID[j]))
    return out
