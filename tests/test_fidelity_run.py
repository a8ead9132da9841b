"""A real traced torchrun run feeds the fit and the calibrated simulator (plain-data formats agree end to end)."""

from __future__ import annotations

import json
from pathlib import Path

from cost_model.calibration import fit_calibration
from cost_model.run_fit import compute_events
from partitioner.predict.simulator import simulate
from runtime.plan import Plan
from tests.test_distributed import ROOT, torchrun

WORKER = str(Path(ROOT) / "benchmarks" / "fidelity_worker.py")


def test_a_traced_two_rank_run_is_fitted_and_simulated(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    run = torchrun(2, "gpt 1f1b", str(out), worker=WORKER, nccl_rules=False, timeout=180)
    assert run.returncode == 0 and out.is_file(), run.stdout[-3000:]
    result = json.loads(out.read_text())
    plan = Plan.from_json(result["plan"])
    steps = result["traced"]
    ops = sum(1 for p in plan.programs for op in p.ops if op.is_compute)
    for step in steps:  # every F and B the programs ran was traced and matched to its stage's prediction
        assert len(compute_events(json.loads(plan.to_json()), step)) == ops
    fitted = fit_calibration(plan, {"steps": steps}, step_ms=sorted(result["traced_ms"])[len(steps) // 2])
    assert fitted.compute_factor("cpu", "F") > 0 and fitted.compute_factor("cpu", "B") > 0
    assert fitted.task_ms["F"] >= 0 and fitted.task_ms["SEND"] > 0 and fitted.step_ms >= 0
    assert fitted.task_ms["RECV"] > 0 and fitted.task_ms["WAKE"] >= 0  # every rank took messages
    assert "gloo" in fitted.links and fitted.factor("allreduce") > 0  # the tied embedding's all-reduce was seen
    timeline = simulate(plan, calibration=fitted)
    assert timeline.makespan_ms > 0 and len(timeline.devices) == 2
