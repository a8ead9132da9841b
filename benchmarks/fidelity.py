"""Prediction fidelity: predicted vs measured ms/step under torchrun, before and after calibration.

For each config (benchmarks/fidelity_worker.py: GPT and Inception-style nets, chain GPipe,
chain 1F1B, interleaved, branches, replicas [2,1]; 2 gloo ranks, 3 for replicas) one torchrun
job plans it and runs 30 rounds of one traced step and three untraced ones (interleaved, so both
see the same load; each step between barriers, the optimizer step included). Here, in one
process:

    before      the plan's own prediction (plan.predicted_step_ms: what the planner chose with)
    measured    median wall ms of the untraced steps
    after       simulate(plan, calibration=fit) with fit = fit_calibration(plan, traced steps,
                step_ms=median traced wall ms) fitted on that config's traced steps
    held out    the same, with the calibration fitted on every OTHER config's traced steps
                (does the calibration generalize to a plan it has not seen?)
    same model  held out, fitted on the other configs of the same model only: the compute
                factors correct the base profile, whose error differs by model (here GPT's
                measured/profiled is ~1.0 forward, ~1.4 backward; the Inception net's ~0.7, ~0.8)

GPT has no branch placement: its blocks are a chain with no parallel branches worth a device
(attention's q, k, v are one matmul), so branches run on the Inception net only.
The loopback link is measured once per machine and cached (cost_model.links.loopback_link).
Last two lines:
    before calibration: median A%, worst B%
    step-time error after calibration: median X%, worst Y%
Usage: python benchmarks/fidelity.py [--configs "gpt 1f1b" ...] [--keep DIR]
Timings on a loaded machine are noisy: re-run on a quiet one for the figures that count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from fidelity_worker import CONFIGS, ROUNDS, _data  # noqa: E402
from torchrun_job import torchrun_json  # noqa: E402

from cost_model.calibration import Calibration, fit_calibration  # noqa: E402
from cost_model.links import loopback_link  # noqa: E402
from cost_model.op_mix import module_kinds, stage_shares  # noqa: E402
from partitioner.calibrate.predict import calibrated_step_ms  # noqa: E402
from runtime.plan import Plan  # noqa: E402

TIMEOUT_S = 240


def run_config(name: str, folder: Path, rounds: int, part: int = 0) -> dict[str, Any]:
    """One torchrun job of fidelity_worker.py for `name` (`rounds` rounds); its JSON result."""
    out = folder / f"{abs(hash(name))}-{part}.json"
    return torchrun_json(ROOT / "benchmarks" / "fidelity_worker.py", [name, str(out), str(rounds)], CONFIGS[name][4],
                         out, f"config {name!r}", TIMEOUT_S)


def run_all(names: list[str], folder: Path, passes: int) -> list[dict[str, Any]]:
    """Every config's rounds in `passes` jobs taken in turn (config 1, 2, ..., then again), merged per config:
    on a machine shared with other work, every config then samples the same stretch of load."""
    rounds = max(1, ROUNDS // passes)
    merged: dict[str, dict[str, Any]] = {}
    for part in range(passes):
        for name in names:
            load = os.getloadavg()[0]
            got = run_config(name, folder, rounds, part)
            into = merged.setdefault(name, {**got, "traced": [], "traced_ms": [], "measured_ms": [], "load": []})
            for key in ("traced", "traced_ms", "measured_ms"):
                into[key] += got[key]
            into["load"].append(round(load, 2))
            print(f"ran {name} (pass {part + 1} of {passes}, load average {load:.2f})", flush=True)
    return [merged[name] for name in names]


def with_shares(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each result with its stages' compute by operator group (from its plan and the model's module classes)."""
    kinds = {kind: module_kinds(_data(kind)[0]) for kind in {CONFIGS[r["config"]][0] for r in results}}
    return [{**r, "shares": stage_shares(json.loads(r["plan"]), kinds[CONFIGS[r["config"]][0]])} for r in results]


def fit(results: list[dict[str, Any]], groups: bool = True) -> Calibration | None:
    """One calibration from the traced steps of `results`, run after run, each weighing alike (`groups`: group
    factors too); None when `results` is empty."""
    if not results:
        return None
    made = Calibration()  # decay 1: every config counts alike (a calibration the fit starts forgets older runs)
    for r in results:
        made = fit_calibration(Plan.from_json(r["plan"]), {"steps": r["traced"]},
                               step_ms=statistics.median(r["traced_ms"]), previous=made,
                               shares=r["shares"] if groups else None)
    return made


def predict(r: dict[str, Any], fitted: list[dict[str, Any]], groups: bool = True) -> float:
    """`r`'s step (ms) as a calibration fitted on `fitted` predicts it; NaN when `fitted` is empty."""
    made = fit(fitted, groups)
    if made is None:
        return float("nan")
    plan = Plan.from_json(r["plan"])
    return calibrated_step_ms(plan, made, r["shares"] if groups else None)


def error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def spread(name: str, errors: list[float]) -> str:
    kept = [e for e in errors if e == e]
    return f"{name}: median {statistics.median(kept):.1%}, worst {max(kept):.1%}" if kept else f"{name}: -"


def report(results: list[dict[str, Any]]) -> None:
    """The table and the summary lines (see the module docstring)."""
    results = with_shares(results)
    model = [r["config"].split()[0] for r in results]
    rows = []
    for k, r in enumerate(results):
        others = results[:k] + results[k + 1:]
        same = [o for j, o in enumerate(results) if j != k and model[j] == model[k]]
        other = [o for j, o in enumerate(results) if model[j] != model[k]]
        rows.append((r["config"], Plan.from_json(r["plan"]).predicted_step_ms, statistics.median(r["measured_ms"]),
                     predict(r, [r]), predict(r, others), predict(r, others, groups=False), predict(r, same),
                     predict(r, other), statistics.fmean(r.get("load", [float("nan")]))))
    print(f"\n{'config':<26} {'before':>7} {'measured':>8} {'after':>7} {'held out':>8} {'pooled':>7} "
          f"{'before/':>7} {'after/':>7} {'held/':>7} {'pooled/':>7} {'load':>5}")
    for name, before, measured, after, held, pooled, _, _, load in rows:
        print(f"{name:<26} {before:>7.1f} {measured:>8.1f} {after:>7.1f} {held:>8.1f} {pooled:>7.1f} "
              f"{before / measured:>7.2f} {after / measured:>7.2f} {held / measured:>7.2f} {pooled / measured:>7.2f} "
              f"{load:>5.2f}")
    print("(ms per step; after: fitted on its own traced steps; held out: on every other config's, by operator "
          "group; pooled: the same with one factor per kind; x/: over measured; load: 1-min load average)")
    print(spread("held-out, pooled factors per kind (fitted on the other configs)", [error(x[5], x[2]) for x in rows]))
    print(spread("held-out, same model only", [error(x[6], x[2]) for x in rows]))
    print(spread("held-out, the other model only", [error(x[7], x[2]) for x in rows]))
    print(spread("before calibration", [error(x[1], x[2]) for x in rows]))
    print(spread("step-time error after calibration", [error(x[3], x[2]) for x in rows]))
    print(spread("held-out calibration by operator group (fitted on the other configs)",
                 [error(x[4], x[2]) for x in rows]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--keep", default=None, help="folder for the workers' JSON (default: a temporary one)")
    parser.add_argument("--passes", type=int, default=3, help="jobs per config, taken in turn (default 3)")
    parser.add_argument("--again", default=None, help="report on the results.json a --keep run left in this folder")
    args = parser.parse_args()
    if args.again:
        report(json.loads((Path(args.again) / "results.json").read_text()))
        return
    link = loopback_link()
    print(f"gloo loopback link: latency {link.latency_s * 1e3:.3f} ms, {link.bandwidth / 1e9:.2f} GB/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        results = run_all(args.configs, folder, args.passes)
        (folder / "results.json").write_text(json.dumps(results))
    report(results)


if __name__ == "__main__":
    main()
