"""Static pictures of a plan: PNG/SVG/PDF through matplotlib, and DOT text for Graphviz.

Both draw the graph grouped as in [Note: plan picture layout] (partitioner/show/layout.py);
the matplotlib figure adds the per-stage time bars, per-device memory bars and the timelines.
Coordinates are in pixels at 100 dpi, the same as the HTML page's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from partitioner.show.layout import Edge, Group, choose_depth, collapse, layout
from runtime.plan import human_bytes

__all__: list[str] = []

BOX_W, BOX_H, LANE_W, LEVEL_H, HEADER, BAND_GAP, LEFT, TOP = 176, 40, 204, 62, 30, 34, 92, 10
CUT = "#b00020"


def _groups(data: Mapping[str, Any], depth: int | None) -> tuple[list[Group], list[Edge], int]:
    graph, stages = data["graph"], len(data["stages"])
    depth = depth if depth is not None else choose_depth(graph, stages)
    groups, edges = collapse(graph, depth, stages)
    return groups, edges, layout(groups, edges)


def _sub(g: Group) -> str:
    if len(g.members) > 1:
        return f"{len(g.members)} nodes · {_ms(g.time)}"
    shapes = g.members[0].get("shapes") or []
    first = "[" + ", ".join(map(str, shapes[0])) + "]" if shapes else str(g.members[0]["op"])
    return f"{first} · {_ms(g.time)}"


def _ms(x: float) -> str:
    return f"{x:.0f} ms" if x >= 100 else f"{x:.2f} ms" if x >= 1 else f"{x:.3f} ms"


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else "…" + text[len(text) - n + 1 :]


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _band_label(data: Mapping[str, Any], band: int) -> str:
    stages = data["stages"]
    if band == 0:
        return "inputs"
    if band > len(stages):
        return "output"
    s = stages[band - 1]
    return f"stage {s['index']} · {s['device']} · {_per_micro_batch(s)} · params {human_bytes(s['param_bytes'])}"


def _per_micro_batch(stage: Mapping[str, Any]) -> str:
    """'520 ms per micro-batch on each of 64 replicas': one replica's forward, backward and transfers of one
    micro-batch, as the timeline draws them (not `predicted_ms`, which divides that by the replicas)."""
    each = stage["forward_ms"] + stage["backward_ms"] + stage["comm_ms"]
    replicas = int(stage.get("replicas", 1))
    return f"{_ms(each)} per micro-batch" + (f" on each of {replicas} replicas" if replicas > 1 else "")


def to_dot(data: Mapping[str, Any], depth: int | None = None) -> str:
    """Graphviz DOT: one cluster per stage, boxes in the stage's color, cut edges labeled with bytes."""
    lines = [
        "digraph plan {",
        f"  label={_quote(data['title'])}; labelloc=t; rankdir=TB; fontname=Helvetica;",
        '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10];',
        '  edge [color="#888888", arrowsize=0.7, fontname=Helvetica, fontsize=9];',
    ]
    if not data.get("graph"):
        lines.append(f"  note [label={_quote('no graph attached to this plan')}, shape=plaintext];")
        return "\n".join(lines + ["}"]) + "\n"
    groups, edges, _ = _groups(data, depth)
    colors = [s["color"] for s in data["stages"]]
    for band in sorted({g.band for g in groups}):
        color = colors[band - 1] if 0 < band <= len(colors) else "#9e9e9e"
        lines.append(f"  subgraph cluster_band{band} {{")
        lines.append(f'    label={_quote(_band_label(data, band))}; style="rounded,filled"; color="{color}"; '
                     f'fillcolor="{_mix(color, 0.88)}";')
        for g in groups:
            if g.band == band:
                label = _quote(f"{g.label}\n{_sub(g)}")
                lines.append(f'    {g.id} [label={label}, color="{color}", fillcolor="{_mix(color, 0.62)}"];')
        lines.append("  }")
    for e in edges:
        style = ""
        if e.cut:  # cut edges carry their bytes
            style = f' [color="{CUT}", fontcolor="{CUT}", penwidth=1.6, label={_quote(human_bytes(e.bytes))}]'
        lines.append(f"  {e.src} -> {e.dst}{style};")
    return "\n".join(lines + ["}"]) + "\n"


def _mix(color: str, t: float, other: str = "#ffffff") -> str:
    a, b = int(color[1:], 16), int(other[1:], 16)
    parts = [round(((a >> s) & 255) * (1 - t) + ((b >> s) & 255) * t) for s in (16, 8, 0)]
    return "#" + "".join(f"{v:02x}" for v in parts)


def _place(
    groups: Sequence[Group], edges: Sequence[Edge]
) -> tuple[dict[str, tuple[float, float]], list[tuple[int, float, float]], float, float]:
    """Pixel positions (x, y of the box's top left), band rectangles (band, top, height), size."""
    width: dict[int, int] = {}
    first: dict[int, int] = {}
    for g in groups:
        first[g.band] = min(first.get(g.band, g.level), g.level)
        width[g.band] = max(width.get(g.band, 0), g.level - first.get(g.band, g.level) + 1)
    top, y = {}, float(TOP)
    for band in sorted(width):
        top[band] = y
        y += HEADER + width[band] * LEVEL_H + BAND_GAP
    pos = {g.id: (float(LEFT + g.lane * LANE_W), top[g.band] + HEADER + (g.level - first[g.band]) * LEVEL_H)
           for g in groups}
    lanes = max([g.lane for g in groups] + [e.lane for e in edges] + [0]) + 1
    bands = [(b, top[b], float(HEADER + width[b] * LEVEL_H + 8)) for b in sorted(width)]
    return pos, bands, float(max(LEFT + lanes * LANE_W + 24, 640)), y - BAND_GAP + 14  # 640: room for band titles


def _entries(
    edges: Sequence[Edge], by_id: Mapping[str, Group], pos: Mapping[str, tuple[float, float]]
) -> dict[int, tuple[float, float]]:
    """Per edge: x of its straight part, and x where it enters its target (edges into one box side by side)."""
    incoming: dict[str, list[tuple[float, int, Edge]]] = {}
    for e in edges:
        xs = LEFT + e.lane * LANE_W + BOX_W / 2 if e.lane >= 0 else pos[e.src][0] + BOX_W / 2
        incoming.setdefault(e.dst, []).append((xs, int(e.src[1:]), e))
    out = {}
    for dst, items in incoming.items():
        items.sort(key=lambda t: (t[0], t[1]))
        step = min(24.0, (BOX_W - 20) / len(items))
        for k, (xs, _, e) in enumerate(items):
            out[id(e)] = (xs, pos[dst][0] + BOX_W / 2 + (k - (len(items) - 1) / 2) * step)
    return out


def _bezier_x(pts: Sequence[tuple[float, float]], y: float) -> float:
    """x of the cubic bezier through `pts` where its y is closest to `y`."""
    best = (float("inf"), pts[0][0])
    for i in range(61):
        t = i / 60
        c = ((1 - t) ** 3, 3 * (1 - t) ** 2 * t, 3 * (1 - t) * t**2, t**3)
        px, py = sum(k * p[0] for k, p in zip(c, pts)), sum(k * p[1] for k, p in zip(c, pts))
        best = min(best, (abs(py - y), px))
    return best[1]


def render_static(data: Mapping[str, Any], path: Path, depth: int | None = None) -> None:
    """Save the figure: graph on the left; time, memory and timelines on the right."""
    try:  # matplotlib is optional: only the static pictures need it, so it is imported here
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import FancyBboxPatch, PathPatch, Rectangle
        from matplotlib.path import Path as MPath
    except ImportError:
        raise ImportError(
            f"writing {path.name} needs matplotlib: pip install matplotlib (or write .html or .dot)"
        ) from None

    has_graph = bool(data.get("graph"))
    if has_graph:
        groups, edges, _ = _groups(data, depth)
        pos, bands, gw, gh = _place(groups, edges)
    else:
        groups, edges, pos, bands, gw, gh = [], [], {}, [], 300.0, 100.0
    stages, devices, timelines = data["stages"], data["devices"], data["timelines"]
    right_w = 900.0
    blocks = [40 + 26 * len(stages), 40 + 26 * len(devices)] + [70 + 30 * len(t["rows"]) for t in timelines]
    right_h = sum(blocks) + 40 * len(blocks) + 60
    W, H = gw + right_w + 60, max(gh + 60, right_h)
    fig = plt.figure(figsize=(W / 100, H / 100), dpi=100)
    fig.text(10 / W, 1 - 22 / H, data["title"], fontsize=13, fontweight="bold")
    fig.text(10 / W, 1 - 40 / H, _subtitle(data["plan"]), fontsize=9.5, color="#333")

    ax = fig.add_axes((0, (H - 50 - gh) / H, gw / W, gh / H))
    ax.set_xlim(0, gw), ax.set_ylim(gh, 0), ax.axis("off")
    for band, top, height in bands:
        color = stages[band - 1]["color"] if 0 < band <= len(stages) else "#9e9e9e"
        ax.add_patch(FancyBboxPatch((2, top), gw - 4, height, boxstyle="round,pad=0,rounding_size=6",
                                    fc=_mix(color, 0.88), ec=_mix(color, 0.4)))  # fmt: skip
        ax.text(10, top + 19, _band_label(data, band), fontsize=9, fontweight="bold",
                color=_mix(color, 0.45, "#000000"), zorder=4,
                bbox={"boxstyle": "square,pad=0.1", "fc": _mix(color, 0.88), "ec": "none"})  # text, not a path, in SVG
        if band > 0:
            ax.plot([2, gw - 2], [top - BAND_GAP / 2 + 3] * 2, ls=(0, (6, 4)), color="#777", lw=0.8)
    level_of = {g.id: g for g in groups}
    level_y = {g.level: pos[g.id][1] for g in groups}
    placed: list[tuple[float, float, float]] = []  # cut labels drawn: x, y, width
    entry = _entries(edges, level_of, pos)
    for e in edges:
        a, b = level_of[e.src], level_of[e.dst]
        (ax_, ay), by = pos[a.id], pos[b.id][1]
        # Into the lane kept for it on the levels it passes, straight down, then into the target.
        x1, y1, x2, y2 = ax_ + BOX_W / 2, ay + BOX_H, entry[id(e)][1], by
        xs, top, bottom = entry[id(e)][0], y1, y1
        pts, codes = [(x1, y1)], [MPath.MOVETO]
        if e.lane >= 0:
            top, bottom = level_y[a.level + 1], level_y[b.level - 1] + BOX_H
            k = max(10.0, (top - y1) / 2)
            pts += [(x1, y1 + k), (xs, top - k), (xs, top), (xs, bottom)]
            codes += [MPath.CURVE4] * 3 + [MPath.LINETO]
        k = max(10.0, (y2 - bottom) / 2)
        tail = [(xs, bottom), (xs, bottom + k), (x2, y2 - k), (x2, y2)]
        pts += tail[1:]
        codes += [MPath.CURVE4] * 3
        color = CUT if e.cut else "#888888"
        ax.add_patch(PathPatch(MPath(pts, codes), fc="none", ec=color, lw=1.6 if e.cut else 1.0))
        ax.plot([pts[-1][0]], [pts[-1][1] - 2], marker="v", ms=4, color=color)
        if e.cut:
            boundary = next((t - BAND_GAP / 2 + 3 for band, t, _ in bands if t > ay), (ay + by) / 2)
            x = 6 + (xs if top <= boundary <= bottom
                     else _bezier_x(tail, boundary) if boundary > bottom else (x1 + xs) / 2)  # fmt: skip
            label = human_bytes(e.bytes)
            w = 8 + 6.4 * len(label)
            for qx, qy, qw in sorted(placed):  # push labels on one boundary apart
                if abs(qy - boundary) < 16 and x < qx + qw + 4 and qx < x + w + 4:
                    x = qx + qw + 6
            placed.append((x, boundary, w))
            ax.text(x, boundary, label, fontsize=8, color=CUT, va="center",
                    bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": CUT, "lw": 0.6})  # fmt: skip
    for g in groups:
        x, y = pos[g.id]
        color = stages[g.stage]["color"] if g.stage >= 0 else "#9e9e9e"
        ax.add_patch(FancyBboxPatch((x, y), BOX_W, BOX_H, boxstyle="round,pad=0,rounding_size=5",
                                    fc=_mix(color, 0.62), ec=color, lw=1.2))  # fmt: skip
        ax.text(x + 8, y + 16, _clip(g.label, 25), fontsize=8.5, fontweight="bold", va="baseline")
        ax.text(x + 8, y + 32, _clip(_sub(g), 30), fontsize=7.5, color="#444", va="baseline")
    if not has_graph:
        ax.text(10, 50, "no graph attached to this plan", fontsize=10, color="#666")

    x0, y = (gw + 40) / W, H - 60.0
    title = "Predicted time of one micro-batch on a replica (forward, backward, transfers)"
    y = _bars(fig, (x0, right_w / W, W, H), y, title, [
        (f"stage {s['index']} · {s['device']}",
         [(s["forward_ms"], s["color"]), (s["backward_ms"], _mix(s["color"], 0.35, "#000000")),
          (s["comm_ms"], "#b9b9b9")],
         _ms(s["forward_ms"] + s["backward_ms"] + s["comm_ms"])
         + (f" + all-reduce {_ms(s['allreduce_ms'])} per step" if s.get("allreduce_ms") else ""))
        for s in stages
    ], None)  # fmt: skip
    kinded = any(memory_parts(d)[0] for d in devices)
    y = _bars(fig, (x0, right_w / W, W, H), y, "Memory per GPU: " + (
        "weights, master weights, gradients, optimizer states, activations" if kinded else
        "parameters, gradients, activations") + " (red: capacity)", [
        (f"{d['name']}" + ("" if d["name"].startswith("stage ") else f" (stage {', '.join(map(str, d['stages']))})"),
         memory_parts(d)[1], memory_text(d))
        for d in devices
    ], [d.get("capacity_bytes") for d in devices])  # fmt: skip
    for t in timelines:
        y = _gantt(fig, (x0, right_w / W, W, H), y, t, stages, Rectangle)
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # SVG text stays text: searchable, selectable
        fig.savefig(path, dpi=100)
    plt.close(fig)


MEMORY_KINDS = (("weights", "#5b6770"), ("master", "#7d8a94"), ("gradients", "#9aa5ad"), ("optimizer", "#c3cbd1"),
                ("activations", "#d9a441"))  # the HTML page's colors (templates/plan.html.tmpl)


def memory_parts(device: Mapping[str, Any]) -> tuple[bool, list[tuple[float, str]]]:
    """A device row's memory bar: by kind (partitioner/predict/memory_kinds.py) where the planner predicted it,
    else parameters, their gradients and activations; and whether it is by kind."""
    kinds = device.get("kinds") or {}
    if any(kinds.values()):
        return True, [(float(kinds.get(k, 0)), c) for k, c in MEMORY_KINDS]
    return False, [(device["param_bytes"], "#5b6770"), (device["grad_bytes"], "#9aa5ad"),
                   (device["activation_bytes"], "#d9a441")]


def memory_text(device: Mapping[str, Any]) -> str:
    """'68.4 GiB of 72.0 GiB (95%)': the row's bar in all, the plan's memory per GPU where it predicted one."""
    used = sum(v for v, _ in memory_parts(device)[1])
    cap = device.get("capacity_bytes")
    share = f" ({100 * used / cap:.{2 if used < cap / 100 else 0}f}%)" if cap else ""
    return human_bytes(used) + (f" of {human_bytes(cap)}{share}" if cap else " (capacity unknown)")


def _subtitle(plan: Mapping[str, Any]) -> str:
    """'512 micro-batches (8 per replica x 64 replicas) of 3 samples · schedule 1f1b · predicted step 4170 ms'."""
    return (f"{plan['micro_batch_words']} · schedule {plan['schedule']} · predicted step "
            f"{_ms(plan['predicted_step_ms'])}")


def _bars(
    fig: Any, frame: tuple[float, float, float, float], y: float, title: str, rows: list[Any],
    capacity: list[Any] | None,
) -> float:
    """Horizontal stacked bars, one row each; returns the next free y (pixels from the bottom)."""
    x0, w, W, H = frame
    h = 26.0 * len(rows)
    ax = fig.add_axes((x0 + 190 / W, (y - 24 - h) / H, w - 420 / W, h / H))  # 230 px right of the bars for text
    ax.set_title(title, fontsize=9.5, loc="left", x=-190 / (w * W - 420))
    scale = max([sum(v for v, _ in parts) for _, parts, _ in rows] + [1e-12])
    for i, (_label, parts, text) in enumerate(rows):
        row_scale = max(capacity[i], sum(v for v, _ in parts)) if capacity and capacity[i] else scale
        left = 0.0
        for value, color in parts:
            ax.barh(i, value / row_scale, left=left, color=color, height=0.62)
            left += value / row_scale
        if capacity and capacity[i]:
            ax.axvline(min(1.0, capacity[i] / row_scale), ymin=1 - (i + 0.9) / len(rows),
                       ymax=1 - (i + 0.1) / len(rows), color=CUT, lw=1.4)  # fmt: skip
        ax.text(1.01, i, text, va="center", fontsize=8.5, transform=ax.get_yaxis_transform())
    ax.set_xlim(0, 1), ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks(range(len(rows)), [_clip(r[0], 28) for r in rows], fontsize=8.5)
    ax.set_xticks([]), ax.set_facecolor("#f4f4f4")
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    return y - 24 - h - 40


def _gantt(
    fig: Any, frame: tuple[float, float, float, float], y: float, t: Mapping[str, Any], stages: Sequence[Any],
    Rectangle: Any,
) -> float:
    """One timeline: a row per device, forward in the stage's color, backward darker."""
    x0, w, W, H = frame
    h = 30.0 * len(t["rows"])
    ax = fig.add_axes((x0 + 190 / W, (y - 24 - h) / H, w - 220 / W, h / H))
    ax.set_title(f"{t['title']}: makespan {_ms(t['makespan'])}, bubble {100 * t['bubble']:.1f}%", fontsize=9.5,
                 loc="left", x=-190 / (w * W - 220))
    span = t["makespan"] or 1.0
    for i, row in enumerate(t["rows"]):
        for e in row["events"]:
            base = stages[e["stage"]]["color"] if 0 <= e["stage"] < len(stages) else "#9e9e9e"
            if e["kind"] in ("F", "B", "W"):  # W (a split backward's weight part): lighter than B
                fill = {"F": base, "B": _mix(base, 0.35, "#000000"), "W": _mix(base, 0.6, "#000000")}[e["kind"]]
                ax.add_patch(
                    Rectangle((e["start"], i - 0.34), e["end"] - e["start"], 0.62, fc=fill, ec="white", lw=0.5)
                )
                width_px = (e["end"] - e["start"]) / span * (w * W - 220)
                label = f"{e['kind']}{e['mb']}"
                if width_px > 7 * len(label) + 4:
                    ax.text((e["start"] + e["end"]) / 2, i - 0.03, label, ha="center", va="center", fontsize=7,
                            color="#111" if e["kind"] == "F" else "white")  # fmt: skip
            else:
                fill = {"send": "#444444", "recv": "#999999"}.get(e["kind"], "#7b3294")
                ax.add_patch(Rectangle((e["start"], i + 0.3), e["end"] - e["start"], 0.12, fc=fill, lw=0))
    ax.set_xlim(0, span), ax.set_ylim(len(t["rows"]) - 0.5, -0.5)
    _row_labels(ax, t["rows"])
    ax.tick_params(axis="x", labelsize=8)
    ax.set_xlabel("ms", fontsize=8.5, loc="right")
    ax.set_facecolor("#f4f4f4")
    return y - 24 - h - 70


def _row_labels(ax: Any, rows: Sequence[Mapping[str, Any]]) -> None:
    """Row names: 'ranks 0-7 (x8) · stage 0'; host headings (partitioner/show/hosts.py) bold over a rule."""
    labels = [str(r["device"]) if r.get("heading") else f"{r['device']} · stage {', '.join(map(str, r['stages']))}"
              for r in rows]  # fmt: skip
    ax.set_yticks(range(len(rows)), [_clip(s, 36) for s in labels], fontsize=8.5)
    for i, (tick, row) in enumerate(zip(ax.get_yticklabels(), rows)):
        if row.get("heading"):
            tick.set_fontweight("bold")
            ax.axhline(i - 0.5, color="#bbbbbb", lw=0.8)
