"""pipe.calibrate: state left as it was, the JSON saved and reused, auto choices that never lose, CLI, page."""

from __future__ import annotations

import copy
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from models import InceptionNet  # noqa: E402

from cost_model.calibration import Calibration  # noqa: E402
from partitioner import partition, plan  # noqa: E402
from partitioner.calibrate.decide import Measurement, hook_of, measure_steps  # noqa: E402
from partitioner.show.visualizer import page_data, visualize  # noqa: E402
from runtime.calibration_hook import StepCall  # noqa: E402
from tests.zoo import rel  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibrations written here must not reach other tests' plans (they share the session's cache)."""
    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(tmp_path / "cache"))


def make_small(batch: int = 8) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """MODULE:FACTORY for the CLI test: a small Inception-style net and a batch."""
    torch.manual_seed(0)
    return InceptionNet(c=8, blocks=2), (torch.randn(batch, 3, 8, 8),)


def _data() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    model, (x,) = make_small()
    return model, x, torch.randint(0, 10, (8,))


def test_calibrate_leaves_weights_gradients_optimizer_and_rng_as_they_were() -> None:
    model, x, y = _data()
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pipe.train_step(x, y, F.cross_entropy)
    opt.step()
    pipe.train_step(x, y, F.cross_entropy)  # gradients pending, momentum held
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    momentum = {i: s["momentum_buffer"].clone() for i, s in enumerate(opt.state.values())}
    rng = torch.get_rng_state()
    report = pipe.calibrate(steps=2)
    assert report.measured_ms > 0 and report.steps == 2
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    assert all(torch.equal(s["momentum_buffer"], momentum[i]) for i, s in enumerate(opt.state.values()))
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_json_is_written_and_reused_by_a_later_plan(tmp_path: Path) -> None:
    model, x, y = _data()
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2)
    report = pipe.calibrate(steps=1, inputs=(x,), targets=y, loss_fn=F.cross_entropy)
    saved = json.loads(Path(report.path).read_text())
    assert Path(report.path).parent.parent == tmp_path / "cache" and "cpu" in saved["sums"]
    # a hand-written calibration in its place: every cpu node takes 3x, transfers as they were
    Calibration(sums={"cpu": [3.0, 1.0]}).save(report.path)
    fresh, _ = make_small()
    other = tmp_path / "other.json"
    Calibration(sums={"cpu": [1.0, 1.0]}).save(other)
    plain = plan(fresh, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2, calibration=other)  # factor 1
    reused = plan(fresh, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2)  # the machine's: factor 3
    assert [s.nodes for s in reused.stages] == [s.nodes for s in plain.stages]
    for a, b in zip(reused.stages, plain.stages):
        assert a.compute_ms == pytest.approx(3 * b.compute_ms, rel=1e-9)


def _auto_pipe(caplog: pytest.LogCaptureFixture) -> tuple[Any, torch.nn.Module, torch.Tensor, torch.Tensor]:
    caplog.set_level(logging.INFO, logger="partitioner.calibrate.decide")
    model, x, y = _data()
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2, placement="auto")
    return pipe, model, x, y


def test_a_contradicted_auto_choice_is_reverted_and_the_pipe_still_equals_the_model(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pipe, model, x, y = _auto_pipe(caplog)
    reference = copy.deepcopy(model)
    first = pipe.plan.placement
    other = "pipeline" if first == "branches" else "branches"

    def fake(p: Any, steps: int, call: StepCall) -> Measurement:  # the running choice 10x slower, far off predictions
        return Measurement(10000.0 if p.plan.placement == first else 1000.0, measure_steps(p, steps, call).trace)

    hook_of(pipe).measure = fake
    report = pipe.calibrate(steps=1)
    assert report.replanned and pipe.plan.placement == other
    assert report.candidates[first].measured_ms == 10000.0 and report.candidates[other].measured_ms == 1000.0
    assert pipe.plan.alternatives[f"{other} measured"] == 1000.0
    logged = [r.getMessage() for r in caplog.records if "measured" in r.getMessage()]
    assert logged and "10000.00" in logged[-1] and "1000.00" in logged[-1] and f"keeping {other}" in logged[-1]
    loss = pipe.train_step(x, y, F.cross_entropy)
    ref_loss = F.cross_entropy(reference(x), y)
    ref_loss.backward()
    ref = dict(reference.named_parameters())
    assert rel(loss, ref_loss.detach()) < 1e-5
    assert max(rel(p.grad, ref[n].grad) for n, p in model.named_parameters()) < 1e-5


def test_a_challenger_that_measures_slower_is_not_taken(caplog: pytest.LogCaptureFixture) -> None:
    pipe, model, x, y = _auto_pipe(caplog)
    first = pipe.plan.placement
    stages = [s.nodes for s in pipe.plan.stages]

    def fake(p: Any, steps: int, call: StepCall) -> Measurement:  # the running choice measures 10x faster
        return Measurement(10000.0 if p.plan.placement == first else 100000.0, measure_steps(p, steps, call).trace)

    hook_of(pipe).measure = fake
    report = pipe.calibrate(steps=1)
    assert not report.replanned and report.chosen == report.previous
    assert pipe.plan.placement == first and [s.nodes for s in pipe.plan.stages] == stages
    assert any(c.measured_ms == 100000.0 for c in report.candidates.values())


@pytest.mark.parametrize("agrees", [True, False])
def test_a_challenger_measured_faster_by_less_than_the_noise_is_taken_only_where_predicted_faster(
    agrees: bool, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 8% faster, each median with a 5% standard error: their difference's is 7.1%. That beats it once
    # (the calibrated simulator also says the challenger is faster) but not twice (it says the opposite).
    import partitioner.calibrate.decide as decide

    pipe, model, x, y = _auto_pipe(caplog)
    first = pipe.plan.placement
    real = decide.fit_and_rank

    def ranked(*args: Any, **kwargs: Any) -> dict[str, Any]:  # the calibrated prediction, one way or the other
        decided = real(*args, **kwargs)
        cands, current = decided["cands"], decided["current"]
        assert decided["challenger"] is not None
        cands[decided["challenger"]].predicted_after_ms = cands[current].predicted_after_ms * (0.5 if agrees else 1.5)
        return decided

    def fake(p: Any, steps: int, call: StepCall) -> Measurement:
        return Measurement(1000.0 if p.plan.placement == first else 920.0, measure_steps(p, steps, call).trace, 0.05)

    monkeypatch.setattr(decide, "fit_and_rank", ranked)
    hook_of(pipe).measure = fake
    report = pipe.calibrate(steps=1)
    other = next(n for n in report.candidates if n != first)
    assert report.replanned == agrees and pipe.plan.placement == (other if agrees else first)
    assert report.within_noise == (not agrees) and not report.reverted
    if not agrees:
        assert f"kept {first} ({other} measured faster, within the measurements' noise)" in str(report)


def test_a_given_calibration_path_starts_fresh_not_from_the_machines_file(tmp_path: Path) -> None:
    model, x, y = _data()
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2)
    machine = Path(pipe.calibrate(steps=1, inputs=(x,), targets=y, loss_fn=F.cross_entropy).path)
    Calibration(step_ms=10000.0, runs=1.0).save(machine)  # another run's figures (another loop, model, load)
    own = tmp_path / "own.json"
    again = partition(copy.deepcopy(model), ["cpu", "cpu"], example_inputs=(x,), micro_batches=2, calibration=own)
    report = again.calibrate(steps=1, inputs=(x,), targets=y, loss_fn=F.cross_entropy)
    assert Path(report.path) == own and report.fitted["step_ms"] < 1000.0
    assert Calibration.load(machine).step_ms == 10000.0


class _Counting:
    """A stand-in pipe that counts its training steps (measure_steps's view of a pipe)."""

    def __init__(self, stepped: bool) -> None:
        self.tracing, self.steps = False, 0
        self.last_step = object() if stepped else None

    def train_step(self, *args: Any) -> None:
        self.steps += 1

    def clear_trace(self) -> None:
        pass

    def measured_timeline(self) -> dict[str, Any]:
        return {"devices": []}


def test_a_pipe_that_never_stepped_runs_one_untimed_step_first() -> None:
    call = StepCall((torch.zeros(1),), None, F.cross_entropy)
    fresh, used = _Counting(stepped=False), _Counting(stepped=True)
    measure_steps(fresh, 3, call)
    measure_steps(used, 3, call)
    assert (fresh.steps, used.steps) == (4, 3)


def test_one_slow_step_does_not_make_the_median_noisy() -> None:
    from partitioner.calibrate.measure import step_statistics

    median, noise = step_statistics([100.0, 101.0, 99.0, 102.0, 250.0])  # another process took the core once
    assert median == 101.0 and noise < 0.02
    median, noise = step_statistics([90.0, 95.0, 100.0, 105.0, 110.0])
    assert noise == pytest.approx(1.2533 * 10.0 / 1.349 / 5**0.5 / 100.0)
    assert step_statistics([5.0, 7.0]) == (6.0, 0.0)


def test_the_cli_command_calibrates_and_writes_the_json(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from partitioner.cli.main import main

    monkeypatch.chdir(ROOT)
    out = tmp_path / "cal.json"
    code = main(["calibrate", "tests.test_calibrate:make_small", "--devices", "cpu,cpu", "--steps", "1",
                 "--micro-batches", "2", "--placement", "auto", "--out", str(out), "--quiet"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "factors" in text and "predicted" in text and "measured" in text and "torchrun" in text
    assert Calibration.load(out).factor("cpu") > 0


def test_the_page_shows_predicted_and_measured_timelines_with_each_stages_error(tmp_path: Path) -> None:
    model, x, _ = _data()
    made = plan(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=1)
    predicted = {"devices": [{"device": "cpu:0", "events": [
        {"kind": "F", "stage": 0, "microbatch": 0, "start": 0.0, "end": 2.0},
        {"kind": "B", "stage": 0, "microbatch": 0, "start": 2.0, "end": 6.0}]}]}
    measured = {"devices": [{"device": "cpu (worker 0)", "events": [
        {"kind": "forward", "stage": 0, "microbatch": 0, "start": 0.0, "end": 3.0},
        {"kind": "backward", "stage": 0, "microbatch": 0, "start": 3.0, "end": 8.0}]}]}
    data = page_data(made, predicted, measured)
    assert [t["title"].split(" (")[0] for t in data["timelines"]] == ["predicted", "measured"]
    assert data["stage_errors"] == [{"stage": 0, "predicted_ms": 6.0, "measured_ms": 8.0, "error_pct": -25.0}]
    assert "s0 -25%" in data["timelines"][1]["title"]
    page = visualize(made, tmp_path / "plan.html", timeline=predicted, measured=measured).read_text()
    assert 'id="stage-errors"' in page and "-25.0" in page
    pytest.importorskip("matplotlib")
    assert visualize(made, tmp_path / "plan.png", timeline=predicted, measured=measured).stat().st_size > 0


@pytest.mark.parametrize("mode,ranks", [("placement", 2), ("replicas", 3)])
def test_calibrate_under_torchrun_switches_every_rank_consistently(mode: str, ranks: int) -> None:
    from tests.test_distributed import results, torchrun

    proc = torchrun(ranks, mode, worker=str(ROOT / "tests" / "calibrate_worker.py"), timeout=240)
    lines = results(proc.stdout)  # ranks share one pipe: two results may share a line
    assert proc.returncode == 0 and len(lines) == ranks and all("ok=True" in line for line in lines), \
        proc.stdout[-3000:]
