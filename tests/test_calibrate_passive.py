"""Calibrated by default: a pipeline's first training steps refit the machine's calibration (fake clock, no timing)."""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from models import GPT, GPTConfig  # noqa: E402

from cost_model.calibration import Calibration  # noqa: E402
from cost_model.calibration_store import calibration_path  # noqa: E402
from partitioner import partition  # noqa: E402
from partitioner.calibrate.candidates import same_plan  # noqa: E402
from partitioner.calibrate.decide import hook_of  # noqa: E402
from partitioner.calibrate.passive import STEPS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PERIODS_MS = [40.0, 7.0, 5.0, 5.0, 9.0, 5.0, 5.0, 4.0, 5.0, 6.0]  # step 1 (not counted), then steps 2 .. 10


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibrations written here must not reach other tests' plans (they share the session's cache)."""
    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(tmp_path / "cache"))


class FakeClock:
    """Steps whose work takes PERIODS_MS (seconds), each followed by `loop_ms` of the loop's own work (its
    optimizer step, data) before the next one starts; counts its calls."""

    def __init__(self, loop_ms: float = 1.0) -> None:
        self.calls = 0
        starts = [sum(PERIODS_MS[:k]) + k * loop_ms for k in range(len(PERIODS_MS) + 1)]
        times = [t for k, start in enumerate(starts[:-1]) for t in (start, starts[k + 1] - loop_ms)] + starts[-1:]
        self._times: Iterator[float] = iter([t / 1e3 for t in times])

    def __call__(self) -> float:
        self.calls += 1
        return next(self._times)


def _gpt(tied: bool = True) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, width=32, heads=2, layers=2, seq=8, tied=tied)
    return GPT(cfg), torch.randint(0, 64, (8, 8)), torch.randint(0, 64, (8, 8))


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _train(pipe: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        losses.append(pipe.train_step(x, y, loss_fn))
        opt.step()
    return losses


def test_the_first_steps_refit_the_plan_and_the_steps_are_those_of_a_pipe_without_it(tmp_path: Path) -> None:
    model, x, y = _gpt()
    twin = copy.deepcopy(model)
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2)  # calibrated by default
    plain = partition(twin, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2, calibrate=0)
    watch = hook_of(pipe).watch
    assert watch is not None and hook_of(plain).watch is None and watch.steps == STEPS == 10
    watch.clock = clock = FakeClock()
    before = pipe.plan.predicted_step_ms
    losses = _train(pipe, model, x, y, STEPS + 2)
    assert [float(v) for v in losses] == [float(v) for v in _train(plain, twin, x, y, STEPS + 2)]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))
    assert clock.calls == 2 * STEPS + 1  # each step's start and end, and the refit at step 11's; nothing after
    report = pipe.calibration_report
    assert report.steps == STEPS and report.measured_ms == pytest.approx(5.0)  # steps 2 .. 10 inside train_step
    assert report.predicted_before_ms == before
    assert pipe.plan.predicted_step_ms == pytest.approx(report.predicted_after_ms + 1.0)  # + the loop's own work
    assert pipe.plan.predicted_step_ms != before
    assert pipe.plan.alternatives["measured"] == pytest.approx(6.0)  # the loop's step: start to start
    assert pipe.plan.alternatives["calibrated"] == pipe.plan.predicted_step_ms
    saved = Calibration.load(report.path)
    assert saved.runs == 1.0 and saved.factor("cpu/F") > 0 and saved.group_factors("cpu", "F") is not None
    assert saved.cores == 1.0  # one process ran both stages in one thread
    assert not pipe.tracing and pipe._step_watch is None and watch.done
    assert report.timeline.makespan_ms == pytest.approx(report.predicted_after_ms)  # what the page draws: the step
    assert report.trace is not None and report.visualize(tmp_path / "plan.html").is_file()


def test_the_loops_own_work_between_steps_is_not_saved_as_the_machines() -> None:
    # 100 ms between one step's end and the next one's start (another pipeline's steps, say): this loop's
    # prediction has them, the machine's calibration (which plans every later model here) does not
    model, x, y = _gpt()
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2)
    watch = hook_of(pipe).watch
    assert watch is not None
    watch.clock = FakeClock(loop_ms=100.0)
    _train(pipe, model, x, y, STEPS + 1)
    report = pipe.calibration_report
    saved = Calibration.load(report.path)
    assert saved.step_ms < 5.0 and report.fitted["step_ms"] == saved.step_ms
    assert pipe.plan.predicted_step_ms == pytest.approx(report.predicted_after_ms + 100.0)
    assert pipe.plan.alternatives["measured"] == pytest.approx(5.0 + 100.0)


def test_calibrate_zero_turns_it_off_and_a_number_calibrates_now() -> None:
    model, x, y = _gpt()
    off = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2, calibrate=0)
    _train(off, model, x, y, STEPS + 1)
    assert off._step_watch is None and not hasattr(off, "calibration_report")
    assert not calibration_path(["cpu", "cpu"], processes=False).exists()
    now = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2, calibrate=1)
    assert now.calibration_report.steps == 1 and now._step_watch is None


def test_an_explicit_calibration_replaces_the_watch() -> None:
    model, x, y = _gpt()
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2)
    watch = hook_of(pipe).watch
    assert watch is not None
    watch.clock = FakeClock()
    _train(pipe, model, x, y, 2)
    report = pipe.calibrate(steps=2)
    assert watch.done and pipe._step_watch is None
    _train(pipe, model, x, y, STEPS)
    assert report.steps == 2 and not hasattr(pipe, "calibration_report")


def test_auto_choices_are_predicted_again_and_the_running_plan_kept(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="partitioner.calibrate.decide")
    model, x, y = _gpt()
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2, schedule="auto")
    running = copy.deepcopy(pipe.plan)
    watch = hook_of(pipe).watch
    assert watch is not None
    watch.clock = FakeClock()
    _train(pipe, model, x, y, STEPS + 1)
    report = pipe.calibration_report
    assert len(report.candidates) > 1 and {"gpipe", "1f1b"} <= set(report.candidates)
    assert all(pipe.plan.alternatives[f"{n} calibrated"] > 0 for n in report.candidates)
    assert same_plan(pipe.plan, running) and not report.replanned
    assert any("calibrated from the first 10 steps" in r.getMessage() for r in caplog.records)


def test_a_plan_with_asynchronous_updates_is_not_watched() -> None:
    model, x, y = _gpt(tied=False)  # 2BW refuses a weight two stages read
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2, schedule="1f1b", update="2bw")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pipe.train_step(x, y, loss_fn, optimizer=opt)
    assert pipe._step_watch is None and not hasattr(pipe, "calibration_report")


@pytest.mark.parametrize("mode", ["plain", "auto"])
def test_under_torchrun_every_rank_refits_alike_and_trains_as_the_plain_model(mode: str) -> None:
    from tests.test_distributed import results, torchrun

    proc = torchrun(2, mode, worker=str(ROOT / "tests" / "passive_worker.py"), timeout=240)
    lines = results(proc.stdout)
    assert proc.returncode == 0 and len(lines) == 2 and all("ok=True" in line for line in lines), \
        proc.stdout[-3000:]
