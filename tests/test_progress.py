"""Progress of long phases: one log line per phase, a bar only on a terminal that counts what it says and clears
its line when done, nothing drawn into pipes and files."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

from cost_model import progress as progress_rules
from cost_model.analytic import AnalyticCostModel
from cost_model.progress import LOGGER, Progress, is_terminal, library_call, phase, say
from partitioner import partition, plan
from partitioner.capture.graph import compute_nodes
from partitioner.capture.trace import trace
from partitioner.cli.main import main
from tests import zoo


class Terminal(io.StringIO):
    """A stream that says it is an interactive terminal."""

    def isatty(self) -> bool:
        return True


def test_a_bar_on_a_terminal_counts_whole_units_up_to_its_total_and_clears_its_line() -> None:
    out = Terminal()
    with Progress("profiling 161 nodes on cpu", 161, stream=out) as progress:
        for _ in range(7):  # seven rounds over every node
            progress.advance(161 / 7)
        assert progress._bar is not None and progress._bar.n == 161 and progress.done == 161.0
        progress.advance(5)  # never past the total
        assert progress._bar.n == 161
    written = out.getvalue()
    assert "/161 " in written and "1127" not in written  # counts nodes, not node runs
    assert written.endswith("\r") and written.splitlines()[-1].strip() == ""  # the line is cleared


def test_no_bar_into_a_pipe_or_a_file() -> None:
    out = io.StringIO()
    with Progress("profiling", 10, stream=out) as progress:
        progress.advance(10)
    assert out.getvalue() == "" and progress.done == 10.0
    assert not is_terminal(out) and is_terminal(Terminal())


def test_no_bar_when_asked_for_none_or_nothing_to_count() -> None:
    for progress in (Progress("x", 10, bar=False, stream=Terminal()), Progress("x", 0, stream=Terminal())):
        assert progress._bar is None
        progress.advance(3)
        progress.close()


def test_reset_counts_again() -> None:
    progress = Progress("x", 4, stream=Terminal())
    progress.advance(3)
    progress.reset()
    assert progress.done == 0.0 and progress._bar is not None and progress._bar.n == 0
    progress.close()


def test_a_phase_is_one_info_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with phase("profiling 3 nodes on cpu", total=3, bar=False) as progress:
            progress.advance(3)
        say("planning 2 stages")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        (LOGGER, logging.INFO, "profiling 3 nodes on cpu"),
        (LOGGER, logging.INFO, "planning 2 stages"),
    ]


def test_the_command_line_in_a_pipe_says_each_phase_on_a_line_of_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a terminal (pytest captures stderr as a pipe would): no bar, no spinner, one line per phase as it starts."""
    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(tmp_path))
    assert main(["plan", "tests.zoo:mlp", "--devices", "cpu,cpu", "--profile"]) == 0
    out, err = capsys.readouterr()
    model, args, kwargs = zoo.mlp()
    nodes = len(compute_nodes(trace(model, args, kwargs).graph_module))
    assert "\r" not in err and "\r" not in out
    lines = err.splitlines()
    planning = "planning on 2 devices (7 samples, 1 micro-batches)"
    assert lines[0] == "loading tests.zoo:mlp ..." and lines[1].startswith("loading tests.zoo:mlp: ")
    assert lines[2:6] == [f"{planning} ...", "tracing MLP",
                          f"planning {nodes} nodes on 2 devices (gpipe, 1 micro-batches)",
                          f"profiling {nodes} nodes on cpu (7 runs each)"]
    assert lines[6].startswith(f"{planning}: ")
    assert out.splitlines()[0].strip() == "tests.zoo:mlp: 2 stages"  # the table starts on a line of its own
    assert main(["plan", "tests.zoo:mlp", "--devices", "cpu,cpu", "--profile", "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    assert logging.getLogger(LOGGER).handlers == []  # the command line's handler is gone after it


# --- [Note: progress by default]: what a Python caller who configured no logging sees on stderr ---


@pytest.fixture
def unconfigured(monkeypatch: pytest.MonkeyPatch) -> logging.Logger:
    """Logging as a plain script has it: no handler anywhere. The module's logger is swapped for one outside
    logging's registry: pytest 9.2 adds its capture handlers to every registered logger that does not propagate, at
    each test's call, after fixtures ran (pytest 9.0 left them on the root only)."""
    log = logging.Logger(LOGGER)
    log.propagate = False
    monkeypatch.setattr(progress_rules, "log", log)
    monkeypatch.delenv("RANK", raising=False)
    return log


def test_a_phase_still_running_after_slow_s_is_one_line_on_stderr(
    unconfigured: logging.Logger, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress_rules, "SLOW_S", 0.0)  # every phase is long: its timer fires at once
    say("tracing Outside")  # not inside a library call: nothing
    assert progress_rules._DEFAULT.timer is None
    with library_call():
        say("tracing Slow")
        timer = progress_rules._DEFAULT.timer
        assert timer is not None
        timer.join()  # the phase ran past SLOW_S
    assert capsys.readouterr().err == "partitioner: tracing Slow ...\n"


def test_a_quick_call_says_nothing_and_its_last_phase_ends_with_it(
    unconfigured: logging.Logger, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # "quick" by the rule, not by the machine: on a loaded CI box tracing a tiny MLP once took past SLOW_S
    monkeypatch.setattr(progress_rules, "SLOW_S", 3600.0)
    model, args, _ = zoo.mlp()
    partition(model, ["cpu", "cpu"], example_inputs=args, cost_model=AnalyticCostModel())
    assert progress_rules._DEFAULT.timer is None and progress_rules._DEFAULT.calls == 0  # no line after the call
    assert capsys.readouterr().err == ""


def test_level_info_says_every_phase_as_it_starts_and_warning_silences_it(
    unconfigured: logging.Logger, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, args, _ = zoo.mlp()
    unconfigured.setLevel(logging.INFO)
    plan(model, ["cpu", "cpu"], example_inputs=args, cost_model=AnalyticCostModel())
    nodes = len(compute_nodes(trace(model, args).graph_module))
    assert capsys.readouterr().err.splitlines() == [
        "partitioner: tracing MLP", f"partitioner: planning {nodes} nodes on 2 devices (gpipe, 1 micro-batches)"]
    unconfigured.setLevel(logging.WARNING)
    monkeypatch.setattr(progress_rules, "SLOW_S", 0.0)
    with library_call():
        say("tracing Silenced")
        assert progress_rules._DEFAULT.timer is None
    plan(model, ["cpu", "cpu"], example_inputs=args, cost_model=AnalyticCostModel())
    assert capsys.readouterr().err == ""


def test_logging_configured_by_the_program_gets_the_lines_and_stderr_none(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pytest configures logging, as a program that calls basicConfig does: its handlers decide, never stderr."""
    monkeypatch.setattr(progress_rules, "SLOW_S", 0.0)
    model, args, _ = zoo.mlp()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        plan(model, ["cpu", "cpu"], example_inputs=args, cost_model=AnalyticCostModel())
        with library_call():
            say("tracing Configured")
            assert progress_rules._DEFAULT.timer is None
    assert "tracing MLP" in [r.getMessage() for r in caplog.records]
    assert capsys.readouterr().err == ""
