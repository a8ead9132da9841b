"""What a stage splits across its tensor-parallel group: parameter names and their shardings, plain data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

__all__ = ["STYLES", "ShardedParam", "Style", "TensorParallelGroup"]

# colwise: a Linear's (or Conv1D's) output features are split, so its output is split on its last dim;
# rowwise: its input features, so it sums partial outputs (one all-reduce); vocab: an embedding table's
# rows (each rank looks up its part of the vocabulary; one all-reduce), or an LM head tied to it.
Style = Literal["colwise", "rowwise", "vocab"]
STYLES: tuple[str, ...] = get_args(Style)


@dataclass(frozen=True)
class ShardedParam:
    """One parameter of a group: its name in the stage module (the model's state_dict key) and its split.

    `dim` is the parameter's dimension split across the group (nn.Linear weight [out, in]: colwise 0,
    rowwise 1; Hugging Face Conv1D weight [in, out]: colwise 1, rowwise 0; a colwise bias 0), or None
    for a parameter the group keeps whole on every rank (a rowwise bias, added once after the sum).
    `fused` > 1: the parameter holds that many equal blocks along `dim` (q, k and v in one Linear),
    and each block is split alike, so every rank holds whole heads of each.
    """

    name: str
    style: Style
    dim: int | None
    fused: int = 1

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise ValueError(f"parameter {self.name!r}: style {self.style!r} is not one of {STYLES}")
        if self.fused < 1:
            raise ValueError(f"parameter {self.name!r}: fused={self.fused}; it counts equal blocks, so 1 or more")
        if self.fused > 1 and self.dim is None:
            raise ValueError(f"parameter {self.name!r}: fused={self.fused} needs the dim its blocks lie along")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "style": self.style, "dim": self.dim, "fused": self.fused}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardedParam:
        return cls(str(data["name"]), data["style"], data["dim"], int(data.get("fused", 1)))


@dataclass(frozen=True)
class TensorParallelGroup:
    """Layers split together with one collective each way: colwise (or vocab) parameters, then rowwise ones.

    The values between the colwise layers' outputs and the rowwise layers' inputs stay split on every
    rank (runtime.tensor_parallel finds them in the stage graph); a group without rowwise parameters
    (an embedding, an LM head) is split alone and its output made whole again.
    """

    name: str
    params: tuple[ShardedParam, ...]

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"group {self.name!r} names a parameter twice: {names}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "params": [p.to_dict() for p in self.params]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorParallelGroup:
        return cls(str(data["name"]), tuple(ShardedParam.from_dict(p) for p in data["params"]))
