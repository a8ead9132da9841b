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
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from fidelity_worker import CONFIGS  # noqa: E402

from cost_model.calibration import Calibration, fit_calibration  # noqa: E402
from cost_model.links import loopback_link  # noqa: E402
from partitioner.predict.simulator import simulate  # noqa: E402
from runtime.plan import Plan  # noqa: E402

TIMEOUT_S = 240


def run_config(name: str, folder: Path) -> dict[str, Any]:
    """One torchrun job of fidelity_worker.py for `name`; its JSON result."""
    out = folder / f"{abs(hash(name))}.json"
    ranks = CONFIGS[name][4]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           str(ROOT / "benchmarks" / "fidelity_worker.py"), name, str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"config {name!r} failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return dict(json.loads(out.read_text()))


def fit(results: list[dict[str, Any]]) -> Calibration | None:
    """One calibration from the traced steps of `results`, run after run."""
    made: Calibration | None = None
    for r in results:
        made = fit_calibration(Plan.from_json(r["plan"]), {"steps": r["traced"]},
                               step_ms=statistics.median(r["traced_ms"]), previous=made)
    return made


def error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--keep", default=None, help="folder for the workers' JSON (default: a temporary one)")
    args = parser.parse_args()
    link = loopback_link()
    print(f"gloo loopback link: latency {link.latency_s * 1e3:.3f} ms, {link.bandwidth / 1e9:.2f} GB/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        results = []
        for name in args.configs:
            results.append(run_config(name, folder))
            print(f"ran {name}", flush=True)
    rows: list[tuple[str, float, float, float, float]] = []
    family: list[float] = []
    for k, r in enumerate(results):
        plan = Plan.from_json(r["plan"])
        measured = statistics.median(r["measured_ms"])
        own = fit([r])
        others = fit(results[:k] + results[k + 1:])
        after = simulate(plan, calibration=own).makespan_ms if own else plan.predicted_step_ms
        held = simulate(plan, calibration=others).makespan_ms if others else float("nan")
        kin = fit([o for j, o in enumerate(results) if j != k and o["config"].split()[0] == r["config"].split()[0]])
        family.append(error(simulate(plan, calibration=kin).makespan_ms, measured) if kin else float("nan"))
        rows.append((r["config"], plan.predicted_step_ms, measured, after, held))
    print(f"\n{'config':<26} {'before ms':>9} {'measured':>9} {'after ms':>9} {'held out':>9} "
          f"{'before/meas':>11} {'after/meas':>10} {'held/meas':>9}")
    for name, before, measured, after, held in rows:
        print(f"{name:<26} {before:>9.1f} {measured:>9.1f} {after:>9.1f} {held:>9.1f} "
              f"{before / measured:>11.2f} {after / measured:>10.2f} {held / measured:>9.2f}")
    before_err = [error(b, m) for _, b, m, _, _ in rows]
    after_err = [error(a, m) for _, _, m, a, _ in rows]
    held_err = [error(h, m) for _, _, m, _, h in rows if h == h]
    if held_err:
        print(f"held-out calibration (fitted on the other configs): median {statistics.median(held_err):.1%}, "
              f"worst {max(held_err):.1%}")
    family = [e for e in family if e == e]
    if family:
        print(f"held-out calibration, same model (fitted on its other configs): "
              f"median {statistics.median(family):.1%}, worst {max(family):.1%}")
    print(f"before calibration: median {100 * statistics.median(before_err):.1f}%, worst {100 * max(before_err):.1f}%")
    print(f"step-time error after calibration: median {100 * statistics.median(after_err):.1f}%, "
          f"worst {100 * max(after_err):.1f}%")


if __name__ == "__main__":
    main()
