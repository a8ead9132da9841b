"""Public face of models on `meta`: `with partitioner.meta.empty_weights(): model = Model()`."""

from partitioner.capture.meta import empty_weights

__all__ = ["empty_weights"]
