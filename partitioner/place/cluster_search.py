"""Planning at cluster scale: a homogeneous cluster searched by counts, not by device lists.

On `hosts x gpus_per_host` GPUs of one type, GPUs differ only by which host they sit on, so a
plan is a handful of counts (stages p, replicas d of every stage with p * d = GPUs,
micro-batches m with d | m, schedule), a rank order, and p - 1 cuts:

    for (p, d, m) in order of a lower bound on the step       pruned: memory needs (2 + k) P / p > capacity,
        for each rank order (RANK_ORDERS)                            or the bound is no better than the best
            windows: each stage's receive/send links and all-reduce, priced by where its ranks sit (Cluster)
            DP over cut candidates: f_s[j] = min_i max(f_{s-1}[i], W_s[i, j])        p K^2, K candidates
    refine: node-level candidates around the chosen cuts, same DP for the chosen counts

W_s (a stage's work per step) and its memory are hybrid.py's; the step is fill(m, p, d) * max W, with
fill = (m/d + p - 1) / (m/d): d equal replicas of every stage are d pipelines of m/d micro-batches
(runtime/schedule_ranks.py), each filling in p - 1 micro-batch times (hybrid.py's (m + p - 1) / m at d = 1).
W and memory come from stage_costs.py (`stage_parts`, `replica_in_flight`), as hybrid.py's do, so where
both searches price a layout alike (one host, equal replicas) the DP over every cut is exact for each count.
Micro-batch i runs on `ranks[i % d]` of each stage, so replica j of stage s talks to replica j of
s + 1; a stage's link is the slowest of those pairs. Cut candidates come from the caller (the
model's repeated blocks), else every position of a small graph, else equal counts and equal times.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal, Sequence, get_args

import numpy as np

from cost_model.cluster_shape import Cluster
from partitioner.errors import PartitionError
from partitioner.place.hybrid import SCHEDULES, InfeasibleError
from partitioner.place.hybrid_problem import HybridProblem
from partitioner.place.hybrid_windows import Window
from partitioner.place.stage_costs import Grid, cut_candidates, replica_in_flight, schedule_fill, stage_parts
from rules.schedules import searched_names

__all__ = [
    "RANK_ORDERS", "TOP", "Candidate", "ClusterSolution", "RankOrder", "affine", "block_cuts", "default_micro_batches",
    "evaluate_cluster", "fill", "layout", "refine", "reporting", "search_cluster", "slowest_pair", "solve_candidate",
    "windows",
]

# Which ranks share hosts: a stage's replicas ("replicas-together": stage s on ranks s*d .. s*d+d-1, its
# all-reduce inside hosts, pipeline neighbours across them) or one pipeline's stages ("pipelines-together":
# replica j of stage s on rank j*p + s, neighbours inside a host, each all-reduce across hosts).
RankOrder = Literal["replicas-together", "pipelines-together"]
RANK_ORDERS: tuple[str, ...] = get_args(RankOrder)
COARSE = 256  # cut candidates of the first pass when the caller gives none
ROOM = 400  # extra candidates per refining pass
PER_REPLICA = 4  # default micro-batch counts go up to this many per replica
Progress = Callable[[str, int, int], None]  # (what, done, total)
_PROGRESS: contextvars.ContextVar[Progress | None] = contextvars.ContextVar("cluster_search_progress", default=None)


@contextlib.contextmanager
def reporting(callback: Progress) -> Iterator[None]:
    """Within the block, every cluster search reports (what, done, total) to `callback` (a progress bar)."""
    token = _PROGRESS.set(callback)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


def _report(what: str, done: int, total: int) -> None:
    callback = _PROGRESS.get()
    if callback is not None:
        callback(what, done, total)


Candidate = tuple[float, int, int, RankOrder, list[int]]  # (objective s, m, d, rank order, cuts)
TOP = 3  # candidates (best of distinct stages x replicas) kept for a second look (cluster_plan.py)


@dataclass
class ClusterSolution:
    """The chosen counts, ranks and cuts, and what the search compared."""

    bounds: list[int]  # [0, b1, ..., n]
    ranks: list[list[int]]  # per stage, its replicas' ranks (micro-batch i on ranks[s][i % d])
    order: RankOrder
    micro_batches: int
    schedule: str
    step_s: float  # the search's objective: fill(m, p, d) * max W
    work_s: list[float]  # W per stage
    memory: list[float]  # bytes per replica of each stage
    tried: dict[str, float] = field(default_factory=dict)  # "p x d, m, order" -> objective (s), best cuts
    searched: int = 0  # configurations priced
    pruned: int = 0  # configurations skipped by a bound
    candidates: list[Candidate] = field(default_factory=list)  # the TOP best (p, d) by objective, first-pass cuts
    cuts: np.ndarray | None = None  # the first pass's cut candidates (for `refine`)

    @property
    def stages(self) -> int:
        return len(self.ranks)

    @property
    def replicas(self) -> int:
        return len(self.ranks[0])


def layout(p: int, d: int, order: RankOrder) -> list[list[int]]:
    """The ranks of each of p stages with d replicas each, in `order` (see RankOrder)."""
    if order == "replicas-together":
        return [[s * d + j for j in range(d)] for s in range(p)]
    return [[j * p + s for j in range(d)] for s in range(p)]


def affine(time: Callable[..., float], *args: object) -> tuple[float, float]:
    """(latency, seconds per byte) of `time(nbytes, *args)`, a cost affine in the bytes moved."""
    one, big = time(1.0, *args), time(1.0 + (1 << 20), *args)
    slope = (big - one) / (1 << 20)
    return max(0.0, one - slope), max(0.0, slope)


def slowest_pair(cluster: Cluster, src: Sequence[int], dst: Sequence[int]) -> tuple[int, int]:
    """The pair (src[j], dst[j]) on the slowest link: one across hosts where there is one."""
    a, b = np.asarray(src), np.asarray(dst)
    cross = np.flatnonzero(a // cluster.gpus_per_host != b // cluster.gpus_per_host)
    j = int(cross[0]) if len(cross) else 0
    return int(a[j]), int(b[j])


def _link(cluster: Cluster, src: Sequence[int], dst: Sequence[int]) -> tuple[float, ...]:
    return affine(cluster.transfer_time, *slowest_pair(cluster, src, dst))


def windows(cluster: Cluster, ranks: Sequence[Sequence[int]], capacity: float) -> list[Window]:
    """Each stage's Window (hybrid_windows.py) on `ranks`: links to its neighbours, all-reduce, by where they sit."""
    p, out = len(ranks), list[Window]()
    for s, own in enumerate(ranks):
        recv = _link(cluster, ranks[s - 1], own) if s > 0 else None
        send = _link(cluster, own, ranks[s + 1]) if s + 1 < p else None
        reduce = affine(cluster.allreduce_time, list(own)) if len(own) > 1 else None
        out.append((len(own), (0,), recv, send, reduce, capacity))
    return out


class _Pricer:
    """Stage value matrices on one cut grid, cached by window and micro-batches (equal windows, equal costs)."""

    def __init__(self, problem: HybridProblem, cuts: np.ndarray) -> None:
        self.problem, self.grid = problem, Grid(problem, cuts)
        self.K = len(cuts)
        self._parts: dict[tuple[Window, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def parts(self, window: Window, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        key = (window, m)
        if key not in self._parts:
            full = slice(0, self.K)
            self._parts[key] = stage_parts(self.problem, self.grid, window, m, full, full)
        return self._parts[key]

    def values(self, wins: Sequence[Window], m: int, schedule: str, memory: bool = False) -> list[np.ndarray]:
        """Per stage, W (or, with `memory`, bytes per replica) of [cuts[i], cuts[j]); inf where it does not fit."""
        p, out = len(wins), []
        made: dict[tuple[Window, int], np.ndarray] = {}  # stages alike in window and micro-batches held
        for s, window in enumerate(wins):
            count = replica_in_flight(schedule, p - s, m, window[0])
            if (window, count) not in made:
                work, static, flight = self.parts(window, m)
                used = static + count * flight
                if memory:
                    made[window, count] = np.where(np.isfinite(work), used, np.inf)
                else:
                    made[window, count] = np.where(used <= window[-1], work, np.inf)
            out.append(made[window, count])
        return out


def fill(m: int, p: int, d: int, schedule: str = "1f1b") -> float:
    """Step / max W for p stages of d equal replicas each over m micro-batches (module docstring): the
    schedule's `fill` (rules.schedules) for one pipeline of m / d micro-batches."""
    return schedule_fill(schedule)(max(1, m // d), p)


def _dp(values: Sequence[np.ndarray]) -> tuple[float, list[int]]:
    """min over cuts of max over stages of values[s][i, j]; stage 0 starts at cut 0, the last ends at cut K - 1."""
    K = values[0].shape[0]
    f, back = values[0][0].copy(), []
    cols = np.arange(K)
    for v in values[1:]:
        cand = np.maximum(f[:, None], v)
        j = cand.argmin(axis=0)
        back.append(j)
        f = cand[j, cols]
    idx = [K - 1]
    for j in reversed(back):
        idx.append(int(j[idx[-1]]))
    idx.append(0)
    return float(f[K - 1]), idx[::-1]


def block_cuts(modules: Sequence[str]) -> np.ndarray | None:
    """Cut candidates of a model with repeated blocks: the first node of each block, and every position
    outside them. `modules[i]` is node i's owning module path ("blocks.3.attn"); a block is the path up
    to its first numeric part ("blocks.3"), and the container with the most blocks wins. None: no repeats."""
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
        return None
    container = max(count, key=lambda c: len(count[c]))
    block = [b if b is not None and b.rsplit(".", 1)[0] == container else None for b in ids]
    n = len(modules)
    out = {0, n}
    for i in range(n):
        if block[i] is None:  # outside the blocks: every position around it
            out |= {i, i + 1}
        elif i == 0 or block[i] != block[i - 1]:  # a block starts
            out.add(i)
    return np.array(sorted(out), dtype=np.int64)


def default_micro_batches(gpus: int, batch: int | None, stages_limit: int) -> list[int]:
    """Micro-batch counts the search tries: c * d for c <= PER_REPLICA, and the batch's divisors that some
    replica count d divides, for every d = gpus / p with p <= stages_limit; none above the batch."""
    ds = [gpus // p for p in range(1, min(gpus, stages_limit) + 1) if gpus % p == 0]
    ms = {c * d for d in ds for c in range(1, PER_REPLICA + 1)}
    if batch:
        ms |= {x for x in range(1, batch + 1) if batch % x == 0 and any(x % d == 0 for d in ds)}
    kept = sorted(m for m in ms if batch is None or m <= batch)
    if not kept:
        raise PartitionError(f"a batch of {batch} samples cannot give each of {min(ds)} or more replicas of a stage a "
                             f"micro-batch on {gpus} GPUs; use a global batch of at least {min(ds)}, or fewer GPUs")
    return kept


def search_cluster(
    problem: HybridProblem,
    cluster: Cluster,
    *,
    micro_batches: Sequence[int],
    schedules: Sequence[str] = SCHEDULES,
    stages: int | None = None,
    replicate: bool = True,
    cuts: np.ndarray | None = None,
    orders: Sequence[RankOrder] = ("replicas-together", "pipelines-together"),
) -> ClusterSolution:
    """The counts, rank order and cuts with the smallest objective (module docstring) on all of `cluster`.

    Args:
        problem: node arrays (cluster_plan.cluster_problem); its per-device fields are unused.
        micro_batches: candidate counts; a count is tried with the replica counts that divide it.
        stages: force this many stages; replicate=False: one replica per stage.
        cuts: first-pass cut candidates (positions 0..n, e.g. `block_cuts`); default: all or `COARSE` even ones.

    Raises:
        PartitionError: bad arguments; InfeasibleError (memory per GPU named) when nothing fits.
    """
    D, n = cluster.size, problem.n
    if not schedules or any(s not in searched_names() for s in schedules):
        raise PartitionError(f"schedules={list(schedules)!r}; use a non-empty subset of {list(searched_names())}")
    mode = "1f1b" if "1f1b" in schedules else schedules[0]
    capacity = float(problem.capacity.min())
    given = np.unique(np.concatenate([cuts, [0, n]])).astype(np.int64) if cuts is not None else None
    coarse = given if given is not None else cut_candidates(problem, COARSE)
    pricer = _Pricer(problem, coarse)
    states = 2 + problem.optimizer_states
    total_params = float(problem.param_bytes.sum())
    pairs = [(p, D // p) for p in range(1, min(D, n, len(coarse) - 1) + 1) if D % p == 0
             and (stages is None or p == stages) and (replicate or D // p == 1)]
    if not pairs:
        raise PartitionError(f"stages={stages}, replicate={replicate}: no stage count p <= {min(D, n)} with "
                             f"{D} GPUs = p x replicas; give stages that divide {D}, or drop stages=")
    pruned = 0
    configs = []
    for p, d in pairs:
        if states * total_params / p > capacity:  # the stages' weights alone: a lower bound on the largest
            pruned += 1
            continue
        for m in micro_batches:
            if m % d == 0:
                bound = fill(m, p, d, mode) * (m // d) * float(problem.micro_batch_times(m).min(0).sum()) / p
                configs.append((bound, p, d, m))
    configs.sort()
    best: Candidate | None = None
    found: list[Candidate] = []
    tried: dict[str, float] = {}
    searched = 0
    for done, (bound, p, d, m) in enumerate(configs):
        _report(f"{p} stages x {d} replicas, {m} micro-batches", done, len(configs))
        if best is not None and bound >= best[0]:
            pruned += 1
            continue
        for order in orders:
            if (d == 1 or p == 1) and order != orders[0]:  # one layout whatever the order
                continue
            ranks = layout(p, d, order)
            searched += 1
            value, idx = _dp(pricer.values(windows(cluster, ranks, capacity), m, mode))
            step = fill(m, p, d, mode) * value
            if np.isfinite(step):
                tried[f"{p}x{d}, m={m}, {order}"] = step
                found.append((step, m, d, order, [int(coarse[i]) for i in idx]))
                if best is None or step < best[0]:
                    best = found[-1]
    _report("refining cuts", len(configs), len(configs))
    if best is None:
        raise _infeasible(problem, cluster, pairs, micro_batches, mode, pricer, capacity)
    found.sort(key=lambda c: c[0])
    distinct: dict[tuple[int, int], Candidate] = {}  # the best of each (stages, replicas)
    for candidate in found:
        distinct.setdefault((len(candidate[4]) - 1, candidate[2]), candidate)
    solution = solve_candidate(problem, cluster, refine(problem, cluster, best, coarse, mode), schedules)
    solution.tried, solution.searched, solution.pruned = tried, searched, pruned
    solution.candidates, solution.cuts = list(distinct.values())[:TOP], coarse
    return solution


def solve_candidate(problem: HybridProblem, cluster: Cluster, candidate: Candidate,
                    schedules: Sequence[str] = SCHEDULES) -> ClusterSolution:
    """The ClusterSolution of one candidate: 1F1B where allowed, GPipe where it predicts as much and holds no more."""
    _, m, d, order, bounds = candidate
    ranks = layout(len(bounds) - 1, d, order)
    wins = windows(cluster, ranks, float(problem.capacity.min()))
    schedule = "1f1b" if "1f1b" in schedules else schedules[0]
    if schedule == "1f1b" and "gpipe" in schedules:  # same predicted time: GPipe only where it holds no more
        held = [evaluate_cluster(problem, wins, bounds, m, name)[2] for name in ("gpipe", schedule)]
        schedule = "gpipe" if held[0] == held[1] else schedule
    final, work, memory = evaluate_cluster(problem, wins, bounds, m, schedule)
    return ClusterSolution(list(bounds), ranks, order, m, schedule, final, work, memory)


def refine(problem: HybridProblem, cluster: Cluster, best: Candidate, coarse: np.ndarray, mode: str) -> Candidate:
    """Zoom in around the chosen cuts (every `finer`-th position within `stride` of each), for the chosen counts."""
    capacity = float(problem.capacity.min())
    step, m, d, order, bounds = best
    wins = windows(cluster, layout(len(bounds) - 1, d, order), capacity)
    stride = int(np.diff(coarse).max()) if len(coarse) > 1 else 1
    while stride > 1:
        finer = max(1, math.ceil(2 * stride * len(bounds) / ROOM))
        if finer >= stride:
            break
        around = [np.arange(b - stride, b + stride + 1, finer) for b in bounds]
        cuts = np.unique(np.clip(np.concatenate([coarse, *around]), 0, problem.n)).astype(np.int64)
        value, idx = _dp(_Pricer(problem, cuts).values(wins, m, mode))
        found = fill(m, len(bounds) - 1, d, mode) * value
        if found < step:
            step, bounds = found, [int(cuts[i]) for i in idx]
        coarse, stride = cuts, finer
    return step, m, d, order, bounds


def evaluate_cluster(
    problem: HybridProblem, wins: Sequence[Window], bounds: Sequence[int], m: int, schedule: str
) -> tuple[float, list[float], list[float]]:
    """Objective (s), W per stage and bytes per replica of given cuts on given windows (as hybrid.evaluate)."""
    cuts = np.asarray(bounds, dtype=np.int64)
    grid, p = Grid(problem, cuts), len(wins)
    work, memory = [], []
    for s, window in enumerate(wins):
        wk, static, flight = stage_parts(problem, grid, window, m, slice(s, s + 1), slice(s + 1, s + 2))
        work.append(float(wk[0, 0]))
        memory.append(float(static[0, 0] + replica_in_flight(schedule, p - s, m, window[0]) * flight[0, 0]))
    return fill(m, p, wins[0][0], schedule) * max(work), work, memory


def _infeasible(
    problem: HybridProblem, cluster: Cluster, pairs: Sequence[tuple[int, int]], micro_batches: Sequence[int],
    mode: str, pricer: _Pricer, capacity: float,
) -> InfeasibleError:
    """The error naming the memory per GPU the least demanding configuration would need."""
    least: tuple[float, int, int, int] | None = None
    for p, d in pairs:
        for m in (m for m in micro_batches if m % d == 0):
            wins = windows(cluster, layout(p, d, "replicas-together"), capacity)
            need, _ = _dp(pricer.values(wins, m, mode, memory=True))
            if np.isfinite(need) and (least is None or need < least[0]):
                least = (need, p, d, m)
    if least is None:
        return InfeasibleError(
            f"no configuration puts all {cluster.size} GPUs of {cluster.shape} to work: stages x replicas must be "
            f"{cluster.size}, with at most {problem.n} stages and replicas dividing the micro-batches "
            f"{list(micro_batches)[:12]}; allow other micro-batch counts or use another cluster size", [])
    need, p, d, m = least
    gib = 1024**3
    return InfeasibleError(
        f"the model does not fit on {cluster.shape}: under every choice of stages, replicas and micro-batches "
        f"some stage is over the memory per GPU. At least {need / gib:.1f} GiB per GPU is needed ({p} stages x "
        f"{d} replicas, {m} micro-batches, {mode}); a {cluster.gpu.name} has {capacity / gib:.1f} GiB usable. "
        "Fix: more GPUs (more stages), GPUs with more memory, an optimizer with fewer states, or recomputation.",
        [int(math.ceil(need))] * cluster.size,
    )
