"""The search over a cluster's GPUs by counts: tensor x stages x replicas, sharding, rank order, then the cuts."""

__all__: list[str] = []
