"""Placement search: stages, replicas and cuts (chain DP, branches, hybrid, cluster search, PiPPy policy, chooser)."""

__all__: list[str] = []
