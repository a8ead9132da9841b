"""Many cases of one torchrun worker in one launch, each case still passing or failing on its own.

A launch costs every rank an `import torch` and `import partitioner` (6-8 s each, more when 4 ranks share CI's 2
cores), so a test file whose tests each launched the same worker on the same ranks launches it once from a module
fixture instead:

    test file (pytest)                          worker, on every rank (torchrun)
    ──────────────────                          ────────────────────────────────
    write_jobs(dir, [Job(...), ...])  ──────►   serve(spec, handlers): for each job, in order:
    torchrun(ranks, "batch", spec, ...)           set the job's environment, call handlers[mode](*args),
                                                  keep its RESULT lines, its verdict and any traceback,
    Launch.read(dir, proc)            ◄──────     rewrite dir/rank{r}.json (a crash keeps the jobs before it)
    launch.lines(job id), per test

Each job's process groups (pipelines, meshes, expert and context groups) are destroyed after it, once every rank
has ended it: gloo keeps threads and sockets per group, and 44 jobs' worth left 850-960 threads on each rank
(a load average of 171 on 2 cores; with this, at most ~320, and test_split_layers.py ran in 367 s, was 427 s).
A job that raises is recorded and the next one runs. A job missing from a rank's record (the launch crashed there,
or hung: a job that raised on some ranks only can leave the others waiting, until the launch's timeout) fails the
tests of that job and of the jobs after it, with the launch's output.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, TextIO

__all__ = ["Job", "Launch", "serve", "write_jobs"]

SPEC = "jobs.json"


@dataclass
class Job:
    """One call of a worker's mode: `handlers[mode](*args)` under `env` (put back after it)."""

    id: str
    mode: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def write_jobs(directory: Path, jobs: list[Job]) -> str:
    """Write the jobs for `serve` into `directory` (where the ranks write their records too); the spec's path."""
    ids = [job.id for job in jobs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"job ids must be unique, got {ids}")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / SPEC
    path.write_text(json.dumps([asdict(job) for job in jobs]))
    return str(path)


def results(output: str) -> list[str]:
    # the same pattern as tests.test_distributed.results (kept here so that workers need not import pytest)
    return re.findall(r"RESULT .*?ok=(?:True|False)", output)


class _Tee(io.TextIOBase):
    """Writes to the process's stdout and keeps a copy (the job's RESULT lines)."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.kept = out, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def _threads() -> int:
    """This process's thread count (Linux; 0 where /proc is missing)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


def _groups() -> set[Any]:
    import torch.distributed as dist

    return set(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else set()


def _end_groups(kept: set[Any]) -> None:
    """Destroy the groups made since `kept` was taken, after a barrier: a peer may still read from them.

    DTensor's caches key meshes by their ranks and names, not their groups: a later job's mesh over the same ranks
    would get the destroyed groups back from them (its DTensors' specs, redistribution planners), so they go too."""
    import torch.distributed as dist

    made = _groups() - kept
    if not made:
        return
    dist.barrier()
    default = dist.distributed_c10d._get_default_group()
    for group in made:
        if group is not default:
            dist.destroy_process_group(group)
    import torch
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute, _sharding_prop
    from torch.distributed.tensor._ops import single_dim_strategy

    propagator = DTensor._op_dispatcher.sharding_propagator
    for clear in (  # the op cache is per thread: a new one drops every thread's
            lambda: setattr(propagator, "propagate_op_sharding",
                            _sharding_prop.LocalLRUCache(propagator.propagate_op_sharding_non_cached)),
            lambda: torch._C._clear_DTensor_sharding_propagator_cache(),  # C++ dispatch's own op cache
            lambda: type(propagator)._propagate_tensor_meta_cached.cache_clear(),
            lambda: single_dim_strategy._cached_create_expanded_strategy.cache_clear(),  # type: ignore[attr-defined]
            lambda: _redistribute._gen_transform_infos.cache_clear(),
            lambda: _redistribute._planner_cache.clear(),
            lambda: _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()):
        with contextlib.suppress(AttributeError):  # another torch release names its caches otherwise
            clear()


def serve(spec: str, handlers: Mapping[str, Callable[..., Any]], rank: int) -> int:
    """Run every job of `spec` on this rank; 0 where every job returned True or 0, else 1.

    Each job's record (`ok`, `lines`, `error`, `seconds`) lands in `rank{rank}.json` beside the spec as soon as it ends.
    """
    jobs = [Job(**job) for job in json.loads(Path(spec).read_text())]
    out = Path(spec).parent / f"rank{rank}.json"
    records: dict[str, dict[str, Any]] = {}
    for job in jobs:
        before = {k: os.environ.get(k) for k in job.env}
        os.environ.update(job.env)
        tee = _Tee(sys.stdout)
        error, start, kept = None, time.monotonic(), _groups()
        try:
            with contextlib.redirect_stdout(tee):
                verdict = handlers[job.mode](*job.args)
            ok = verdict if isinstance(verdict, bool) else verdict == 0
        except Exception:  # noqa: BLE001 - recorded for the job's own test; the next job runs
            ok, error = False, traceback.format_exc()
            print(f"job {job.id} raised on rank {rank}:\n{error}", flush=True)
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        try:
            _end_groups(kept)
        except Exception:  # noqa: BLE001 - a job that broke its groups: said, and the next job runs
            print(f"job {job.id}: its process groups could not be destroyed on rank {rank}:\n"
                  f"{traceback.format_exc()}", flush=True)
        records[job.id] = {"ok": ok, "lines": results(tee.kept.getvalue()), "error": error,
                           "seconds": time.monotonic() - start, "threads": _threads()}
        partial = out.with_suffix(".tmp")
        partial.write_text(json.dumps(records))
        os.replace(partial, out)
    return 0 if all(r["ok"] for r in records.values()) else 1


@dataclass
class Launch:
    """What one batch launch left: its exit code, its output and every rank's records."""

    returncode: int
    output: str
    records: dict[int, dict[str, dict[str, Any]]]

    @classmethod
    def read(cls, directory: Path, proc: subprocess.CompletedProcess[str], ranks: int) -> Launch:
        records = {}
        for rank in range(ranks):
            path = directory / f"rank{rank}.json"
            records[rank] = json.loads(path.read_text()) if path.exists() else {}
        return cls(proc.returncode, proc.stdout, records)

    def lines(self, job: str) -> list[str]:
        """Every rank's RESULT lines of `job`, once every rank finished it without raising and its worker passed it
        (what a launch of the job alone checked with its exit code); a failure names the job, the rank and its
        traceback, its lines, or the launch's output where the rank never finished the job."""
        for rank, records in self.records.items():
            record = records.get(job)
            assert record is not None, (
                f"job {job!r} never finished on rank {rank} (launch exit {self.returncode}):\n{self.output[-4000:]}")
            assert record["error"] is None, f"job {job!r} raised on rank {rank}:\n{record['error']}"
            assert record["ok"], f"job {job!r} failed on rank {rank}:\n" + "\n".join(record["lines"])
        # the launch's exit code: a job's failure explains a non-zero one, nothing else does
        failed = any(not r["ok"] for records in self.records.values() for r in records.values())
        assert self.returncode == 0 or failed, (
            f"every job passed but the launch exited {self.returncode}:\n{self.output[-4000:]}")
        return [line for rank in sorted(self.records) for line in self.records[rank][job]["lines"]]

    def seconds(self, job: str) -> float:
        """The longest any rank took over `job` (call `lines` first)."""
        return max(records[job]["seconds"] for records in self.records.values())
