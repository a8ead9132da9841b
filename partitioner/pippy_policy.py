"""Public face of our cost-based split for torch.distributed.pipelining.pipeline(...) (place/pippy_policy.py)."""

from partitioner.place.pippy_policy import split_policy

__all__ = ["split_policy"]
