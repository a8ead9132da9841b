"""`python -m partitioner profile MODULE:FACTORY`: each node's shapes, FLOPs, bytes and time for one micro-batch.

Measured on --device (cached per model and device), or --analytic: the cost model's estimate.
"""

from __future__ import annotations

import argparse
from typing import Callable, ContextManager

import torch
from rich.console import Console
from rich.table import Table

from cost_model.analytic import AnalyticCostModel
from cost_model.interface import forward_time
from cost_model.profiler import profile_graph
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.cli.inputs import UsageError, load_example
from runtime.plan import human_bytes

__all__ = ["run_profile"]


def run_profile(args: argparse.Namespace, out: Console, step: Callable[[str], ContextManager[None]]) -> int:
    """Trace the model and print each node's shapes, FLOPs, bytes and forward and backward ms."""
    with step(f"loading {args.target}"):
        example = load_example(args.target, args.batch, args.micro_batches or 1)
    with step("tracing and measuring the graph"):
        gm, first = example.trace()
        graph = build_graph(gm, first)
    try:
        device = torch.device(args.device)
    except RuntimeError as exc:
        raise UsageError(f"--device {args.device!r}: {exc}") from None
    names = [n.name for n in compute_nodes(gm)]
    if args.analytic:
        cost = AnalyticCostModel()
        fwd = {n: forward_time(cost, graph.nodes[n], device) for n in names}
        total = {n: cost.node_time(graph.nodes[n], device) for n in names}
        source = f"analytic estimate for {device}"
    else:
        try:
            prof = profile_graph(gm, first, device, cache=not args.no_cache, progress=not args.quiet)
        except ValueError as exc:
            raise UsageError(f"--device {args.device}: {exc}") from None
        fwd = dict(prof.forward)
        total = {n: prof.node_time(n) for n in names}
        source = f"measured on {device}" + (" (from the cache; --no-cache measures again)" if prof.from_cache else "")
    rows = sorted(names, key=lambda n: -total.get(n, 0.0)) if args.sort == "time" else names
    shown = rows if args.top == 0 else rows[: args.top]
    whole = sum(total.values()) or 1.0
    table = Table(title=f"{example.name}: per-node cost of one micro-batch, {source}", title_justify="left",
                  header_style="bold")
    for name, justify in [("#", "right"), ("node", "left"), ("op", "left"), ("module", "left"), ("output", "left"),
                          ("FLOPs", "right"), ("out bytes", "right"), ("params", "right"), ("fwd ms", "right"),
                          ("bwd ms", "right"), ("share", "right")]:  # fmt: skip
        table.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    kinds = {n.name: type(gm.get_submodule(str(n.target))).__name__ for n in gm.graph.nodes if n.op == "call_module"}
    for name in shown:
        a = graph.nodes[name]
        f, t = fwd.get(name, 0.0), total.get(name, 0.0)
        table.add_row(
            str(a["position"]), name, kinds.get(name, str(a["target"])), a["module"] or "-",
            " ".join(str(list(s)) for s in a["shapes"]) or "-", f"{a['flops']:,}", human_bytes(a["out_bytes"]),
            human_bytes(a["param_bytes"]), f"{f * 1e3:.4f}", f"{(t - f) * 1e3:.4f}", f"{t / whole:.1%}",
        )  # fmt: skip
    out.print(table)
    more = f" ({len(rows) - len(shown)} more rows: --top 0 shows all)" if len(shown) < len(rows) else ""
    out.print(f"{len(names)} nodes, forward {sum(fwd.values()) * 1e3:.3f} ms + backward "
              f"{(sum(total.values()) - sum(fwd.values())) * 1e3:.3f} ms per micro-batch{more}",
              markup=False)  # fmt: skip
    return 0
