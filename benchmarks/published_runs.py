"""Every measured run of benchmarks/measured_runs.py planned on meta: its configuration forced, and the search's own.

For each row (118, five sources; issue 37 item 4), nothing run, everything priced by the analytic model:

    forced    the measured configuration (benchmarks/measured_plan.py's Fixed fields: t, p, d, micro-batch size,
              interleaving, sharding, recomputation, rank order, sequence parallelism, kernel set), only the cuts
              searched (partitioner/place/cluster/fixed.py); a context-parallel row through the expert/context
              search with every degree forced (place/cluster/split_axes.py). Its tokens/s per GPU against the
              measured one, and its memory per GPU against the GPU's.
    free      the search over every priced axis (place/cluster/priced.py) for the same model, batch and GPUs, once per
              such group; its tokens/s against each row's measured tokens/s. Above 1.15x, the row names the axes
              whose values the measured run did not use (tensor, stages, interleaving, sharding, recomputation,
              micro-batch size): a faster plan must come from one of them.

The fit/held-out protocol (benchmarks/published_fit.py): per GPU family (A100, H100), a factor on its GEMM prices
and one on its attention prices are fitted on the rows of the "fit" sources only (sc21, llm-foundry; Source.split):
least squares of the log ratio of measured over forced time per token, each row's GEMM and attention shares of its
step from benchmarks/published_costs.py scaled and the rest kept; then every row is priced again at the fitted
factors: the held-out sources (megascale, llama3, torchtitan) judge them (the rule for when attention's factor is
fitted apart: published_fit.fitted). `--fit none` prices at gpus.json's efficiencies as they stand.

Usage: python benchmarks/published_runs.py [--rows KEY,KEY] [--source sc21] [--no-free] [--fit none|family]
       [--jobs 2]
Last line: `measured runs: K of N within 15% forced (held out: a of b), J of N free within 1.15x (+F naming an axis),
M of N measured configurations fit`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import multiprocessing
import statistics
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.measured_plan import PlanArguments, plan_arguments  # noqa: E402
from benchmarks.measured_runs import RUNS  # noqa: E402
from benchmarks.measured_types import Run, implied_tokens_per_s, region  # noqa: E402
from benchmarks.published import traced  # noqa: E402
from benchmarks.published_costs import step_parts  # noqa: E402
from benchmarks.published_fit import NONE, Factors, Priced, fitted, shares  # noqa: E402
from benchmarks.published_moe import split_traced  # noqa: E402
from cost_model.analytic import AnalyticCostModel  # noqa: E402
from cost_model.cluster_shape import Cluster  # noqa: E402
from cost_model.gpu_table import GpuTable  # noqa: E402
from cost_model.precision import Precision  # noqa: E402
from partitioner.arguments import cluster_devices  # noqa: E402
from partitioner.place.cluster.fixed import Fixed, price_fixed  # noqa: E402
from partitioner.place.cluster.priced import search_priced  # noqa: E402
from partitioner.place.cluster.split_axes import search_split  # noqa: E402
from partitioner.place.search.infeasible import InfeasibleError  # noqa: E402
from partitioner.place.search.space import SearchSpace  # noqa: E402

WITHIN, FREE_LIMIT, GIB = 0.15, 1.15, float(1 << 30)


def over_text(exc: InfeasibleError) -> str:
    """Why a forced configuration does not fit, short: the memory its fullest GPU needs, by kind where known."""
    if not exc.held:
        return str(exc).splitlines()[0][:160]
    h = max(exc.held, key=lambda x: x.total)
    chunks = f" chunks of 1/{h.chunks}" if h.chunks > 1 else ""
    return (f"needs {h.total / GIB:.1f} GiB on stage {h.stage}: states {h.states / GIB:.1f}, activations "
            f"{h.activations / GIB:.1f} = {h.in_flight}{chunks} x {h.activations / max(1, h.in_flight) / GIB:.2f}")


def measured_tps(run: Run) -> float:
    """Tokens/s per GPU the row's printed figures mean: the middle of where all their rounding intervals meet."""
    spans = implied_tokens_per_s(run).values()
    low, high = max(a for a, _ in spans), min(b for _, b in spans)
    return (low + high) / 2 / run.gpus


def _priced_on(args: PlanArguments, factor: Factors) -> tuple[Cluster, GpuTable]:
    """The row's cluster and the GPU table it is priced from: at factors other than 1, its GPU type again under a
    new name with the measured GEMM and fused-attention fractions of peak times them (the fitted efficiencies)."""
    extra = [args.gpu_extra] if args.gpu_extra is not None else []
    if tuple(factor) == NONE:
        table = GpuTable.load(extra=extra) if extra else GpuTable.load()
        return args.cluster_object(), table
    name = args.gpu_extra["name"] if args.gpu_extra is not None else args.cluster["gpu"]
    entries = json.loads(resources.files("cost_model").joinpath("gpus.json").read_text())["gpus"] + extra
    entry = copy.deepcopy(next(g for g in entries if g["name"] == name))
    gemm, attention = factor
    entry.update(name=f"{name}-x{gemm:.2f}-x{attention:.2f}", aliases=[],
                 gemm_efficiency={k: min(1.0, v * gemm) for k, v in entry.get("gemm_efficiency", {}).items()})
    if "attention_efficiency" in entry:
        entry["attention_efficiency"] = {k: min(1.0, v * attention) for k, v in entry["attention_efficiency"].items()}
    table = GpuTable.load(extra=[*extra, entry])
    # the fabric stays the measured GPU's: its defaults (NVLink bus bandwidth, NICs) are keyed by the type's name
    return dataclasses.replace(args.cluster_object(), gpu=table.get(entry["name"])), table


def _config(t: int, p: int, d: int, *, mbs: float, v: int, sharding: str, recompute: str, c: int = 1) -> str:
    return (f"t{t} p{p}" + (f" c{c}" if c > 1 else "") + f" d{d} mbs {mbs:g}" + (f" v{v}" if v > 1 else "")
            + (f" {sharding}" if sharding != "none" else "")
            + (" recompute" if recompute == "full" else f" recompute {recompute}" if recompute != "none" else ""))


def _axes(run: Run, fixed: dict[str, Any], t: int, p: int, v: int, sharding: str, recompute: str,
          mbs: float) -> tuple[str, ...]:
    """The free plan's axes whose values differ from the measured configuration's."""
    named = [("tensor", t != fixed["tensor"]), ("stages", p != fixed["stages"]),
             ("interleaving", v != fixed["virtual_stages"]), ("sharding", sharding != fixed["sharding"]),
             ("recomputation", recompute != fixed["recompute"]),
             ("micro-batch size", abs(mbs - fixed["micro_batch_size"]) > 1e-9),
             ("context", run.parallel.context > 1)]
    return tuple(name for name, differs in named if differs)


# torchtitan's float8 recipes leave the output layer in bf16 (filter_fqns = ["output"]); the builders name it "head"
FLOAT8_KEEP = ("head",)


def _precision(run: Run) -> Precision:
    """The row's precision; float8 linear layers (torchao) as FP8 products (Precision.matmul)."""
    parsed = Precision.parse(run.precision)
    return dataclasses.replace(parsed, matmul="float8_e4m3fn") if run.kernels.float8 else parsed


def _price_context(run: Run, args: PlanArguments, out: Priced, factor: Factors, precision: Precision,
                   free: bool) -> None:
    """A context-parallel row: the expert/context search (place/cluster/split_axes.py) on the sequence-symbolic
    export trace, every degree forced (t, p, context, sharding, the micro-batch count), recomputation as run."""
    with torch.device("meta"):
        model = args.build()
    graph, order, shardable, gm, facts = split_traced(model, args.example_inputs()[0], export=True)
    cluster, table = _priced_on(args, factor)
    cost = AnalyticCostModel(cluster_devices(cluster)[2], gpus=table, matmul=precision.matmul or None,
                             float8=run.kernels.float8, keep=FLOAT8_KEEP)  # torchao's casts priced
    cost.prepare(gm)
    f = Fixed(**args.fixed)
    recompute = "selective-op" if str(f.recompute) == "selective" else f.recompute  # torchtitan's, as `variants`
    unstated = run.parallel.recompute is None and recompute == "none"  # then as `variants` tries it
    tokens_n = run.global_batch * run.seq
    for mode in (recompute, "attention", "full") if unstated else (recompute,):
        space = SearchSpace(run.global_batch // f.micro_batch_size, recompute=mode, precision=precision,
                            tensor=(f.tensor,), sharding=(f.sharding,), kernels=args.kernels,
                            sequence_parallel=f.sequence_parallel)
        try:  # interleaved as run (v: priced, search_split's `virtual`)
            made = search_split(graph, order, cluster, cost, facts, space=space, shardable=shardable, expert=1,
                                context=args.context, stages=f.stages, virtual=f.virtual_stages)
        except InfeasibleError as exc:
            out.over = out.over or over_text(exc)
            continue
        out.over = ""
        out.forced = tokens_n / made.solution.step_s / run.gpus
        out.memory = max(made.solution.memory) / GIB
        out.forced_config += f" (recompute {made.solution.choice.get('recompute', 'none')})"
        break
    if free:
        try:
            best = search_split(graph, order, cluster, cost, facts, space=SearchSpace(
                recompute="auto", precision=precision, kernels=args.kernels), shardable=shardable)
            s = best.solution
            mbs = run.global_batch / s.micro_batches
            mode = str(s.choice.get("recompute", "none"))
            out.free = tokens_n / s.step_s / run.gpus
            out.free_config = _config(s.tensor, s.stages, s.replicas, mbs=mbs, v=s.virtual, sharding=s.sharding,
                                      recompute=mode, c=best.context)
            out.axes = _axes(run, args.fixed, s.tensor, s.stages, s.virtual, s.sharding, mode, mbs)
            out.axes = tuple(a for a in out.axes if a != "context") + (("context",) if best.context != args.context
                                                                        else ())
        except InfeasibleError as exc:
            out.free_config = "nothing fits: " + str(exc).splitlines()[0][:120]


def variants(run: Run, fixed: Fixed) -> list[Fixed]:
    """The measured configuration, with what its source leaves unstated tried from the fastest choice to the one
    using least memory (the first that fits is the row's): sequence parallelism beside t > 1 (it only removes work
    and memory), then ZeRO-1 sharding (Megatron-LM's distributed optimizer), then recomputing the attention core
    (Megatron-LM's selective recomputation, `--recompute-activations`), then full recomputation. A trainer's
    "selective" is torchtitan's op policy (the only source here that runs one): Fixed's "selective-op"."""
    p = run.parallel
    sp = fixed.sequence_parallel or (p.sequence_parallel is None and fixed.tensor > 1)
    selective = str(fixed.recompute) == "selective"  # measured_plan passes the trainer's mode through
    first = dataclasses.replace(fixed, sequence_parallel=sp, recompute="selective-op" if selective else fixed.recompute)
    out = [first]
    if p.sharding is None and first.sharding == "none":
        out.append(dataclasses.replace(out[-1], sharding="zero1"))
    if p.recompute is None and first.recompute == "none":
        out.append(dataclasses.replace(out[-1], recompute="attention"))
        out.append(dataclasses.replace(out[-1], recompute="full"))
    return out


def price_row(run: Run, factor: Factors = NONE, free: bool = True) -> Priced:
    """Forced and (optionally) free figures of one row, its GPU's GEMM and attention efficiencies x `factor`."""
    start = time.perf_counter()
    args = plan_arguments(run)
    out = Priced(run.key, run.source.key, run.split, run.family or "?", region(run), measured_tps(run))
    with torch.device("meta"):
        model = args.build()
    graph, order, shardable, gm = traced(model, args.example_inputs()[0])
    cluster, table = _priced_on(args, factor)
    cost = AnalyticCostModel(cluster_devices(cluster)[2], gpus=table, matmul=_precision(run).matmul or None,
                             float8=run.kernels.float8, keep=FLOAT8_KEEP)  # torchao's casts priced
    cost.prepare(gm)
    precision = _precision(run)
    out.capacity = float(cost.spec("cuda:0").memory_bytes) * 0.9 / GIB
    f = Fixed(**args.fixed)
    d = run.gpus // (f.tensor * f.stages * args.context)
    out.forced_config = _config(f.tensor, f.stages, d, mbs=f.micro_batch_size, v=f.virtual_stages,
                                sharding=f.sharding, recompute=f.recompute, c=args.context)
    tokens = run.global_batch * run.seq
    if args.context > 1:
        _price_context(run, args, out, factor, precision, free)
        out.seconds = time.perf_counter() - start
        return out
    else:
        loose = None
        for variant in variants(run, f):
            try:
                solution = price_fixed(graph, order, cluster, cost, variant, precision=precision, shardable=shardable)
            except InfeasibleError as exc:
                out.over = out.over or over_text(exc)
                if loose is None:
                    try:  # what its prices say were memory no limit (not counted: it must fit)
                        loose = price_fixed(graph, order, cluster, cost, variant, precision=precision,
                                            shardable=shardable, headroom=1e6)
                    except InfeasibleError:
                        pass
                continue
            out.over, f = "", variant
            out.forced = tokens / solution.step_s / run.gpus
            out.memory = max(solution.memory) / GIB
            parts = step_parts(graph, order, shardable, cluster, cost, f, solution)
            out.gemm_share, out.attention_share = shares(parts, solution.step_s)
            break
        else:
            if loose is not None:
                out.forced, out.memory = tokens / loose.step_s / run.gpus, max(loose.memory) / GIB
        out.forced_config = _config(f.tensor, f.stages, d, mbs=f.micro_batch_size, v=f.virtual_stages,
                                    sharding=f.sharding, recompute=f.recompute) + (" SP" if f.sequence_parallel else "")
    if free:
        try:
            best, mode = search_priced(graph, order, cluster, cost, precision=precision, shardable=shardable,
                                       kernels=args.kernels)
            out.free = tokens / best.step_s / run.gpus
            mbs = run.global_batch / best.micro_batches  # micro-batch i runs on replica i % d
            out.free_config = _config(best.tensor, best.stages, best.replicas, mbs=mbs, v=best.virtual,
                                      sharding=best.sharding, recompute=mode)
            out.axes = _axes(run, args.fixed, best.tensor, best.stages, best.virtual, best.sharding, mode, mbs)
        except InfeasibleError as exc:
            out.free_config = "nothing fits: " + str(exc).splitlines()[0][:120]
    out.seconds = time.perf_counter() - start
    return out


def _job(item: tuple[int, Factors, bool]) -> Priced:
    index, factor, free = item
    return price_row(RUNS[index], factor, free)


def show(r: Priced) -> None:
    ratio = f"{r.forced / r.measured:.2f}" if r.forced else "-"
    memory = f"{r.memory:.1f}" if r.memory is not None else "-"
    free = f"{r.free / r.measured:.2f}" if r.free else "-"
    flag = "" if r.free is None or r.free / r.measured <= FREE_LIMIT else (
        f" [faster by: {', '.join(r.axes)}]" if r.axes else " [faster, no axis named]")
    print(f"{r.key:<34} {r.split:<8} {r.region:<10} measured {r.measured:>7.0f} | forced {r.forced_config}: ratio "
          f"{ratio}, {memory}/{r.capacity:.0f} GiB{' (' + r.over + ')' if r.over else ''} | free {r.free_config}: "
          f"ratio {free}{flag} ({r.seconds:.0f} s)", flush=True)


def price_all(indices: list[int], factors: dict[str, Factors], free: bool, jobs: int,
              cache: Path | None = None) -> list[Priced]:
    """Every row of `indices` priced (in `jobs` processes); rows already in `cache` (a JSON lines file of
    earlier results at the same factor, with or without the free search as asked) are read, not priced again."""
    items = [(i, factors.get(RUNS[i].family or "", NONE), free) for i in indices]
    done: dict[tuple[str, Factors, bool], Priced] = {}
    if cache is not None and cache.exists():
        for line in cache.read_text().splitlines():
            entry = json.loads(line)
            row = Priced(**{**entry["row"], "axes": tuple(entry["row"]["axes"])})
            done[(row.key, (entry["factor"][0], entry["factor"][1]), entry["free"])] = row
    found = [done.get((RUNS[i].key, f, fr)) or (done.get((RUNS[i].key, f, True)) if not fr else None)
             for i, f, fr in items]  # a row priced with its free search serves one asked without
    for known in found:
        if known is not None:
            show(known)
    todo = [item for item, row in zip(items, found) if row is None]
    fresh = _price(todo, jobs, cache)
    by_key = {r.key: r for r in [*filter(None, found), *fresh]}
    return [by_key[RUNS[i].key] for i, _, _ in items]


def _price(items: list[tuple[int, Factors, bool]], jobs: int, cache: Path | None) -> list[Priced]:
    def keep(item: tuple[int, Factors, bool], row: Priced) -> None:
        show(row)
        if cache is not None:
            with cache.open("a") as out:
                out.write(json.dumps({"factor": item[1], "free": item[2], "row": dataclasses.asdict(row)}) + "\n")
    rows = []
    if jobs > 1 and len(items) > 1:
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            for item, row in zip(items, pool.imap(_job, items)):
                keep(item, row)
                rows.append(row)
        return rows
    for item in items:
        rows.append(_job(item))
        keep(item, rows[-1])
    return rows


def summary(rows: list[Priced]) -> tuple[int, int, int, int, int, int]:
    ok = [r for r in rows if r.forced is not None and not r.over and abs(r.forced / r.measured - 1) <= WITHIN]
    held = [r for r in rows if r.split == "held-out"]
    free_ok = [r for r in rows if r.free is not None and r.free / r.measured <= FREE_LIMIT]
    named = [r for r in rows if r.free is not None and r.free / r.measured > FREE_LIMIT and r.axes]
    fits = [r for r in rows if r.forced is not None and not r.over]
    return len(ok), len([r for r in ok if r.split == "held-out"]), len(held), len(free_ok), len(named), len(fits)


def errors_by_source(rows: list[Priced]) -> None:
    for source in sorted({r.source for r in rows}):
        errs = [abs(r.forced / r.measured - 1) for r in rows if r.source == source and r.forced is not None]
        if errs:
            print(f"  {source:<12} {rows[[r.source for r in rows].index(source)].split:<8} forced error median "
                  f"{statistics.median(errs):.1%}, worst {max(errs):.1%} over {len(errs)} rows")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="row keys (default: all), e.g. sc21-1.7B,llama3-405B-8k")
    parser.add_argument("--source", default="", help="only this source's rows")
    parser.add_argument("--no-free", action="store_true", help="skip the free search")
    parser.add_argument("--fit", choices=("none", "family"), default="family")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=None,
                        help="a JSON lines file of rows priced before (read, and appended to): resumes a long run")
    args = parser.parse_args()
    keys = set(filter(None, args.rows.split(",")))
    indices = [i for i, r in enumerate(RUNS) if (not keys or r.key in keys)
               and (not args.source or r.source.key == args.source)]
    start = time.perf_counter()
    factors: dict[str, Factors] = {}
    if args.fit == "family":
        print("pass 1: the table's efficiencies, fit rows only", flush=True)
        fit_rows = price_all([i for i in indices if RUNS[i].split == "fit"], {}, False, args.jobs, args.cache)
        factors = fitted(fit_rows)
        print("fitted factors (fit rows only): " + ", ".join(f"{k} GEMMs x{g:.2f}, attention x{a:.2f}"
                                                          for k, (g, a) in factors.items()))
        print("pass 2: every row at the fitted factors", flush=True)
    rows = price_all(indices, factors, not args.no_free, args.jobs, args.cache)
    errors_by_source(rows)
    ok, held_ok, held, free_ok, named, fits = summary(rows)
    n = len(rows)
    print(f"({time.perf_counter() - start:.0f} s)")
    print(f"measured runs: {ok} of {n} within 15% forced (held out: {held_ok} of {held}), {free_ok} of {n} free "
          f"within 1.15x (+{named} naming an axis), {fits} of {n} measured configurations fit")


if __name__ == "__main__":
    main()
