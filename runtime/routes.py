"""Which values each stage reads from and sends to every other stage, from the stages' inputs and outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Sequence

import torch
import torch.fx

from runtime.mutation import input_aliases

__all__ = ["Routes", "stage_aliases"]


@dataclass
class Routes:
    """Which value names each stage reads from and sends to every other stage.

    `reads[s][t]`: names stage s reads from stage t; `sends[t][s]`: the same, seen by t.
    Values only the model output reads are routed to the last stage, which assembles it.
    """

    reads: list[dict[int, list[str]]]
    sends: list[dict[int, list[str]]]

    @classmethod
    def of(cls, io: Sequence[tuple[list[str], list[str]]], output_node: torch.fx.Node) -> Routes:
        producer = {name: s for s, (_, outs) in enumerate(io) for name in outs}
        last = len(io) - 1
        out_names: list[str] = []
        torch.fx.node.map_arg(output_node.args[0], lambda n: out_names.append(n.name) or n)  # type: ignore[func-returns-value]
        needs = [list(ins) for ins, _ in io]
        needs[last] += [n for n in dict.fromkeys(out_names) if producer.get(n, last) != last and n not in needs[last]]
        reads: list[dict[int, list[str]]] = [{} for _ in io]
        sends: list[dict[int, list[str]]] = [{} for _ in io]
        for s, names in enumerate(needs):
            for name in names:
                if name in producer:
                    reads[s].setdefault(producer[name], []).append(name)
                    sends[producer[name]].setdefault(s, []).append(name)
        return cls(reads, sends)

    def producers(self) -> list[list[int]]:
        return [sorted(r) for r in self.reads]

    def walks(self, stages: Sequence[Any]) -> tuple[dict[int, list[tuple[int, list[str]]]],
                                                     dict[int, list[tuple[int, list[str]]]], dict[int, list[bool]]]:
        """For each of `stages` (runtime.stage.Stage, held by one rank), what its forward walks, so that a step
        only looks it up: (producer, names) it reads, (consumer, names) it sends, and for each input whether
        it may sit on another device (a caller's input, or a value of another of these stages on another
        device; what a transport delivers is on the stage's device already)."""
        device = {s.index: s.device for s in stages}
        reads = {s.index: list(self.reads[s.index].items()) for s in stages}
        sends = {s.index: list(self.sends[s.index].items()) for s in stages}
        moves = {}
        for s in stages:
            producer = {n: t for t, names in self.reads[s.index].items() for n in names}
            moves[s.index] = [n not in producer or device.get(producer[n], s.device) != s.device for n in s.inputs]
        return reads, sends, moves

    def inline(self, stages: Collection[int], shared: frozenset[tuple[int, int]]) -> set[int]:
        """Those of `stages` whose every read and send is between `shared` (src, dst) pairs (one thread, one
        device: the values go through the workers' shared dict, whatever the micro-batch)."""
        return {s for s in stages if all((t, s) in shared for t in self.reads[s])
                and all((s, c) in shared for c in self.sends[s])}


def stage_aliases(stages: Sequence[Any], routes: Routes) -> dict[str, str]:
    """{value name: pipeline input name} for the values of `stages` (runtime.stage.Stage, in order) that are
    a pipeline input written in place (runtime.mutation.input_aliases); {} where no stage writes into an input."""
    if not any(s.writes for s in stages):
        return {}
    inputs = [n for s in stages for n in s.inputs if not any(n in names for names in routes.reads[s.index].values())]
    graphs = [g for s in stages for g in s.module.modules() if isinstance(g, torch.fx.GraphModule)]
    return input_aliases(graphs, list(dict.fromkeys(inputs)))
