"""Training precision as data: the dtype of each state a trainer keeps, and the bytes per parameter it implies.

    state       dtype field   what it is                                         mixed (default)   pure bf16
    weights     compute       the copy forward and backward read                 2 (bf16)          2
    master      param         the stored weights the optimizer updates, where    4 (fp32)          0 (they are
                              they are not the compute copy                                            the weights)
    gradients   grad          what backward makes and the optimizer reads        4 (fp32)          2
    optimizer   state         Adam/AdamW: 2 states, SGD with momentum 1, SGD 0,  8 (2 x fp32)      4
                              Adafactor: a row and a column per matrix

The default is what torch.amp trains with: fp32 parameters (the master weights), bf16 autocast
compute, fp32 gradients and fp32 Adam moments. What a trainer keeps per parameter (the "bytes
per parameter before activations") is master (or the weights, where they are one) + gradients +
optimizer: 4 + 4 + 8 = 16 for the default, 8 for pure bf16 (every state bf16), 16 for fp32.
The bf16 compute copy is not kept between steps: autocast makes it in forward and autograd holds
it until backward (FSDP2 holds it as the gathered weights), so it counts at the step's peak
(cost_model/training_memory.py). Megatron-style bf16 weights with an fp32 master and bf16
gradients (param="float32" as master, compute and grad "bfloat16") also keep 2 + 2 + 4 + 8 = 16
at the peak; "fp32 master and Adam moments" alone are 12 bytes per parameter (ZeRO's K = 12).

An optimizer is named ("adam", "adamw", "sgd", "sgd_momentum", "adafactor", ...) or read from an
optimizer object (`optimizer_name`): torch.optim.Adam with amsgrad keeps a third state, SGD keeps
a momentum buffer only when momentum > 0, Adafactor factors its second moment (rows + columns of
each matrix, the whole of a vector) and keeps no first moment.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from math import prod
from typing import Any, Iterable, Mapping, Sequence

from cost_model.memory import OPTIMIZER_STATES

__all__ = ["DTYPE_BYTES", "FP32", "MIXED", "OPTIMIZERS", "PURE_BF16", "BytesPerParam", "Precision", "dtype_name",
           "optimizer_name", "optimizer_state_elements"]  # fmt: skip

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
_ALIASES = {"fp64": "float64", "double": "float64", "fp32": "float32", "float": "float32", "bf16": "bfloat16",
            "fp16": "float16", "half": "float16", "fp8": "float8_e4m3fn"}
# Full-size states per parameter; "adafactor" keeps factored ones (optimizer_state_elements).
OPTIMIZERS = {**OPTIMIZER_STATES, "amsgrad": 3, "adamax": 2, "nadam": 2, "radam": 2, "adadelta": 2, "adagrad": 1,
              "rmsprop": 1, "rmsprop_momentum": 2, "adafactor": 0}
_FACTORED = {"adafactor"}


def dtype_name(dtype: Any) -> str:
    """'bf16', 'bfloat16' or torch.bfloat16 -> 'bfloat16'.

    Raises:
        ValueError: a dtype whose size is not known, naming the known ones.
    """
    name = str(dtype).removeprefix("torch.").lower()
    name = _ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)} (or {sorted(_ALIASES)})")
    return name


def _optimizer_key(name: str) -> str:
    key = name.lower().replace(" ", "_").replace("-", "_")
    if key not in OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is not one of {sorted(OPTIMIZERS)}; name the closest one, "
                         "or pass the optimizer object to Precision.with_optimizer")
    return key


def optimizer_name(optimizer: Any) -> str:
    """The OPTIMIZERS name of an optimizer object (torch.optim or one named like it), from its class and settings.

    Raises:
        ValueError: an optimizer class this module does not know, naming the known ones.
    """
    cls = type(optimizer).__name__.lower()
    groups = getattr(optimizer, "param_groups", None) or [getattr(optimizer, "defaults", {}) or {}]

    def setting(key: str) -> bool:
        return any(bool(g.get(key)) for g in groups)

    if cls in ("adam", "adamw"):
        return "amsgrad" if setting("amsgrad") else cls
    if cls == "sgd":
        return "sgd_momentum" if setting("momentum") else "sgd"
    if cls == "rmsprop":
        return "rmsprop_momentum" if setting("momentum") else "rmsprop"
    return _optimizer_key(cls)


def optimizer_state_elements(optimizer: str, shapes: Iterable[Sequence[int]]) -> int:
    """Elements of optimizer state for parameters of these shapes (scalars such as Adam's step not counted).

    Adafactor: a matrix (or any tensor of 2 or more dims) r x c keeps r + c (its row and column
    second moments; prod(shape[:-1]) + prod(shape[:-2]) * c for more dims), a vector all of it.
    """
    key = _optimizer_key(optimizer)
    shapes = [tuple(s) for s in shapes]
    if key in _FACTORED:
        return sum(prod(s[:-1]) + prod(s[:-2]) * s[-1] if len(s) >= 2 else prod(s) for s in shapes)
    return OPTIMIZERS[key] * sum(prod(s) for s in shapes)


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes one parameter costs in each state (see the module docstring); `kept` is what lives between steps."""

    weights: float
    master: float
    gradients: float
    optimizer: float

    @property
    def kept(self) -> float:
        """Master (or the weights, where they are one), gradients and optimizer: a trainer's bytes per parameter."""
        return (self.master or self.weights) + self.gradients + self.optimizer

    @property
    def peak(self) -> float:
        """Every state at once, the compute copy included (a step's peak before activations)."""
        return self.weights + self.master + self.gradients + self.optimizer


@dataclass(frozen=True)
class Precision:
    """The dtypes of a trainer's states (see the module docstring). Names or torch dtypes; kept as names.

    Args:
        compute: what forward and backward read and run in (autocast's dtype; FSDP2's param_dtype).
        param: the stored weights the optimizer updates (the master weights where compute differs).
        grad: the gradients: made, reduced and kept in (FSDP2's reduce_dtype).
        state: the optimizer's states.
        optimizer: an OPTIMIZERS name (`with_optimizer` reads one from an optimizer object).
        name: a label for tables and messages (default: made from the dtypes).
        matmul: the dtype matrix products run in where it is not `compute` ("" : compute's). FP8 training
            ("float8_e4m3fn": Transformer Engine's fp8_autocast, DeepSeek-V3's FP8 GEMMs) runs every product's
            forward and backward at the GPU's FP8 rate (cost_model.analytic: AnalyticCostModel(matmul=...)) and
            keeps each weight's FP8 copy and its transpose for the step (`matmul_copy_bytes`: Hopper's FP8
            tensor cores read both operands K-major, so backward needs the transposed copy).
    """

    compute: str = "bfloat16"
    param: str = "float32"
    grad: str = "float32"
    state: str = "float32"
    optimizer: str = "adam"
    name: str = ""
    matmul: str = ""

    def __post_init__(self) -> None:
        for field in ("compute", "param", "grad", "state"):
            object.__setattr__(self, field, dtype_name(getattr(self, field)))
        if self.matmul:
            object.__setattr__(self, "matmul", dtype_name(self.matmul))
        object.__setattr__(self, "optimizer", _optimizer_key(self.optimizer))

    @property
    def mixed(self) -> bool:
        """Forward runs in another dtype than the stored weights: the stored ones are a master copy."""
        return self.compute != self.param

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        parts = dict.fromkeys([self.compute, self.param, self.grad, self.state])
        short = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "float64": "fp64"}
        return f"{'/'.join(short.get(p, p) for p in parts)} {self.optimizer}"

    @property
    def matmul_copy_bytes(self) -> int:
        """Bytes per parameter of the weights' copies for products in another dtype: the copy and its transpose
        (Transformer Engine caches both for a step's micro-batches); 0 where products run at `compute`."""
        return 2 * DTYPE_BYTES[self.matmul] if self.matmul and self.matmul != self.compute else 0

    def itemsize(self, field: str) -> int:
        """Bytes of one element of `field` ("compute", "param", "grad" or "state")."""
        return DTYPE_BYTES[getattr(self, field)]

    def state_elements_per_param(self) -> float:
        """Optimizer state elements per parameter element, for dense tensors (Adafactor: 0, see state_elements)."""
        return 0.0 if self.optimizer in _FACTORED else float(OPTIMIZERS[self.optimizer])

    def state_elements(self, shapes: Iterable[Sequence[int]]) -> int:
        """Optimizer state elements for parameters of these shapes (`optimizer_state_elements`)."""
        return optimizer_state_elements(self.optimizer, shapes)

    def bytes_per_param(self) -> BytesPerParam:
        """Bytes per parameter in each state (Adafactor's factored state counts 0 here: it depends on shapes)."""
        weights = float(self.itemsize("compute") if self.mixed else self.itemsize("param")) + self.matmul_copy_bytes
        return BytesPerParam(weights=weights, master=float(self.itemsize("param")) if self.mixed else 0.0,
                             gradients=float(self.itemsize("grad")),
                             optimizer=self.state_elements_per_param() * self.itemsize("state"))

    def with_optimizer(self, optimizer: Any) -> Precision:
        """This precision with the optimizer named, or read from an optimizer object (`optimizer_name`)."""
        return replace(self, optimizer=optimizer if isinstance(optimizer, str) else optimizer_name(optimizer))

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Precision:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    @classmethod
    def of(cls, value: Any) -> Precision | None:
        """A Precision from what plan(precision=...) takes: None, a Precision, a name or dtype form (`parse`),
        or an optimizer object (the default mixed precision with that optimizer, `optimizer_name`).

        Raises:
            ValueError: anything else, or a name of none of `parse`'s forms.
        """
        if value is None or isinstance(value, Precision):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if hasattr(value, "param_groups") or hasattr(value, "defaults"):
            found = MIXED.with_optimizer(value)
            return replace(found, name=f"mixed {found.optimizer}")
        raise ValueError(f"precision={value!r}; give a name ('mixed', 'bf16', 'fp32'), 'COMPUTE/PARAM/GRAD/STATE"
                         "[:OPTIMIZER]', a cost_model.precision.Precision, or the torch optimizer you train with")

    @classmethod
    def parse(cls, text: str) -> Precision:
        """'mixed' (the default), 'bf16' (pure bf16), 'fp32', or 'COMPUTE/PARAM/GRAD/STATE[:OPTIMIZER]'
        ('bf16/fp32/bf16/fp32:adamw'), as a CLI's --precision takes it.

        Raises:
            ValueError: text of none of these forms.
        """
        named = {"mixed": MIXED, "amp": MIXED, "bf16": PURE_BF16, "pure_bf16": PURE_BF16, "fp32": FP32}
        key = text.strip().lower()
        if key in named:
            return named[key]
        dtypes, _, optimizer = key.partition(":")
        parts = dtypes.split("/")
        if len(parts) != 4:
            raise ValueError(f"precision {text!r} is not one of {sorted(named)} nor "
                             "'COMPUTE/PARAM/GRAD/STATE[:OPTIMIZER]' (e.g. 'bf16/fp32/fp32/fp32:adam')")
        compute, param, grad, state = parts
        return cls(compute, param, grad, state, optimizer=optimizer or "adam")


MIXED = Precision(name="mixed")  # torch.amp: bf16 compute, fp32 weights (master), gradients and Adam moments
PURE_BF16 = Precision("bfloat16", "bfloat16", "bfloat16", "bfloat16", name="pure bf16")
FP32 = Precision("float32", "float32", "float32", "float32", name="fp32")
