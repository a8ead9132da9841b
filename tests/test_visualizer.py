"""The plan's pictures: graph data on the Plan, grouping and layout, HTML in headless Chromium, PNG/SVG/DOT."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import networkx as nx
import pytest
import torch

from cost_model.analytic import AnalyticCostModel
from cost_model.devices import DeviceSpec
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.capture.trace import trace
from partitioner.place.chain import plan_pipeline
from partitioner.predict.assemble import finish
from partitioner.predict.graph_data import attach_graph, store_graph
from partitioner.predict.simulator import simulate
from partitioner.show.html import render_html
from partitioner.show.layout import NODES, choose_depth, collapse, layout
from partitioner.show.rows import timeline_data
from partitioner.show.visualizer import DrawablePlan, color, page_data, visualize
from runtime import plan as runtime_plan
from runtime.microbatch import scatter
from runtime.schedule import gpipe
from tests import zoo

SPEC = DeviceSpec(name="fixed", flops_per_s=1e10, bytes_per_s=1e10, op_overhead_s=1e-5, memory_bytes=8 << 30)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="headless Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)",
)


def make_plan(factory: Any, stages: int, micro_batches: int) -> DrawablePlan:
    """A deterministic plan (fixed device rates) with its graph attached."""
    model, args, kwargs = factory()
    traced = trace(model, args, kwargs)
    first = scatter(traced.flatten_inputs(args, kwargs), micro_batches)[0]
    graph = build_graph(traced.graph_module, first)
    cost = AnalyticCostModel(specs={"cpu": SPEC})
    order = [n.name for n in compute_nodes(traced.graph_module)]
    plan = plan_pipeline(graph, order, [torch.device("cpu")] * stages, cost, micro_batches)
    return DrawablePlan.from_plan(store_graph(plan, graph, cost))


def graph_of(plan: runtime_plan.Plan) -> dict[str, Any]:
    assert plan.graph is not None, "attach_graph did not run"
    return plan.graph


@pytest.fixture(scope="module")
def gpt_plan() -> DrawablePlan:
    return make_plan(zoo.tiny_gpt, 2, 4)


@pytest.fixture(scope="module")
def inception_plan() -> DrawablePlan:
    return make_plan(zoo.inception, 4, 4)


def toy_graph() -> nx.DiGraph:
    """x -> a.p -> a.q -> add(root) -> b -> output, with a skip x -> add and a weight w read by b."""
    g = nx.DiGraph()
    for i, (name, op, module, nbytes) in enumerate(
        [("x", "placeholder", "", 40), ("a_p", "call_module", "a.p", 80), ("a_q", "call_module", "a.q", 80),
         ("add", "call_function", "", 80), ("w", "get_attr", "", 0), ("b", "call_function", "b", 8),
         ("output", "output", "", 0)]
    ):  # fmt: skip
        g.add_node(name, name=name, op=op, target=name, module=module, position=i, shapes=[[2, 5]], dtypes=["float32"],
                   out_bytes=nbytes, param_bytes=24 if name == "w" else 0, flops=100)  # fmt: skip
    for a, b in [("x", "a_p"), ("a_p", "a_q"), ("a_q", "add"), ("x", "add"), ("add", "b"), ("w", "b"), ("b", "output")]:
        g.add_edge(a, b, bytes=g.nodes[a]["out_bytes"])
    return g


def toy_plan() -> runtime_plan.Plan:
    return runtime_plan.Plan(
        stages=[
            runtime_plan.StagePlan(0, "cpu", ["a_p"], compute_ms=3.0, forward_ms=1.0, backward_ms=2.0, send_bytes=80),
            runtime_plan.StagePlan(1, "cpu", ["a_q", "add", "b"], compute_ms=6.0, forward_ms=2.0, backward_ms=4.0,
                                   recv_bytes=120),
        ],
        micro_batches=2,
    )


def test_attach_graph_is_plain_data_and_round_trips() -> None:
    plan = toy_plan()
    attach_graph(plan, toy_graph())
    assert plan.graph is not None
    nodes = {n["name"]: n for n in plan.graph["nodes"]}
    assert list(nodes) == ["x", "a_p", "a_q", "add", "b", "output"]  # the weight is folded into its reader
    assert nodes["b"]["param_bytes"] == 24 and nodes["x"]["stage"] == -1 and nodes["add"]["stage"] == 1
    assert sum(nodes[n]["time"] for n in ("a_q", "add", "b")) == pytest.approx(6.0)  # stage compute shared out
    assert {(e["src"], e["dst"], e["bytes"]) for e in plan.graph["edges"]} >= {("x", "add", 40), ("a_q", "add", 80)}
    loaded = DrawablePlan.from_json(plan.to_json())
    assert isinstance(loaded, DrawablePlan) and loaded == DrawablePlan.from_plan(plan)
    assert runtime_plan.Plan.from_json(json.dumps({"stages": [], "micro_batches": 3})).graph is None  # old files load
    attach_graph(plan, toy_graph(), node_ms={"a_p": 9.0})
    assert [n["time"] for n in plan.graph["nodes"]][:3] == [0.0, 9.0, 0.0]


def test_grouping_and_layout_literal() -> None:
    plan = toy_plan()
    attach_graph(plan, toy_graph())
    groups, edges = collapse(graph_of(plan), 1, 2)
    # "a" is split by the stage boundary into two groups; the root's "add" is its own run.
    assert [(g.key, g.stage, [m["name"] for m in g.members]) for g in groups] == [
        ("inputs", -1, ["x"]), ("a", 0, ["a_p"]), ("a", 1, ["a_q"]), ("", 1, ["add"]), ("b", 1, ["b"]),
        ("output", -1, ["output"]),
    ]  # fmt: skip
    assert [(e.src, e.dst, e.bytes, e.cut) for e in edges] == [
        ("g0", "g1", 40, False), ("g0", "g3", 40, False), ("g1", "g2", 80, True), ("g2", "g3", 80, False),
        ("g3", "g4", 80, False), ("g4", "g5", 8, False),
    ]  # fmt: skip
    assert layout(groups, edges) == 6
    assert [(g.level, g.lane) for g in groups] == [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (5, 0)]
    assert [e.lane for e in edges] == [-1, 1, -1, -1, -1, -1]  # the skip x -> add runs down lane 1
    keys = [g.key for g in collapse(graph_of(plan), NODES, 2)[0]]
    assert keys == ["inputs", "node:a_p", "node:a_q", "node:add", "node:b", "output"]


def test_branches_sit_side_by_side(inception_plan: DrawablePlan) -> None:
    assert inception_plan.graph is not None
    groups, edges = collapse(graph_of(inception_plan), NODES, 4)
    layout(groups, edges)
    lanes = {g.label: g.lane for g in groups}
    assert lanes["b1"] != lanes["b2_0"]  # two branches of one fork, one level: different lanes
    taken = [(g.level, g.lane) for g in groups]
    assert len(taken) == len(set(taken))
    for e in edges:  # no box sits on a lane kept for a passing edge
        if e.lane >= 0:
            src, dst = next(g for g in groups if g.id == e.src), next(g for g in groups if g.id == e.dst)
            assert all((level, e.lane) not in taken for level in range(src.level + 1, dst.level))


def test_default_depth_keeps_a_transformer_readable(gpt_plan: DrawablePlan) -> None:
    assert gpt_plan.graph is not None and len(gpt_plan.graph["nodes"]) > 100
    depth = choose_depth(graph_of(gpt_plan), 2)
    assert depth == 2 and len(collapse(graph_of(gpt_plan), depth, 2)[0]) <= 24
    assert choose_depth(graph_of(make_plan(zoo.mlp, 2, 1)), 2) == NODES  # small graphs: every node
    labels = [g.label for g in collapse(graph_of(gpt_plan), 1, 2)[0]]
    assert "blocks [0 … 1]" in labels and "blocks [1 … 2]" in labels  # which blocks each stage holds


def test_page_data(gpt_plan: DrawablePlan) -> None:
    data = page_data(gpt_plan)
    assert [s["index"] for s in data["stages"]] == [0, 1] and len({s["color"] for s in data["stages"]}) == 2
    assert data["devices"] == [{"name": "cpu", "stages": [0, 1],
                                "param_bytes": sum(s.param_bytes for s in gpt_plan.stages),
                                "activation_bytes": sum(s.activation_bytes for s in gpt_plan.stages),
                                "grad_bytes": sum(s.param_bytes for s in gpt_plan.stages),
                                "capacity_bytes": data["devices"][0]["capacity_bytes"],
                                "memory_bytes": sum(s.memory_bytes for s in gpt_plan.stages),
                                "kinds": data["devices"][0]["kinds"]}]  # fmt: skip
    kinds = data["devices"][0]["kinds"]  # memory by kind (partitioner.predict.memory_kinds): the stages' own sum
    assert sum(kinds.values()) == sum(s.memory_bytes for s in gpt_plan.stages)
    (predicted,) = data["timelines"]
    assert len(predicted["rows"]) == 2 and predicted["makespan"] > 0
    assert sum(e["kind"] == "F" for e in predicted["rows"][0]["events"]) == 4
    json.dumps(data, allow_nan=False)
    assert len({color(s) for s in range(24)}) == 24  # every stage its own color, beyond the palette too


def test_replicated_plan_page_draws_the_allreduce() -> None:
    plan = toy_plan()
    plan.stages[1].ranks, plan.stages[1].reads_from, plan.stages[1].allreduce_ms = [1, 2], [0], 1.5
    finish(plan)  # programs with their predicted times; stage 1's replicas all-reduce after its last backward
    data = page_data(plan)
    assert data["plan"]["allreduce_ms"] == 1.5 and data["stages"][1]["allreduce_ms"] == 1.5
    (predicted,) = data["timelines"]
    reduces = [[(e["start"], e["end"]) for e in row["events"] if e["kind"] == "allreduce"] for row in predicted["rows"]]
    assert reduces[0] == [] and reduces[1] == reduces[2] and len(reduces[1]) == 1
    start, end = reduces[1][0]
    assert end - start == 1.5 and predicted["makespan"] == plan.predicted_step_ms >= end
    assert '"kind": "allreduce"' in render_html(data) or '"kind":"allreduce"' in render_html(data)


def test_measured_timeline_formats() -> None:
    plan = toy_plan()
    simulated = simulate(plan, gpipe(2, 2))
    assert timeline_data(simulated, "t")["makespan"] == simulated.makespan_ms
    flat = [{"device": "cuda:0", "kind": "forward", "stage": 0, "microbatch": 0, "start": 0.0, "end": 1.0},
            {"device": "cuda:1", "kind": "B", "stage": 1, "microbatch": 0, "start_ms": 1.0, "end_ms": 3.0}]  # fmt: skip
    data = timeline_data(flat, "measured")
    assert [r["device"] for r in data["rows"]] == ["cuda:0", "cuda:1"] and data["makespan"] == 3.0
    assert data["bubble"] == pytest.approx(1 - 3 / 6)
    nested = timeline_data({"devices": [{"device": "d", "events": flat[:1]}]}, "m")
    assert nested["rows"][0]["events"][0]["kind"] == "F"
    with pytest.raises(TypeError, match="cannot draw a timeline from int"):
        timeline_data(3, "bad")


def test_html_is_self_contained_and_escaped(gpt_plan: DrawablePlan) -> None:
    data = page_data(gpt_plan)
    data["graph"]["nodes"][1]["target"] = "</script><script>alert(1)</script>"
    page = render_html(data)
    assert page.count("</script>") == 2 and "alert(1)" in page  # the name is data, not markup
    remote = r"""(src|href)\s*=\s*["']?(https?:)?//|url\(\s*["']?https?:|@import|<link\b"""
    assert not re.search(remote, page, re.IGNORECASE)
    assert "fetch(" not in page and "XMLHttpRequest" not in page


def test_static_pictures_and_dot(tmp_path: Path, inception_plan: DrawablePlan) -> None:
    pytest.importorskip("matplotlib", reason="PNG and SVG need matplotlib (pip install matplotlib)")
    png = visualize(inception_plan, tmp_path / "plan.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in inception_plan.visualize(tmp_path / "plan.svg").read_text()
    dot = inception_plan.visualize(tmp_path / "plan.dot").read_text()
    assert dot.startswith("digraph plan {") and dot.count("subgraph cluster_band") == 6  # inputs, 4 stages, output
    assert "color=\"#b00020\"" in dot and "KiB" in dot  # cut edges carry their bytes
    if shutil.which("dot"):
        subprocess.run(["dot", "-Tsvg", "-o", str(tmp_path / "g.svg"), str(tmp_path / "plan.dot")], check=True,
                       timeout=60)


def test_bad_arguments(tmp_path: Path, gpt_plan: DrawablePlan) -> None:
    with pytest.raises(ValueError, match=r"cannot write 'plan\.txt': use a name ending in one of \.dot, \.gv, \.htm"):
        gpt_plan.visualize(tmp_path / "plan.txt")
    with pytest.raises(ValueError, match="depth must be an integer >= 1"):
        gpt_plan.visualize(tmp_path / "plan.html", depth=0)
    bare = runtime_plan.Plan(stages=[runtime_plan.StagePlan(0, "cpu", ["a"], forward_ms=1.0, backward_ms=2.0)])
    page = visualize(bare, tmp_path / "bare.html").read_text()  # no graph: still a page, with a note
    assert "no graph attached" in page


class _Elements(HTMLParser):
    """Every start tag's attributes, by tag."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: dict[str, str] = {}
        self._open: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = {k: v or "" for k, v in attrs}
        self.tags.append((tag, found))
        self._open = found.get("id")

    def handle_data(self, data: str) -> None:
        if self._open:
            self.text[self._open] = self.text.get(self._open, "") + data

    def with_class(self, name: str) -> list[dict[str, str]]:
        return [a for _, a in self.tags if name in a.get("class", "").split()]


def chromium(tmp_path: Path, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """Headless Chromium with no network, a fresh profile and nothing in the background."""
    command = [
        str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
        "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={tmp_path / 'chromium-profile'}", *extra, url,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def render_in_browser(
    tmp_path: Path, plan: DrawablePlan, name: str, measured: Any = None, depth: int | None = None
) -> _Elements:
    page = plan.visualize(tmp_path / f"{name}.html", measured=measured, depth=depth)
    result = chromium(tmp_path, page.resolve().as_uri() + "#selftest", "--dump-dom")
    dom = _Elements()
    dom.feed(result.stdout)
    assert dom.text.get("status", "").strip() == "ok", f"page errors: {dom.text.get('errors')}\n{result.stderr[-2000:]}"
    assert not dom.text.get("errors", "").strip()
    body = next(a for t, a in dom.tags if t == "body")
    assert body["data-selftest"] == "done"
    return dom


def check_screenshot(tmp_path: Path, plan: DrawablePlan, name: str, height: int) -> Path:
    shot = tmp_path / f"{name}.png"
    chromium(tmp_path, (tmp_path / f"{name}.html").resolve().as_uri(), f"--screenshot={shot}",
             f"--window-size=1400,{height}")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == (1400, height)
    keep = os.environ.get("PARTITIONER_SCREENSHOTS")  # a folder to keep the screenshots in (CI artifacts)
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / shot.name)
    return shot


@needs_chromium
def test_html_in_chromium_gpt(tmp_path: Path, gpt_plan: DrawablePlan) -> None:
    dom = render_in_browser(tmp_path, gpt_plan, "gpt")
    bands = dom.with_class("stage-band")
    assert [b["data-stage"] for b in bands] == ["0", "1"] and len({b["data-color"] for b in bands}) == 2
    assert len(dom.with_class("tl-row")) == len(gpt_plan.stages)  # one timeline row per device
    body = next(a for t, a in dom.tags if t == "body")
    assert body["data-expand-grew"] == "yes" and body["data-collapse-restored"] == "yes"
    # The page groups and lays out the graph exactly as the Python layout does.
    groups, edges = collapse(graph_of(gpt_plan), choose_depth(graph_of(gpt_plan), 2), 2)
    layout(groups, edges)
    boxes = [(b["data-key"], b["data-title"], int(b["data-level"]), int(b["data-lane"])) for b in dom.with_class("box")]
    assert boxes == [(g.key, g.label, g.level, g.lane) for g in groups]
    assert dom.with_class("cut-label")  # the edges between the stages carry bytes
    check_screenshot(tmp_path, gpt_plan, "gpt", 1700)
    deep = render_in_browser(tmp_path, gpt_plan, "gpt-deep", depth=7)  # deeper than any module: the deepest level
    assert len(deep.with_class("box")) == len(collapse(graph_of(gpt_plan), 7, 2)[0])


@needs_chromium
def test_html_in_chromium_inception_with_measured_timeline(tmp_path: Path, inception_plan: DrawablePlan) -> None:
    measured = simulate(inception_plan, gpipe(4, 4))  # stands in for a runtime trace
    dom = render_in_browser(tmp_path, inception_plan, "inception", measured=measured)
    bands = dom.with_class("stage-band")
    assert [b["data-stage"] for b in bands] == ["0", "1", "2", "3"] and len({b["data-color"] for b in bands}) == 4
    panels = dom.with_class("timeline")
    assert [p["data-rows"] for p in panels] == ["4", "4"]  # predicted and measured, one row per device
    assert len(dom.with_class("tl-row")) == 8
    boxes = dom.with_class("box")
    assert len(boxes) == len(graph_of(inception_plan)["nodes"])  # small graph: every node drawn
    check_screenshot(tmp_path, inception_plan, "inception", 1900)


# --- rows by host and folded replicas (partitioner/show/hosts.py) ----------------------------------------
def two_stage_replicas(replicas: int, gpus_per_host: int) -> runtime_plan.Plan:
    """2 stages x `replicas` replicas, 2 micro-batches per replica; stage 0 on ranks 0..R-1, stage 1 after."""
    plan = runtime_plan.Plan(
        [runtime_plan.StagePlan(0, "cuda:0", [], forward_ms=1.0, backward_ms=2.0, allreduce_ms=2.5,
                                ranks=list(range(replicas))),
         runtime_plan.StagePlan(1, "cuda:1", [], forward_ms=1.0, backward_ms=2.0, allreduce_ms=0.7,
                                ranks=list(range(replicas, 2 * replicas)), reads_from=[0])],
        micro_batches=2 * replicas)  # fmt: skip
    plan.gpus_per_host = gpus_per_host
    return plan


def test_16384_ranks_draw_as_two_rows_under_host_headings(tmp_path: Path) -> None:
    plan = two_stage_replicas(8192, 8)  # 2048 hosts of 8: stage 0 on hosts 0-1023, stage 1 on 1024-2047
    (predicted,) = page_data(plan)["timelines"]
    assert [(r["device"], r["stages"], bool(r.get("heading"))) for r in predicted["rows"]] == [
        ("hosts 0-1023", [], True), ("ranks 0-8191 (x8192)", [0], False),
        ("hosts 1024-2047", [], True), ("ranks 8192-16383 (x8192)", [1], False),
    ]
    # one replica by hand: stage 0 busy F 2 ms + B 4 ms, stage 1 the same; each rank counted once
    timeline = simulate(plan)
    assert predicted["bubble"] == pytest.approx(1 - 12 / (2 * timeline.makespan_ms))
    for name in ("plan.png", "plan.html"):
        visualize(plan, tmp_path / name)
    page = (tmp_path / "plan.html").read_text()
    assert "ranks 0-8191 (x8192)" in page and "hosts 1024-2047" in page


def test_rows_of_single_ranks_grouped_under_their_host() -> None:
    plan = two_stage_replicas(1, 1)  # ranks 0 and 1 on hosts 0 and 1
    rows = page_data(plan)["timelines"][0]["rows"]
    assert [r["device"] for r in rows] == ["host 0", "cuda:0", "host 1", "cuda:1"]
    plan.gpus_per_host = 2  # both on host 0: one heading
    assert [r["device"] for r in page_data(plan)["timelines"][0]["rows"]] == ["host 0", "cuda:0", "cuda:1"]
    plan.gpus_per_host = 0  # hosts unknown: no headings, as before
    assert [r["device"] for r in page_data(plan)["timelines"][0]["rows"]] == ["cuda:0", "cuda:1"]


def test_unfoldable_rows_are_merged_when_equal_and_capped() -> None:
    from partitioner.predict.timeline import FORWARD, DeviceTimeline, Event, Timeline
    from partitioner.show.hosts import MAX_ROWS, by_host

    def rows(n: int, same: bool) -> Timeline:
        devices = [DeviceTimeline(f"cuda:{r}", [0], [Event(FORWARD, 0, r, 0.0, 1.0 if same else 1.0 + r)],
                                  ranks=[r]) for r in range(n)]  # fmt: skip
        return Timeline(devices, float(n + 1), [1])

    same = rows(1000, True)
    (row,) = by_host(timeline_data(same, "t"), same, gpus_per_host=0)["rows"]
    assert row["device"] == "ranks 0-999 (x1000)" and row["ranks"] == list(range(1000))
    many = rows(1000, False)
    drawn = by_host(timeline_data(many, "t"), many, gpus_per_host=0)["rows"]
    assert len(drawn) == MAX_ROWS and drawn[-1]["device"] == f"... {1000 - MAX_ROWS + 1} more rows (745 ranks)"


def test_cluster_report_prints_grouped_rows_not_one_per_rank() -> None:
    # by hand, one replica (gpipe, free transfers): stage 0 F 0-2, B 5-9, all-reduce 9-11.5;
    # stage 1 F 1-3, B 3-7, all-reduce 7-7.7; 23 columns of 0.5 ms
    from rich.console import Console

    from partitioner.cli.cluster import timeline_rows
    from partitioner.show.hosts import text_rows

    plan = two_stage_replicas(8192, 8)
    text = text_rows(simulate(plan), gpus_per_host=8, width=23)
    assert text.splitlines() == [
        "row                        stages     busy ms   comm ms   idle ms  timeline",
        "hosts 0-1023",
        "  ranks 0-8191 (x8192)     0            6.000     2.500     3.000  FFFF......BBBBBBBB~~~~~",
        "hosts 1024-2047",
        "  ranks 8192-16383 (x8192) 1            6.000     0.700     4.800  ..FFFFBBBBBBBB~........",
        "makespan 11.500 ms, bubble 47.8%, 16384 ranks in 2 rows (identical replicas folded; figures per rank)",
    ]
    console = Console(record=True, width=200)
    timeline_rows(console, plan)  # what `python -m partitioner plan --cluster ...` ends with
    printed = console.export_text()
    assert "ranks 8192-16383 (x8192)" in printed and "16384 ranks in 2 rows" in printed


@needs_chromium
def test_html_in_chromium_rows_under_host_headings(tmp_path: Path) -> None:
    dom = render_in_browser(tmp_path, DrawablePlan.from_plan(two_stage_replicas(8192, 8)), "hosts")  # no graph attached
    assert [r["data-device"] for r in dom.with_class("tl-row")] == [
        "hosts 0-1023", "ranks 0-8191 (x8192)", "hosts 1024-2047", "ranks 8192-16383 (x8192)"]
