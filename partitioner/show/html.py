"""The plan as one self-contained HTML page: templates/plan.html.tmpl with the plan's data inlined.

The page loads nothing from the network: its CSS and JavaScript are inline and the data sits
in a `<script type="application/json">` block. It writes `ok` (or the errors it met) into
its `#status` element, which is how the headless-browser test knows the script ran cleanly.
"""

from __future__ import annotations

import html
import json
import math
from importlib import resources
from typing import Any

from partitioner.show.layout import NODES, choose_depth, max_depth
from partitioner.show.measured import stage_error_table

__all__: list[str] = []


def _finite(value: Any) -> Any:
    """The data with NaN and infinities as None (JSON.parse accepts neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def template() -> str:
    """The page template shipped in partitioner/show/templates."""
    return resources.files("partitioner.show").joinpath("templates/plan.html.tmpl").read_text(encoding="utf-8")


def render_html(data: dict[str, Any], depth: int | None = None) -> str:
    """The page for `page_data` output; `depth` is the initial grouping (default: readable)."""
    data = dict(data)
    graph = data.get("graph")
    stages = len(data["stages"])
    data["max_depth"] = max_depth(graph) if graph else 1
    data["nodes_depth"] = NODES
    data["default_depth"] = depth if depth is not None else (choose_depth(graph, stages) if graph else 1)
    text = json.dumps(_finite(data), separators=(",", ":"), allow_nan=False)
    # Inside <script>, "</" could close the block early and "<!--" open a comment; "<" only
    # occurs inside JSON strings, where \u003c means the same.
    text = text.replace("<", "\\u003c")
    page = template()
    page = page.replace('<div id="timelines"></div>', '<div id="timelines"></div>' + stage_error_table(data), 1)
    return page.replace("{{TITLE}}", html.escape(str(data["title"]))).replace("{{DATA}}", text)
