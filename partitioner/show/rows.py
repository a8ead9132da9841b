"""Timelines as rows of events: the plain data that the pictures and the command line's text draw.

A simulator Timeline, or a measured trace as plain data, becomes
{"title", "makespan", "bubble", "rows": [{"device", "stages", "events": [{kind, stage, mb, start, end}]}]};
partitioner/show/hosts.py then labels and groups the rows by host.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

__all__ = ["timeline_data"]

_KINDS = {
    "F": "F", "forward": "F", "fwd": "F", "compute-forward": "F",
    "B": "B", "backward": "B", "bwd": "B", "compute-backward": "B",
    "W": "W", "weight": "W", "compute-weight": "W",
    "send": "send", "recv": "recv", "allreduce": "allreduce", "all-reduce": "allreduce",
}  # fmt: skip


def _field(obj: Any, name: str, default: Any = None) -> Any:
    return obj.get(name, default) if isinstance(obj, Mapping) else getattr(obj, name, default)


def timeline_data(timeline: Any, title: str) -> dict[str, Any]:
    """A Timeline (simulator), or a trace as plain data, as rows of events for drawing.

    Accepted: anything with `devices`, each with `device` and `events` (objects or dicts with
    kind, stage, microbatch, start, end in ms); or a flat list of such events that also name
    their `device`. Kinds: F/forward, B/backward, send, recv, allreduce; idle is skipped.
    """
    devices = _field(timeline, "devices")
    if devices is None and isinstance(timeline, Sequence):
        by_device: dict[str, list[Any]] = {}
        for e in timeline:
            by_device.setdefault(str(_field(e, "device", "?")), []).append(e)
        devices = [{"device": d, "events": evs} for d, evs in by_device.items()]
    if devices is None:
        raise TypeError(
            f"cannot draw a timeline from {type(timeline).__name__}; pass a simulator Timeline or "
            "{'devices': [{'device': ..., 'events': [{kind, stage, microbatch, start, end}]}]}"
        )
    rows, makespan, busy = [], 0.0, 0.0
    for d in devices:
        events: list[dict[str, Any]] = []
        for e in _field(d, "events", []):
            kind = _KINDS.get(str(_field(e, "kind", "")))
            if kind is None:
                continue
            start = float(_field(e, "start", _field(e, "start_ms", 0.0)))
            end = float(_field(e, "end", _field(e, "end_ms", start)))
            events.append({"kind": kind, "stage": int(_field(e, "stage", -1)), "mb": int(_field(e, "microbatch", -1)),
                           "start": start, "end": end})  # fmt: skip
            makespan = max(makespan, end)
            busy += end - start if kind in ("F", "B", "W") else 0.0
        stages = sorted({e["stage"] for e in events if e["stage"] >= 0})
        rows.append({"device": str(_field(d, "device", "")), "stages": stages, "events": events})
    makespan = float(_field(timeline, "makespan_ms", None) or makespan)
    bubble = 1.0 - busy / (len(rows) * makespan) if rows and makespan > 0 else 0.0
    return {"title": title, "makespan": makespan, "bubble": bubble, "rows": rows}
