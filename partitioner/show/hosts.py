"""Timeline rows as people read a cluster: folded replicas as one row, rows under their host's heading.

The simulator already folds identical data-parallel replicas into one row standing for R
ranks (partitioner/predict/replica_fold.py); this names that row "ranks 0-7 (x8)" and, when the plan
knows its hosts (`Plan.gpus_per_host` > 0, ranks host-major), puts each run of rows on the same
hosts under one heading row ("host 1", "hosts 0-1023"). Rows the fold could not merge but that
run the same events are merged here too, and at most `MAX_ROWS` rows are drawn, so a
16,384-rank plan draws in seconds:

    hosts 0-1023                          (heading: no events)
    ranks 0-8191 (x8192) · stage 0        FFFF......BBBB~~
    hosts 1024-2047
    ranks 8192-16383 (x8192) · stage 1    ..FFFFBBBB~.....
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from partitioner.predict.replica_fold import rank_span
from partitioner.show.rows import timeline_data

__all__ = ["MAX_ROWS", "by_host", "host_label", "row_label", "text_rows"]

MAX_ROWS = 256  # rows drawn at most; the rest are counted in a last row


def row_label(ranks: Sequence[int], device: str) -> str:
    """'ranks 0-7 (x8)' for a row standing for several ranks, else the device's own name."""
    if len(ranks) <= 1:
        return device
    return f"ranks {rank_span(ranks)} (x{len(ranks)})"


def host_label(hosts: Sequence[int]) -> str:
    """'host 3' or 'hosts 0-1023': the heading over rows whose ranks sit on `hosts`."""
    if len(hosts) == 1:
        return f"host {hosts[0]}"
    run = list(hosts) == list(range(hosts[0], hosts[-1] + 1))
    return f"hosts {hosts[0]}-{hosts[-1]}" if run else f"hosts {rank_span(hosts)}"


def by_host(data: Mapping[str, Any], timeline: Any, *, gpus_per_host: int) -> dict[str, Any]:
    """`timeline_data` output with rows labelled by the ranks they stand for and grouped under host headings.

    Args:
        data: {"rows": [...], ...} from `partitioner.show.rows.timeline_data(timeline, ...)`.
        timeline: the simulator Timeline it came from (each row's `ranks`); other kinds are
            returned unchanged, as there is no rank to place.
        gpus_per_host: `Plan.gpus_per_host`; 0 (unknown) gives no headings.
    """
    devices = getattr(timeline, "devices", None)
    if devices is None or len(devices) != len(data["rows"]):
        return dict(data)
    rows: list[dict[str, Any]] = []
    for index, (row, d) in enumerate(zip(data["rows"], devices)):
        ranks = [int(r) for r in (getattr(d, "ranks", None) or [index])]
        rows.append({**row, "ranks": ranks, "device": row_label(ranks, str(row["device"]))})
    rows = _merge_same(rows)
    if gpus_per_host > 0:
        rows = _with_headings(rows, gpus_per_host)
    if len(rows) > MAX_ROWS:
        hidden = rows[MAX_ROWS - 1:]
        count = sum(len(r.get("ranks", [])) for r in hidden)
        rows = rows[: MAX_ROWS - 1] + [{"device": f"... {len(hidden)} more rows ({count} ranks)", "stages": [],
                                        "events": [], "heading": True, "ranks": []}]  # fmt: skip
    out = {**data, "rows": rows}
    bubble = getattr(timeline, "bubble_fraction", None)
    if isinstance(bubble, float):  # every rank of a folded row counted, as Timeline.bubble_fraction does
        out["bubble"] = bubble
    return out


def _signature(row: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(row["stages"]), tuple((e["kind"], e["stage"], e["start"], e["end"]) for e in row["events"])


def _merge_same(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive rows whose events differ at most in micro-batch numbers drawn as one row."""
    merged: list[dict[str, Any]] = []
    for row in rows:
        last = merged[-1] if merged else None
        if last is not None and _signature(last) == _signature(row):
            ranks = last["ranks"] + row["ranks"]
            first = last.get("first_device", last["device"])
            merged[-1] = {**last, "ranks": ranks, "device": row_label(ranks, first), "first_device": first}
        else:
            merged.append(row)
    for row in merged:
        row.pop("first_device", None)
    return merged


def _with_headings(rows: list[dict[str, Any]], gpus_per_host: int) -> list[dict[str, Any]]:
    """Rows ordered by their first host, each run of rows on the same hosts under one heading row."""
    def hosts(row: Mapping[str, Any]) -> list[int]:
        return sorted({r // gpus_per_host for r in row["ranks"]})

    out: list[dict[str, Any]] = []
    current: list[int] | None = None
    for row in sorted(rows, key=lambda r: (hosts(r)[:1], min(r["ranks"], default=0))):
        where = hosts(row)
        if where != current:
            out.append({"device": host_label(where), "stages": [], "events": [], "heading": True, "ranks": []})
            current = where
        out.append({**row, "host": where[0] if len(where) == 1 else None})
    return out


def text_rows(timeline: Any, *, gpus_per_host: int, width: int = 48, footer: bool = True) -> str:
    """The grouped rows as text (the CLI's report): host headings, then per row its stages, busy, comm
    and idle ms of one of its ranks and a Gantt strip (F forward, B backward, W weight, ~ comm only);
    `footer`: a last line with the makespan, bubble and how many ranks the rows stand for."""
    data = by_host(timeline_data(timeline, "predicted"), timeline, gpus_per_host=gpus_per_host)
    span = float(data["makespan"]) or 1.0
    rows = data["rows"]
    name_w = max([len(str(r["device"])) for r in rows if not r.get("heading")] + [4]) + 2
    lines = [f"{'row':<{name_w}} {'stages':<8} {'busy ms':>9} {'comm ms':>9} {'idle ms':>9}  timeline"]
    for row in rows:
        if row.get("heading"):
            lines.append(str(row["device"]))
            continue
        events = row["events"]
        busy = sum(e["end"] - e["start"] for e in events if e["kind"] in ("F", "B", "W"))
        comm = sum(e["end"] - e["start"] for e in events if e["kind"] not in ("F", "B", "W"))
        covered = sorted((e["start"], e["end"]) for e in events)
        used, reach = 0.0, 0.0
        for a, b in covered:
            used += max(0.0, b - max(a, reach))
            reach = max(reach, b)
        cells = ["."] * width
        for e in events:
            mark = e["kind"] if e["kind"] in ("F", "B", "W") else "~"
            for c in range(int(e["start"] / span * width + 0.5), min(width, int(e["end"] / span * width + 0.5))):
                if cells[c] == "." or mark != "~":
                    cells[c] = mark
        stages = ",".join(map(str, row["stages"]))
        lines.append(f"  {str(row['device']):<{name_w - 2}} {stages:<8} {busy:>9.3f} {comm:>9.3f} "
                     f"{span - used:>9.3f}  {''.join(cells)}")  # fmt: skip
    if not footer:
        return "\n".join(lines)
    ranks = getattr(timeline, "ranks", None) or sum(len(r.get("ranks", [])) for r in rows)
    drawn = sum(not r.get("heading") for r in rows)
    rows_text = f"{drawn} row{'s' if drawn != 1 else ''}"
    lines.append(f"makespan {span:.3f} ms, bubble {float(data['bubble']):.1%}, {ranks} ranks in {rows_text} "
                 "(identical replicas folded; figures per rank)")
    return "\n".join(lines)
