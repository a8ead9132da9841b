"""Multi-process runs on gloo under NCCL's rules: equal to single-process training, checkpoints, failures."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runtime.distributed import NCCL_RULES_ENV
from tests import dist_worker
from tests.batch import Job, Launch, write_jobs

WORKER = str(Path(__file__).resolve().parent / "dist_worker.py")
ROOT = str(Path(__file__).resolve().parent.parent)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(
    ranks: int, *args: str, extra: tuple[str, ...] = (), timeout: float = 240, nccl_rules: bool = True,
    worker: str = WORKER, fail_on_timeout: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run `worker` (default tests/dist_worker.py) on `ranks` gloo processes; with `nccl_rules`, every message
    obeys NCCL's rules (runtime.nccl_rules), so a protocol that would hang under NCCL fails here instead. Past
    `timeout` the launch is stopped and the test fails (or, without `fail_on_timeout`, the launch returns exit code
    -SIGKILL and its output)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *extra,
           worker, *args]
    env = {**os.environ, NCCL_RULES_ENV: "1" if nccl_rules else "0"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True, env=env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = stop(proc) + f"\ntorchrun timed out after {timeout} s"
        if fail_on_timeout:
            pytest.fail(out[-3000:])
        return subprocess.CompletedProcess(cmd, -signal.SIGKILL, out, "")
    except BaseException:  # pytest-timeout's own limit, Ctrl-C: the ranks must not outlive the test
        stop(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def stop(proc: subprocess.Popen[str]) -> str:
    """Stop a torchrun launch and its ranks; what it printed. The ranks run in sessions of their own, so killing
    torchrun's process group would leave them running (and loading CI's 2 cores): SIGTERM makes torchrun stop them
    first, SIGKILL follows where it does not exit."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=45)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    return out


def launch_jobs(ranks: int, jobs: list[Job], directory: Path, *, worker: str, timeout: float,
                nccl_rules: bool = True) -> Launch:
    """Run `jobs` (tests/batch.py) in one launch of `worker` on `ranks` processes; each test reads its own job's
    records from the result. A launch killed at `timeout` keeps the records of the jobs that finished."""
    proc = torchrun(ranks, "batch", write_jobs(directory, jobs), worker=worker, timeout=timeout,
                    nccl_rules=nccl_rules, fail_on_timeout=False)  # the jobs that finished pass or fail on their own
    return Launch.read(directory, proc, ranks)


def results(output: str) -> list[str]:
    # ranks write to one pipe: a result may share its line with a progress bar or another rank
    return re.findall(r"RESULT .*?ok=(?:True|False)", output)


def check_equivalence(ranks: int, cases: list[str], nccl_rules: bool = True) -> None:
    run = torchrun(ranks, "equivalence", *cases, nccl_rules=nccl_rules)
    lines = results(run.stdout)
    assert run.returncode == 0 and len(lines) == ranks * len(cases), run.stdout[-4000:]
    assert all("ok=True" in line for line in lines), "\n".join(lines)


# The 2-rank cases of the tests below, run in one launch of tests/dist_worker.py (tests/batch.py): a launch costs
# each rank an import of torch and partitioner; each test checks its own jobs
EVERY_SCHEDULE = ["tiny_gpt:gpipe:-", "tiny_gpt:1f1b:-", "tiny_gpt:interleaved:-", "tiny_gpt:zb1:-", "tiny_gpt:zbv:-",
                  "tiny_gpt:dualpipev:-", "inception:1f1b:-", "inception:gpipe:-:branches",
                  "mode_dependent:1f1b:-:pipeline:eval"]
PLAIN = ["tiny_gpt:1f1b:-", "inception:gpipe:-:branches"]
RECOMPUTE = ["tiny_gpt:1f1b:-:recompute=full", "tiny_gpt:gpipe:-:recompute=selective",
             "inception:1f1b:-:recompute=selective"]
LAUNCH_S = 600  # the whole launch; the first test waits for it


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    directory = tmp_path_factory.mktemp("distributed")
    jobs = [*(Job(f"equivalence {c}", "equivalence", [c]) for c in [*EVERY_SCHEDULE, *RECOMPUTE]),
            # the production path (runtime.comm.TorchComm), without the NCCL-rules emulation
            *(Job(f"plain {c}", "equivalence", [c], {NCCL_RULES_ENV: "0"}) for c in PLAIN),
            Job("checkpoint", "checkpoint", [str(directory / "ckpt")]),
            Job("infeasible", "infeasible")]
    return launch_jobs(2, jobs, directory, worker=WORKER, timeout=LAUNCH_S)


def check_jobs(launch: Launch, prefix: str, cases: list[str]) -> None:
    lines = [line for case in cases for line in launch.lines(f"{prefix} {case}")]
    assert len(lines) == 2 * len(cases), "\n".join(lines)
    assert all("ok=True" in line for line in lines), "\n".join(lines)


@pytest.mark.timeout(LAUNCH_S + 60)
def test_two_ranks_every_schedule(two_ranks: Launch) -> None:
    # mode_dependent: partitioned in training, trained in eval (the eval graph runs)
    check_jobs(two_ranks, "equivalence", EVERY_SCHEDULE)


@pytest.mark.timeout(LAUNCH_S + 60)
def test_two_ranks_plain_torch_distributed(two_ranks: Launch) -> None:
    # the production path (runtime.comm.TorchComm), without the NCCL-rules emulation
    check_jobs(two_ranks, "plain", PLAIN)


def test_three_ranks_schedules_and_uneven_replicas() -> None:
    # [2,1]: stage 0 on ranks 0 and 1 taking micro-batches in turn, stage 1 on rank 2
    check_equivalence(3, ["tiny_gpt:gpipe:-", "tiny_gpt:1f1b:-", "tiny_gpt:gpipe:[2,1]", "tiny_gpt:1f1b:[2,1]",
                          "tiny_gpt:zb1:[2,1]", "in_place:1f1b:-"])  # in-place writes on one rank, read on another


def test_four_ranks_schedules_and_two_by_two_replicas() -> None:
    check_equivalence(
        4,
        ["tiny_gpt:1f1b:-", "tiny_gpt:interleaved:-", "tiny_gpt:gpipe:[2,2]", "tiny_gpt:1f1b:[2,2]",
         "inception:gpipe:-",
         "tiny_gpt:1f1b:auto"],  # auto: the hybrid planner picks stages and replicas
    )


@pytest.mark.timeout(LAUNCH_S + 60)
def test_checkpoint_round_trip_into_another_plan(two_ranks: Launch) -> None:
    lines = two_ranks.lines("checkpoint")
    assert len(lines) == 2, "\n".join(lines)
    assert all("ok=True" in line for line in lines), "\n".join(lines)
    assert re.search(r"after=\[[\d.]+, [\d.]+, [\d.]+\]", "\n".join(lines))  # the last stage saw 3 losses


def test_killed_rank_is_named_by_every_other_rank_within_60_s(tmp_path: Path) -> None:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "3",
           "PYTHONPATH": ROOT, NCCL_RULES_ENV: "1"}
    start = time.monotonic()
    procs = [
        subprocess.Popen([sys.executable, WORKER, "fault", "1"], env={**env, "RANK": str(r)}, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for r in range(3)
    ]
    outputs, codes, elapsed = {}, {}, {}
    for r, p in enumerate(procs):
        try:
            outputs[r], _ = p.communicate(timeout=max(1.0, 90 - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            outputs[r], _ = p.communicate()
        codes[r], elapsed[r] = p.returncode, time.monotonic() - start
    assert codes[1] == -signal.SIGKILL
    for r in (0, 2):
        assert codes[r] != 0 and elapsed[r] < 60, (r, codes[r], elapsed[r], outputs[r][-2000:])
        assert "PeerError: rank 1 (stage 1) failed or stopped answering" in outputs[r], outputs[r][-2000:]


def test_torchrun_restart_resumes_from_the_last_checkpoint(tmp_path: Path) -> None:
    losses_file = tmp_path / "losses.txt"
    run = torchrun(2, "resume", str(tmp_path), str(losses_file), extra=("--max-restarts=1",))
    assert run.returncode == 0, run.stdout[-4000:]
    rows = [line.split() for line in losses_file.read_text().splitlines()]
    by_step = {int(step): (int(attempt), float(loss)) for attempt, step, loss in rows}
    assert sorted(by_step) == list(range(6)) and by_step[5][0] == 1  # steps 4 and 5 ran after the restart

    model, x, y = dist_worker.data("tiny_gpt")  # the same 6 steps in one process, uninterrupted
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(6):
        opt.zero_grad()
        loss = dist_worker.lm_loss(model(x), y)
        loss.backward()
        opt.step()
        assert abs(by_step[step][1] - loss.item()) <= 1e-5 * abs(loss.item()), step


@pytest.mark.timeout(LAUNCH_S + 60)
def test_a_planning_error_on_rank_0_reaches_every_rank(two_ranks: Launch) -> None:
    lines = two_ranks.lines("infeasible")  # each rank would otherwise wait 120 s for the plan
    assert len(lines) == 2 and all("ok=True" in line for line in lines), "\n".join(lines)
    assert any("InfeasibleError" in line for line in lines) and any("rank 0 could not plan" in line for line in lines)
    assert two_ranks.seconds("infeasible") < 100


@pytest.mark.timeout(LAUNCH_S + 60)
def test_two_ranks_recompute_activations(two_ranks: Launch) -> None:
    # the torchrun runtime recomputes too: full and selective, GPipe and 1F1B, equal to full-batch training
    check_jobs(two_ranks, "equivalence", RECOMPUTE)
