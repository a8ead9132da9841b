"""Hand-made graphs shaped like build_graph's, for analysis tests and the analysis benchmark."""

from __future__ import annotations

import networkx as nx

OPS = {"x": "placeholder", "a_in": "placeholder", "b_in": "placeholder", "output": "output"}


def dag(edges: list[tuple[str, str]], out_bytes: dict[str, int] | None = None) -> nx.DiGraph:
    """A graph shaped like build_graph's: vertices in first-seen order, `w*` are get_attr weights."""
    graph = nx.DiGraph()
    for u, v in edges:
        for name in (u, v):
            if name not in graph:
                op = "get_attr" if name.startswith("w") else OPS.get(name, "call_function")
                nbytes = (out_bytes or {}).get(name, 4)
                graph.add_node(name, name=name, op=op, position=len(graph), out_bytes=nbytes, flops=0)
        graph.add_edge(u, v, bytes=graph.nodes[u]["out_bytes"])
    return graph


def fork_join_graph(blocks: int) -> nx.DiGraph:
    """Blocks of 9 vertices, x -> (a | c -> (d | e) -> dj | f) -> cat -> add(x, .) with a weight on a:
    three nested fork/join regions a block."""
    edges: list[tuple[str, str]] = []
    prev = "x"
    for b in range(blocks):
        edges += [(f"w{b}", f"a{b}"), (prev, f"a{b}"), (prev, f"c{b}"), (f"c{b}", f"d{b}"), (f"c{b}", f"e{b}")]
        edges += [(f"d{b}", f"dj{b}"), (f"e{b}", f"dj{b}"), (prev, f"f{b}"), (f"a{b}", f"cat{b}")]
        edges += [(f"dj{b}", f"cat{b}"), (f"f{b}", f"cat{b}"), (f"cat{b}", f"add{b}"), (prev, f"add{b}")]
        prev = f"add{b}"
    return dag(edges + [(prev, "output")])
