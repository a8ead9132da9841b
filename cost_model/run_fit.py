"""Fit a Calibration's general parameters from one traced run: compute factors, overheads, links, sharing.

Plain data in (a Plan or its `to_json` dict, the runtime's gathered trace in ms), a
`Calibration` out; nothing here imports the runtime or the partitioner. What is fitted:

    compute factor   per device and op kind: least squares of measured over predicted
                     (the stage's forward_ms / backward_ms), each measured op first divided
                     by its processor-sharing slowdown max(1, k / cores), k = ranks of the
                     host computing during it (averaged over the op)
    group factors    with `shares` (each stage's compute by operator group, cost_model.op_mix):
                     per device and kind, a factor per group, how much each other rank of the host
                     computing beside an op slows it, from the same ops
                     (normal equations kept in the Calibration, solved by cost_model.group_fit),
                     so the factors carry to a model with another mix of groups
    cores            the c in that slowdown, by a search over c minimizing the log error, only
                     where more ranks computed at once than the host has cores (else its count);
                     1 where one process ran every stage in one thread (runtime/inline.py), whose
                     messages untraced steps skip: no SEND, RECV or WAKE cost, no link
    task overhead    per rank: time between its traced events, shared out over its F/B/W ops
                     (Python dispatch, autograd set-up); "SEND": the time posting batches with
                     sends ("send" events) per SEND op of the programs; both also as lines growing with
                     the op before them (`lines`, cost_model/overhead_fit.py), which the simulator prefers
    link             latency and bandwidth of the cached loopback measurement (cost_model.links)
    "RECV"           per RECV op, the receiver's own time: posting receive-only batches ("recv" events
                     of the peer's stage) shared over the RECV ops, plus the median take ("recv" events
                     of its own stage) that found its message already landed
    "WAKE"           a rank that blocked on a message resumes this long after the message's modelled
                     arrival (sender's compute end + post + latency + bytes / bandwidth): the mean
                     over blocked takes (with 2 busy ranks and gloo's I/O threads on few cores, the
                     receiver may wait for a core; see tests/test_calibration.py)
    all-reduce       factor "allreduce": the measured span (last post to last wait end) over the
                     price the simulator gives it (`allreduce_base_ms`)
    fixed step cost  step wall time minus the traced span (first event to last, all ranks)

Each parameter is averaged with `previous`'s (weight `runs * decay` against 1 for this run). A calibration
started here forgets at RUN_DECAY: each run counts as much as all before it together, so a machine whose
speed drifts (other work on a shared host) is followed, and a plan's own run dominates its refit.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from typing import Any, Callable, Iterable, Mapping, Sequence

from cost_model import overhead_fit
from cost_model.group_fit import row as group_row
from cost_model.links import loopback_link
from cost_model.machine_params import Calibration
from cost_model.op_mix import Shares

__all__ = ["RUN_DECAY", "allreduce_base_ms", "compute_events", "compute_ops", "fit_run", "plan_dict", "sharing"]

RUN_DECAY = 0.5
_KINDS = {"forward": "F", "backward": "B", "weight": "W", "F": "F", "B": "B", "W": "W"}
_RANK = re.compile(r"\((?:rank|worker) (\d+)\)")
_WAIT = re.compile(r"^W s(\d+) mb(\d+)")


def plan_dict(plan_data: Any) -> dict[str, Any]:
    """A Plan, its `to_json()` text or that text parsed, as a dict.

    Raises:
        TypeError: something else; pass the Plan or `json.loads(plan.to_json())`.
    """
    if hasattr(plan_data, "to_json"):
        return dict(json.loads(plan_data.to_json()))
    if isinstance(plan_data, str):
        return dict(json.loads(plan_data))
    if isinstance(plan_data, Mapping):
        return dict(plan_data)
    raise TypeError(f"plan_data is a {type(plan_data).__name__}; pass a Plan, its to_json() text or that text parsed")


def _steps(trace: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The trace's steps: `trace["steps"]` when it holds several, else the trace itself as one."""
    steps = trace.get("steps")
    return list(steps) if isinstance(steps, list) else [trace]


def _rows(step: Mapping[str, Any]) -> list[tuple[int, list[Mapping[str, Any]]]]:
    """(rank, events sorted by start) of each row; the rank read from '(rank r)' / '(worker r)', else the row."""
    rows = []
    for k, row in enumerate(step.get("devices", [])):
        found = _RANK.search(str(row.get("device", "")))
        events = sorted(row.get("events", []), key=lambda e: float(e["start"]))
        rows.append((int(found.group(1)) if found else k, events))
    return rows


def predicted_op_ms(stage: Mapping[str, Any], kind: str, split: bool) -> float:
    """The plan's price of one op, as the simulator prices it (see partitioner.predict.schedule_sim.compute_ms)."""
    if kind == "F":
        return float(stage.get("forward_ms", 0.0))
    backward = float(stage.get("backward_ms", 0.0))
    if kind == "B" and not split:
        return backward
    weight = backward / 2 if stage.get("reads_from") else backward
    return weight if kind == "W" else backward - weight


def compute_events(plan: Mapping[str, Any], step: Mapping[str, Any]) -> list[tuple[str, str, float, float, float]]:
    """(device, kind, predicted ms, measured ms, ranks computing at once) of every traced F/B/W of a step."""
    return [(device, kind, p, m, k) for device, kind, _, p, m, k in compute_ops(plan, step)]


def compute_ops(plan: Mapping[str, Any], step: Mapping[str, Any]) -> list[tuple[str, str, int, float, float, float]]:
    """(device, kind, stage, predicted ms, measured ms, ranks computing at once) of every traced F/B/W of a step."""
    stages = plan.get("stages", [])
    split = {(int(m.group(1)), int(m.group(2))) for p in plan.get("programs", []) for op in p.get("ops", [])
             if (m := _WAIT.match(str(op)))}
    busy = [(float(e["start"]), float(e["end"])) for _, events in _rows(step) for e in events
            if e.get("kind") in _KINDS]
    out = []
    for _, events in _rows(step):
        for e in events:
            kind = _KINDS.get(str(e.get("kind")))
            s = int(e.get("stage", -1))
            if kind is None or not 0 <= s < len(stages):
                continue
            start, end = float(e["start"]), float(e["end"])
            if end <= start:
                continue
            overlap = sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)  # includes itself once
            split_b = (s, int(e.get("microbatch", -1))) in split
            out.append((str(stages[s].get("device", "cpu")), kind, s, predicted_op_ms(stages[s], kind, split_b),
                        end - start, overlap / (end - start)))
    return out


def sharing(concurrent: float, cores: float) -> float:
    """The slowdown of an op while `concurrent` ranks of its host compute on `cores` cores (0: unlimited)."""
    return max(1.0, concurrent / cores) if cores > 0 else 1.0


def _fit_cores(events: Sequence[tuple[str, str, float, float, float]], default: float) -> float:
    """The cores c that best explain the ops' durations with one factor per (device, kind); `default` if moot."""
    useful = [e for e in events if e[2] > 0 and e[3] > 0]
    if not useful or max(e[4] for e in useful) <= default + 0.05:
        return default  # never more ranks computing than cores: nothing says how they would share
    top = max(default, math.ceil(max(e[4] for e in useful)))

    def error(c: float) -> float:
        groups: dict[tuple[str, str], list[float]] = {}
        for device, kind, p, m, k in useful:
            groups.setdefault((device, kind), []).append(math.log(m / (p * sharing(k, c))))
        return sum(sum((x - statistics.fmean(xs)) ** 2 for x in xs) for xs in groups.values())

    grid = [1.0 + 0.05 * i for i in range(int((top - 1.0) / 0.05) + 1)]
    return min(grid, key=error)


def _one_thread(steps: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the rows are workers of one process whose compute never overlapped: the one-process runtime
    running every program in one thread (runtime/inline.py), its stages handing values over directly."""
    for step in steps:
        rows = list(step.get("devices", []))
        if len(rows) < 2 or any("(worker" not in str(r.get("device", "")) for r in rows):
            return False
        busy = sorted((float(e["start"]), float(e["end"])) for _, events in _rows(step) for e in events
                      if e.get("kind") in _KINDS)
        if any(b[0] < a[1] - 1e-3 for a, b in zip(busy, busy[1:])):
            return False
    return bool(steps)


def _merged(step: Mapping[str, Any], one_thread: bool) -> list[tuple[int, list[Mapping[str, Any]]]]:
    """The step's rows (`one_thread`: their events together, as the one thread that ran them)."""
    rows = _rows(step)
    if one_thread:
        rows = [(0, sorted((e for _, events in rows for e in events), key=lambda e: float(e["start"])))]
    return rows


def _add_line(made: Calibration, key: str, rows: Sequence[tuple[tuple[float, float], float]]) -> None:
    """Fold one run's rows into overhead line `key` (cost_model/overhead_fit.py); older runs decay."""
    if rows:
        made.lines[key] = overhead_fit.add(made.lines.get(key, []), rows, made.decay)


def _overhead_ms(steps: Sequence[Mapping[str, Any]], one_thread: bool = False) -> float | None:
    """Per F/B/W op: each rank's untraced time between its events, over its ops (`one_thread`: the rows'
    events together, as the one thread that ran them)."""
    spare, ops = 0.0, 0
    for step in steps:
        for _, events in _merged(step, one_thread):
            if not events:
                continue
            span = max(float(e["end"]) for e in events) - float(events[0]["start"])
            traced = sum(float(e["end"]) - float(e["start"]) for e in events)
            spare += max(0.0, span - traced)
            ops += sum(1 for e in events if e.get("kind") in _KINDS)
    return spare / ops if ops else None


def _post_ms(plan: Mapping[str, Any], steps: Sequence[Mapping[str, Any]]) -> float | None:
    """Per SEND op of the programs: the time ranks spent posting batches with sends ("send" events)."""
    sends = sum(1 for p in plan.get("programs", []) for op in p.get("ops", []) if str(op).startswith("SEND"))
    posted = sum(float(e["end"]) - float(e["start"]) for step in steps for _, events in _rows(step)
                 for e in events if e.get("kind") == "send")
    return posted / (sends * len(steps)) if sends and steps else None


def _takes(plan: Mapping[str, Any], steps: Iterable[Mapping[str, Any]],
           ) -> tuple[list[tuple[float, float, float, float, float]], float, int]:
    """The receivers' side of the messages: (take start, take end, data ready, bytes, producing op's ms) of each
    take whose producer is traced (ready: the sender's compute end), the ms spent posting receive-only batches,
    and the number of steps. A "recv" event of a rank's own stage is a take (waiting in transport.take);
    one of the peer's stage is the posting of a receive-only batch (see runtime/interpreter.py _post)."""
    stages = plan.get("stages", [])
    takes, posting, count = [], 0.0, 0
    for step in steps:
        count += 1
        by_rank = dict(_rows(step))
        for rank, events in by_rank.items():
            own = {k for k, s in enumerate(stages) if rank in s.get("ranks", [k])}
            for e in events:
                if e.get("kind") != "recv":
                    continue
                dst, start, end = int(e.get("stage", -1)), float(e["start"]), float(e["end"])
                if dst not in own:
                    posting += end - start
                    continue
                if not 0 <= dst < len(stages) or int(e.get("peer", -1)) not in by_rank:
                    continue
                mb, reads = int(e.get("microbatch", -1)), set(stages[dst].get("reads_from", []))
                sent = [(float(x["end"]), int(x["stage"]), float(x["end"]) - float(x["start"]))
                        for x in by_rank[int(e["peer"])]
                        if int(x.get("microbatch", -2)) == mb and (
                            (x.get("kind") == "forward" and int(x["stage"]) in reads)
                            or (x.get("kind") == "backward" and dst in stages[int(x["stage"])].get("reads_from", [])))
                        and float(x["end"]) <= end]
                if sent:
                    ready, src, ms = max(sent)
                    takes.append((start, end, ready, float(stages[max(src, dst)].get("recv_bytes", 0)), ms))
    return takes, posting, count


def _receive_costs(plan: Mapping[str, Any], steps: Sequence[Mapping[str, Any]], post: Callable[[float], float],
                   latency_ms: float, per_ms: float) -> tuple[float | None, float | None]:
    """(receiver's ms per RECV op, wake-up ms) as the simulator charges them (partitioner/predict/simulator.py).

    A message lands at arrival = sender's compute end + its post (`post` of that op's ms) + latency +
    bytes / bandwidth. A take reached after that costs its length (copying out, Python): the median
    (a robust centre, as for the sends' posting: cost_model/overhead_fit.py), with the posting of
    receive-only batches shared over the RECV ops, is the per-RECV cost. A take reached before it
    blocks: the rank resumes (arrival + wake); wake is the mean of (end - arrival) over those, since
    every late wake-up on the critical path delays the step by its full length.
    """
    takes, posting, count = _takes(plan, steps)
    receives = sum(1 for p in plan.get("programs", []) for op in p.get("ops", []) if str(op).startswith("RECV"))
    if not takes or not count:
        return None, None
    arrival = [ready + post(ms) + latency_ms + nbytes / per_ms for _, _, ready, nbytes, ms in takes]
    ready_takes = [end - start for (start, end, *_), a in zip(takes, arrival) if start >= a]
    woken = [end - a for (start, end, *_), a in zip(takes, arrival) if start < a]
    per_take = statistics.median(ready_takes) if ready_takes else 0.0
    recv = (posting / (receives * count) if receives else 0.0) + per_take
    return recv, (max(0.0, statistics.fmean(woken)) if woken else None)


def allreduce_base_ms(plan: Mapping[str, Any], calibration: Calibration, backend: str) -> dict[tuple[int, ...], float]:
    """Each all-reduce group's price before its factor: a ring over `backend`'s link of the weights of the stage
    replicated on exactly those ranks, else what the plan's programs recorded (the simulator prices them alike)."""
    prices: dict[tuple[int, ...], float] = {}
    for program in plan.get("programs", []):
        for op, times in zip(program.get("ops", []), program.get("predicted", []) or [None] * len(program["ops"])):
            if str(op).startswith("AR r"):
                group = tuple(int(r) for r in str(op).split()[1][1:].split(","))
                prices.setdefault(group, float(times[1]) - float(times[0]) if times else 0.0)
    for group in prices:
        nbytes = sum(int(s.get("param_bytes", 0)) for s in plan.get("stages", [])
                     if tuple(sorted(set(s.get("ranks", [])))) == group)
        ring = calibration.allreduce_ms(nbytes, len(group), backend) if nbytes else None
        if ring is not None:
            prices[group] = ring
    return prices


def _allreduce_ms(steps: Iterable[Mapping[str, Any]]) -> float | None:
    """Median over steps of the all-reduces' measured span: last post start to last wait end, over the ranks."""
    spans = []
    for step in steps:
        posts = [float(e["start"]) for _, ev in _rows(step) for e in ev if e.get("kind") == "allreduce"]
        waits = [float(e["end"]) for _, ev in _rows(step) for e in ev if e.get("kind") == "allreduce-wait"]
        if posts and waits:
            spans.append(max(0.0, max(waits) - max(posts)))
    return statistics.median(spans) if spans else None


def _span_ms(step: Mapping[str, Any]) -> float:
    times = [(float(e["start"]), float(e["end"])) for _, events in _rows(step) for e in events]
    return max(b for _, b in times) - min(a for a, _ in times) if times else 0.0


def _blend(old: float, new: float | None, w_old: float) -> float:
    return old if new is None else (old * w_old + new) / (w_old + 1.0)


def fit_run(plan_data: Any, trace: Mapping[str, Any], *, step_ms: float, previous: Calibration | None = None,
            cores: float | None = None, backend: str = "gloo", priced_with: Calibration | None = None,
            shares: Sequence[Shares] | None = None) -> Calibration:
    """`previous` (or a fresh Calibration) refined by one traced run; `previous` itself is not changed.

    Args:
        plan_data: the Plan that ran, or its to_json dict.
        trace: one step's gathered trace ({"devices": [{"device", "events"}]}, ms), or several
            as {"steps": [...]}.
        step_ms: the measured wall time of one of those steps (median), optimizer step included.
        cores: the host's cores (default: fitted where ranks overlapped, else previous, else this machine's).
        backend: the link the messages took.
        priced_with: the calibration whose device factors the plan's stage times already carry
            (planned with CalibratedCostModel): they are divided out, so factors scale the base model.
        shares: each stage's compute by operator group (cost_model.op_mix.stage_shares): group factors too.

    Raises:
        ValueError: step_ms is not positive.
    """
    if not step_ms > 0:
        raise ValueError(f"step_ms={step_ms}; give the measured wall time of a step in ms (> 0)")
    plan = plan_dict(plan_data)
    steps = _steps(trace)
    made = Calibration.from_dict(previous.to_dict()) if previous is not None else Calibration(decay=RUN_DECAY)
    w_old = made.runs * made.decay
    ops = [e for step in steps for e in compute_ops(plan, step)]
    events = [(device, kind, p, m, k) for device, kind, _, p, m, k in ops]
    one_thread = _one_thread(steps)
    if one_thread:  # one process, one thread: its stages run one at a time and hand values over directly
        cores = 1.0
    host_cores = cores if cores is not None else (made.cores or float(os.cpu_count() or 1))
    fitted_cores = host_cores if cores is not None else _fit_cores(events, host_cores)
    made.cores = fitted_cores if w_old == 0 or one_thread else _blend(made.cores, fitted_cores, w_old)
    for sums in made.sums.values():
        sums[0] *= made.decay
        sums[1] *= made.decay
    for eq in made.groups.values():
        for row in eq:
            row[:] = [x * made.decay for x in row]
    rows: dict[str, list[tuple[list[float], float]]] = {}
    for device, kind, s, p, m, k in ops:
        p = p / priced_with.factor(device) if priced_with is not None else p
        if p > 0:
            deflated = m / sharing(k, made.cores)
            made.observe(f"{device}/{kind}", p / 1e3, deflated / 1e3)
            made.observe(device, p / 1e3, deflated / 1e3)
            if shares is not None and s < len(shares) and shares[s] and deflated > 0:
                key = f"{device}/{'B' if kind == 'W' else kind}"
                others = max(0.0, (min(k, made.cores) if made.cores > 0 else k) - 1.0)  # beyond cores: sharing
                rows.setdefault(key, []).append((group_row(p, shares[s], others), deflated))
    for key, group_rows in rows.items():
        made.add_group_rows(key, group_rows)
    overhead = _overhead_ms(steps, one_thread)
    if overhead is not None:
        for kind in ("F", "B", "W"):
            made.task_ms[kind] = _blend(made.task_ms.get(kind, 0.0), overhead, w_old)
    ranks = [[events for _, events in _merged(step, one_thread)] for step in steps]
    _add_line(made, "task", [r for step in ranks for r in overhead_fit.task_rows(step, _KINDS)])
    if one_thread:  # untraced steps skip the messages between its stages (only a trace posts them)
        for key in ("SEND", "RECV", "WAKE"):
            made.task_ms[key] = 0.0
        made.lines.pop("SEND", None)
    else:
        post = _post_ms(plan, steps)
        if post is not None:
            made.task_ms["SEND"] = _blend(made.task_ms.get("SEND", 0.0), post, w_old)
        _add_line(made, "SEND", overhead_fit.send_points([events for step in ranks for events in step], _KINDS))
        latency, per_ms = made.links.get(backend) or _default_link(backend)
        made.links[backend] = [latency, per_ms]  # the cached loopback measurement: a blocked receiver waits "WAKE"
        line, flat = made.line("SEND"), made.task_ms.get("SEND", 0.0)
        recv, wake = _receive_costs(plan, steps, lambda ms: overhead_fit.price(line, ms, flat), latency, per_ms)
        for key, value in (("RECV", recv), ("WAKE", wake)):
            if value is not None:
                made.task_ms[key] = _blend(made.task_ms.get(key, 0.0), value, w_old)
    base = sum(allreduce_base_ms(plan, made, backend).values())
    measured_ar = _allreduce_ms(steps)
    if base > 0 and measured_ar is not None:
        made.observe("allreduce", base / 1e3, measured_ar / 1e3)
    fixed = statistics.median(max(0.0, step_ms - _span_ms(s)) for s in steps)
    made.step_ms = _blend(made.step_ms, fixed, w_old)
    made.runs = w_old + 1.0
    return made


def _default_link(backend: str) -> list[float]:
    """[latency ms, bytes per ms] of `backend`: the cached loopback measurement, else the typical loopback."""
    link = loopback_link(measure=False)
    return [link.latency_s * 1e3, link.bandwidth / 1e3]
