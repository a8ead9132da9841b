"""Compute factors per operator group (cost_model.op_mix), solved from the normal equations a Calibration keeps.

One op of a stage whose base (profiled) time is B, shared among groups g by s_g, measured M while
`others` other ranks of its host computed beside it (on average over the op, up to the host's cores):

    M  =  B x sum_g s_g x (f_g + h_g x others)

f_g: the group's factor alone; h_g: how much each rank computing beside it slows it (memory and
cache traffic: a GEMM's weight gradients suffer, a convolution's hardly). Least squares of M / B,
each op weighted by B (every op counts by its time, so a run's many small ops weigh what its few
large ones do), with a prior worth RIDGE ms of ops drawing each f_g and h_g to the pooled fit (one f
and one h for every group; its h drawn to 0 alike): a group seen little stays near the pooled fit, one
never seen takes it, and groups always seen together split their difference the pooled way. A
factor far off the pooled one (the data cannot tell it apart) is solved again with a 4x stronger prior.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import torch

from cost_model.op_mix import GROUPS

__all__ = ["GroupFit", "RIDGE", "WIDTH", "add_rows", "row", "solve"]

RIDGE = 5.0  # the prior's weight, in ms of ops
_SANE = 4.0  # a factor more than this many times off the pooled one is solved again with a stronger prior
_G = len(GROUPS)
WIDTH = 2 * _G  # f per group, then h per group


class GroupFit(NamedTuple):
    """Solved factors: `factors` and `contention` per group ("*": the pooled fit's)."""

    factors: dict[str, float]
    contention: dict[str, float]

    def stage_ms(self, base_ms: float, shares: Mapping[str, float], others: float = 0.0) -> float:
        """One op of a stage (see the module docstring)."""
        f, h = self.factors, self.contention
        return base_ms * sum(share * (f.get(g, f["*"]) + h.get(g, h["*"]) * others) for g, share in shares.items())


def row(base_ms: float, shares: Mapping[str, float], others: float) -> list[float]:
    """The columns of one op."""
    parts = [base_ms * shares.get(g, 0.0) for g in GROUPS]
    return parts + [p * others for p in parts]


def add_rows(eq: list[list[float]], rows: Sequence[tuple[Sequence[float], float]]) -> list[list[float]]:
    """`eq` ([ata rows..., atb], or empty) with the ops (columns, measured ms) added, each weighted 1 / base."""
    if not eq:
        eq = [[0.0] * WIDTH for _ in range(WIDTH)] + [[0.0] * WIDTH]
    for a, measured in rows:
        base = sum(a[:_G])
        if base <= 0:
            continue
        w2 = 1.0 / base
        for i in range(WIDTH):
            eq[WIDTH][i] += w2 * a[i] * measured
            for j in range(WIDTH):
                eq[i][j] += w2 * a[i] * a[j]
    return eq


def solve(eq: Sequence[Sequence[float]]) -> GroupFit | None:
    """The fit of normal equations [ata rows..., atb] (see the module docstring); None without data.

    Raises:
        ValueError: equations of another width (a calibration from another version of this code).
    """
    if len(eq) != WIDTH + 1:
        raise ValueError(f"a calibration with {len(eq) - 1} group columns; this code has {WIDTH} "
                         f"({', '.join(GROUPS)}, alone and beside others): re-run the calibration with this version")
    ata = torch.tensor([list(r) for r in eq[:WIDTH]], dtype=torch.float64)
    atb = torch.tensor(list(eq[WIDTH]), dtype=torch.float64)
    if float(ata[:_G, :_G].sum()) <= 0:
        return None
    m = torch.zeros(WIDTH, 2, dtype=torch.float64)  # the pooled fit: the groups' columns summed
    m[:_G, 0], m[_G:, 1] = 1.0, 1.0
    pooled = _solve(m.T @ ata @ m, m.T @ atb, torch.tensor([0.0, RIDGE], dtype=torch.float64),
                    torch.zeros(2, dtype=torch.float64))
    prior = m @ pooled
    seen = ata.diagonal()[:_G] > 0
    f0, ridge = float(pooled[0]), RIDGE
    x = _solve(ata, atb, torch.full((WIDTH,), ridge, dtype=torch.float64), prior)
    for _ in range(4):
        f = x[:_G][seen]
        if f0 <= 0 or bool(((f > f0 / _SANE) & (f < f0 * _SANE)).all()):
            break
        ridge *= 4.0
        x = _solve(ata, atb, torch.full((WIDTH,), ridge, dtype=torch.float64), prior)
    names = list(GROUPS)
    return GroupFit({**dict(zip(names, x[:_G].tolist())), "*": f0},
                    {**dict(zip(names, x[_G:].tolist())), "*": float(pooled[1])})


def _solve(ata: torch.Tensor, atb: torch.Tensor, weight: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
    """argmin of the weighted squares plus sum weight x (x - prior)^2."""
    x: torch.Tensor = torch.linalg.lstsq(ata + torch.diag(weight), (atb + weight * prior).unsqueeze(1)).solution
    return x.squeeze(1)
