"""Known GPU types (published peaks, memory, bandwidths) from `gpus.json`, found by name as NVML or torch spell it.

    gpu_spec("NVIDIA H100 80GB HBM3")               -> GpuType H100-SXM   (None when unknown)
    gpu_spec("NVIDIA A100-SXM4", memory_bytes=80 GiB) -> GpuType A100-SXM4-80GB
    gpu_type("H1000")                                -> UnknownGpuError naming H100-SXM, ...

A name is cut into tokens ("nvidia", "tesla", "geforce" dropped; "SXM4" read as "sxm"); an entry
matches when all tokens of one of its aliases are in the name, and the entry whose matching alias
has the most tokens wins. Ties go to the entry whose memory is closest to `memory_bytes`, then to
the first in the file, so a plain "A100" on an 80 GB card is the 80 GB part. The table is data:
`GpuTable.load(extra=...)` adds or replaces types from a JSON file or a dict of the same format.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import os
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any, Mapping, Sequence

__all__ = [
    "GpuTable",
    "GpuTableError",
    "GpuType",
    "PRECISIONS",
    "UnknownGpuError",
    "default_table",
    "gpu_spec",
    "gpu_type",
    "precision_of",
]

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "fp8")
_DTYPES = {"float32": "fp32", "float": "fp32", "fp32": "fp32", "tf32": "tf32", "bfloat16": "bf16", "bf16": "bf16",
           "float16": "fp16", "half": "fp16", "fp16": "fp16", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
           "fp8": "fp8"}  # fmt: skip
_DROPPED = {"nvidia", "tesla", "geforce", "gpu"}
Extra = str | os.PathLike[str] | Mapping[str, Any] | Sequence[Mapping[str, Any]] | None


class GpuTableError(ValueError):
    """A GPU table (the built-in file or a user's extension) has problems; the message lists each one."""


class UnknownGpuError(ValueError):
    """A GPU type named by the user is not in the table; the message names close matches."""


def precision_of(dtype: Any) -> str:
    """'fp32', 'tf32', 'bf16', 'fp16' or 'fp8' for a dtype ('bfloat16', torch.float16, 'float8_e4m3fn', ...); others
    read as 'fp32'."""
    return _DTYPES.get(str(dtype).removeprefix("torch.").lower(), "fp32")


@dataclass(frozen=True)
class GpuType:
    """One GPU product: dense peak flop/s per precision, memory, bandwidths (bytes/s), and where they come from.

    `gemm` holds measured fractions of the dense peak that large matrix products reach, by precision (the
    analytic model scales them by shape: cost_model/analytic.py); `attention` the fractions a fused
    attention kernel reaches forward and backward on its own FLOPs; `kernels` says where both come from.
    `memory_efficiency` is the measured fraction of the peak memory bandwidth a large memory-bound kernel
    reaches (None: not measured), `memory_source` where it was measured.
    """

    name: str
    aliases: tuple[str, ...]
    fp32_flops: float
    tf32_flops: float
    bf16_flops: float
    fp16_flops: float
    memory_bytes: int
    memory_bytes_per_s: float  # peak memory bandwidth
    nvlink_bytes_per_s: float  # all NVLinks of one GPU, one direction; 0 where there are none
    source: str = ""  # the vendor's datasheet
    note: str = ""
    gemm: tuple[tuple[str, float], ...] = ()  # (precision, fraction of its peak large products reach), measured
    attention: tuple[float, float] | None = None  # fused attention (forward, backward) fraction of the peak
    kernels: str = ""  # where gemm and attention come from
    fp8_flops: float = 0.0  # FP8 tensor cores' dense peak; 0 where the table gives none (fp16's rate is used)
    memory_efficiency: float | None = None  # measured fraction of memory_bytes_per_s a large copy reaches
    memory_source: str = ""  # where memory_efficiency comes from

    def peak(self, precision: Any) -> float:
        """Dense peak flop/s for a precision or dtype ('tf32', 'bfloat16', torch.float16, ...); fp8 on a GPU the
        table gives no FP8 rate for runs at its fp16 rate (no FP8 tensor cores to run faster on)."""
        key = precision_of(precision)
        if key == "fp8" and not self.fp8_flops:
            key = "fp16"
        return float(getattr(self, f"{key}_flops"))

    def gemm_efficiency(self, precision: Any) -> float | None:
        """The measured fraction of `precision`'s peak that large matrix products reach; None where not measured."""
        return dict(self.gemm).get(precision_of(precision))


def _tokens(name: str) -> frozenset[str]:
    """'NVIDIA A100-SXM4-80GB' -> {'a100', 'sxm', '80gb'}: lower case, split at non-alphanumerics."""
    out = set()
    for token in re.split(r"[^a-z0-9]+", name.lower()):
        if not token or token in _DROPPED:
            continue
        token = re.sub(r"^sxm\d*$", "sxm", token)
        token = re.sub(r"^(\d+)g$", r"\1gb", token)  # '80g' -> '80gb'
        out.add(token)
    return frozenset(out)


def _entry(data: Any, index: int, problems: list[str]) -> GpuType | None:
    """A GpuType from one JSON entry (tflops, memory_gib, GB/s), or None with the problems noted."""
    where = f"gpus[{index}]"
    if not isinstance(data, Mapping):
        problems.append(f"{where}: {data!r} is not an object; write {{'name': ..., 'tflops': {{'fp32': ...}}, ...}}")
        return None
    name = str(data.get("name", "")).strip()
    where = f"gpus[{index}] ({name or 'no name'})"
    known = {"name", "aliases", "tflops", "memory_gib", "memory_gb_per_s", "nvlink_gb_per_s", "source", "note",
             "gemm_efficiency", "attention_efficiency", "kernels", "memory_efficiency", "memory_source"}
    found = len(problems)
    if not name:
        problems.append(f"{where}: needs a 'name', such as 'H100-SXM'")
    unknown = sorted(set(data) - known)
    if unknown:
        problems.append(f"{where}: unknown fields {unknown}; use {sorted(known)}")
    tflops = data.get("tflops")
    if not isinstance(tflops, Mapping) or "fp32" not in tflops:
        problems.append(f"{where}: needs 'tflops' with at least 'fp32' (dense), e.g. {{'fp32': 67, 'bf16': 989}}")
        tflops = {}
    elif set(tflops) - set(PRECISIONS):
        problems.append(f"{where}: tflops has {sorted(set(tflops) - set(PRECISIONS))}; use {list(PRECISIONS)}")
    numbers: dict[str, float] = {}
    fields = {"memory_gib": data.get("memory_gib"), "memory_gb_per_s": data.get("memory_gb_per_s"),
              "nvlink_gb_per_s": data.get("nvlink_gb_per_s", 0), **{f"tflops.{p}": v for p, v in tflops.items()}}
    for key, raw in fields.items():
        try:
            value = float(raw)
        except (TypeError, ValueError):
            problems.append(f"{where}: {key}={raw!r} is not a number")
            continue
        if not math.isfinite(value) or value < 0 or (value == 0 and key != "nvlink_gb_per_s"):
            problems.append(f"{where}: {key}={raw!r}; give a positive number")
        numbers[key] = value
    gemm = data.get("gemm_efficiency", {})
    if not isinstance(gemm, Mapping) or set(gemm) - set(PRECISIONS) or not all(
            isinstance(v, (int, float)) and 0 < v <= 1 for v in gemm.values()):
        problems.append(f"{where}: gemm_efficiency={gemm!r}; give {{precision: fraction of its peak in (0, 1]}} "
                        f"with precisions of {list(PRECISIONS)}")
        gemm = {}
    attention = data.get("attention_efficiency")
    if attention is not None and not (isinstance(attention, Mapping) and set(attention) == {"forward", "backward"}
                                      and all(isinstance(v, (int, float)) and 0 < v <= 1 for v in attention.values())):
        problems.append(f"{where}: attention_efficiency={attention!r}; give {{'forward': f, 'backward': b}}, "
                        "fractions of the peak in (0, 1]")
        attention = None
    memory = data.get("memory_efficiency")
    if memory is not None and not (isinstance(memory, (int, float)) and 0 < memory <= 1):
        problems.append(f"{where}: memory_efficiency={memory!r}; give the measured fraction of memory_gb_per_s, "
                        "in (0, 1]")
    if memory is not None and not str(data.get("memory_source", "")).strip():
        problems.append(f"{where}: memory_efficiency needs a 'memory_source' saying where it was measured")
    aliases = data.get("aliases", [])
    if isinstance(aliases, str) or not isinstance(aliases, Sequence):
        problems.append(f"{where}: aliases must be a list of names, e.g. ['H100', 'H100 SXM']")
        aliases = []
    if len(problems) > found:
        return None

    def scaled(key: str, unit: float, default: float) -> float:
        return float(round(numbers.get(key, default) * unit))  # whole flop/s: 66.9 TFLOPS is 66.9e12 exactly

    fp32 = numbers["tflops.fp32"]
    return GpuType(
        name=name,
        aliases=tuple(str(a) for a in aliases),
        fp32_flops=scaled("tflops.fp32", 1e12, fp32),
        tf32_flops=scaled("tflops.tf32", 1e12, fp32),
        bf16_flops=scaled("tflops.bf16", 1e12, fp32),
        fp16_flops=scaled("tflops.fp16", 1e12, fp32),
        memory_bytes=int(scaled("memory_gib", 1 << 30, 0)),
        memory_bytes_per_s=scaled("memory_gb_per_s", 1e9, 0),
        nvlink_bytes_per_s=scaled("nvlink_gb_per_s", 1e9, 0),
        source=str(data.get("source", "")),
        note=str(data.get("note", "")),
        gemm=tuple((str(k), float(v)) for k, v in gemm.items()),
        attention=(float(attention["forward"]), float(attention["backward"])) if attention else None,
        kernels=str(data.get("kernels", "")),
        fp8_flops=scaled("tflops.fp8", 1e12, 0.0),
        memory_efficiency=float(memory) if memory is not None else None,
        memory_source=str(data.get("memory_source", "")),
    )


def _entries(data: Any, what: str) -> list[GpuType]:
    """Every entry of a table ({'gpus': [...]} or a bare list). Raises GpuTableError listing all problems."""
    raw = data.get("gpus") if isinstance(data, Mapping) else data
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
        raise GpuTableError(f"{what}: expected {{'gpus': [{{'name': ..., 'tflops': {{...}}, ...}}]}} or a list")
    problems: list[str] = []
    types = [t for i, entry in enumerate(raw) if (t := _entry(entry, i, problems)) is not None]
    names = [t.name for t in types]
    doubled = sorted({n for n in names if names.count(n) > 1})
    if doubled:
        problems.append(f"names {doubled} appear twice; give each type one entry")
    if problems:
        raise GpuTableError(f"{what} has problems:\n" + "\n".join(f"- {p}" for p in problems))
    return types


def _read(extra: Extra) -> Any:
    if extra is None or isinstance(extra, (Mapping, list, tuple)):
        return extra
    path = os.fspath(extra)  # type: ignore[arg-type]
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as exc:
        raise GpuTableError(f"cannot read the GPU table {path!r}: {exc}") from None
    except ValueError as exc:
        raise GpuTableError(f"the GPU table {path!r} is not valid JSON: {exc}") from None


class GpuTable:
    """GPU types in a fixed order (earlier entries win ties), found by name."""

    def __init__(self, types: Sequence[GpuType]) -> None:
        self.types = list(types)
        self._keys = [(t, [_tokens(a) for a in (t.name, *t.aliases)]) for t in self.types]

    @classmethod
    def load(cls, extra: Extra = None) -> GpuTable:
        """The built-in table (`cost_model/gpus.json`), with `extra` types first (a path, a dict or a list).

        An extra entry with the name of a built-in one replaces it.

        Raises:
            GpuTableError: a file that cannot be read, or entries with problems (all of them listed).
        """
        return default_table().extended(extra)

    def extended(self, extra: Extra) -> GpuTable:
        """This table with `extra` types added in front (same names replace). Raises GpuTableError."""
        if extra is None:
            return self
        added = _entries(_read(extra), "the extra GPU table")
        names = {t.name for t in added}
        return GpuTable(added + [t for t in self.types if t.name not in names])

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.types]

    def lookup(self, name: str, memory_bytes: int | None = None) -> GpuType | None:
        """The type `name` spells (torch, NVML or a short form), or None when none matches.

        Args:
            name: e.g. "NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-16GB", "H100", "a100 80gb".
            memory_bytes: the device's memory, which picks among equally specific matches.
        """
        tokens = _tokens(name)
        if not tokens:
            return None
        best: list[tuple[int, float, int, GpuType]] = []
        for order, (gpu, keys) in enumerate(self._keys):
            score = max((len(k) for k in keys if k and k <= tokens), default=0)
            if score:
                distance = abs(math.log(memory_bytes / gpu.memory_bytes)) if memory_bytes else 0.0
                best.append((-score, distance, order, gpu))
        return min(best, key=lambda b: b[:3])[3] if best else None

    def get(self, name: str, memory_bytes: int | None = None) -> GpuType:
        """The type `name` spells. Raises UnknownGpuError naming close matches and every known type."""
        found = self.lookup(name, memory_bytes)
        if found is not None:
            return found
        spelled = {" ".join(sorted(k)): gpu.name for gpu, keys in self._keys for k in keys}
        wanted = " ".join(sorted(_tokens(name))) or name.lower()
        close = difflib.get_close_matches(wanted, list(spelled), n=8, cutoff=0.6)
        near = list(dict.fromkeys(spelled[c] for c in close))
        hint = f"; close matches: {', '.join(near)}" if near else ""
        raise UnknownGpuError(
            f"unknown GPU type {name!r}{hint}. Known types: {', '.join(self.names)}. "
            "Add one with GpuTable.load(extra={'gpus': [{'name': ..., 'tflops': {'fp32': ..., 'bf16': ...}, "
            "'memory_gib': ..., 'memory_gb_per_s': ...}]}) (format: cost_model/gpus.json)"
        )


@functools.cache
def default_table() -> GpuTable:
    """The built-in table, read once from the package's `gpus.json`."""
    text = resources.files("cost_model").joinpath("gpus.json").read_text()
    return GpuTable(_entries(json.loads(text), "cost_model/gpus.json"))


def gpu_spec(name: str, memory_bytes: int | None = None, extra: Extra = None) -> GpuType | None:
    """The known type of a device named `name` (as torch or NVML spell it), or None. See `GpuTable.lookup`."""
    return GpuTable.load(extra).lookup(name, memory_bytes)


def gpu_type(name: str, memory_bytes: int | None = None, extra: Extra = None) -> GpuType:
    """The type a user names ("H100", "A100-80GB"). Raises UnknownGpuError naming close matches."""
    return GpuTable.load(extra).get(name, memory_bytes)
