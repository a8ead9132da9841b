"""Predicted against measured: each stage's error on the plan page, when a measured step is attached.

The page draws the simulator's timeline and the runtime's trace of the same step one above
the other (visualizer.page_data); this module adds, per stage, the busy time (forward,
backward, weight gradients) of each and the prediction's error as a share of the measured
busy time. It goes into the measured timeline's title (so the static picture and the HTML
page both show it) and into a small table on the HTML page.
"""

from __future__ import annotations

import html
from typing import Any

__all__ = ["stage_busy", "stage_errors", "with_stage_errors"]

_BUSY = ("F", "B", "W")


def stage_busy(timeline: dict[str, Any]) -> dict[int, float]:
    """Busy ms of each stage in a drawn timeline (rows.timeline_data)."""
    busy: dict[int, float] = {}
    for row in timeline.get("rows", []):
        for e in row.get("events", []):
            if e["kind"] in _BUSY and e["stage"] >= 0:
                busy[e["stage"]] = busy.get(e["stage"], 0.0) + e["end"] - e["start"]
    return busy


def stage_errors(predicted: dict[str, Any], measured: dict[str, Any]) -> list[dict[str, Any]]:
    """Per stage: predicted and measured busy ms and error = (predicted - measured) / measured, in %."""
    want, got = stage_busy(predicted), stage_busy(measured)
    out = []
    for s in sorted(set(want) | set(got)):
        p, m = want.get(s, 0.0), got.get(s, 0.0)
        out.append({"stage": s, "predicted_ms": p, "measured_ms": m,
                    "error_pct": 100.0 * (p - m) / m if m > 0 else None})
    return out


def with_stage_errors(data: dict[str, Any]) -> dict[str, Any]:
    """`page_data` output with `stage_errors` added when it holds a predicted and a measured timeline."""
    timelines = data.get("timelines", [])
    if len(timelines) < 2:
        return data
    errors = stage_errors(timelines[0], timelines[1])
    data["stage_errors"] = errors
    parts = [f"s{e['stage']} {e['error_pct']:+.0f}%" for e in errors if e["error_pct"] is not None]
    if parts:
        timelines[1]["title"] += " (prediction error by stage, % of measured busy time: " + ", ".join(parts) + ")"
    return data


def stage_error_table(data: dict[str, Any]) -> str:
    """An HTML table of `stage_errors` (empty when there is none)."""
    errors = data.get("stage_errors")
    if not errors:
        return ""
    rows = "".join(
        f"<tr><td>{e['stage']}</td><td>{e['predicted_ms']:.2f}</td><td>{e['measured_ms']:.2f}</td>"
        f"<td>{'-' if e['error_pct'] is None else format(e['error_pct'], '+.1f')}</td></tr>"
        for e in errors
    )
    head = "<tr><th>stage</th><th>predicted busy ms</th><th>measured busy ms</th><th>error %</th></tr>"
    title = html.escape("Predicted vs measured, per stage (one step)")
    return f'<div id="stage-errors"><div style="font-weight:600">{title}</div><table>{head}{rows}</table></div>'
