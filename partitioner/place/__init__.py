"""Placement: where nodes and ranks go (planning.py chooses; chain DP, branches, and the two searches on search/)."""

__all__: list[str] = []
