"""Graph capture: a model and its example into an annotated graph (trace, leaves, graph, analysis, meta, fidelity)."""

__all__: list[str] = []
