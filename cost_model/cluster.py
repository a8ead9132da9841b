"""A set of devices and the links between them: discovered here, or described by hand in JSON.

    {
      "devices": {
        "cuda:0": {"name": "H100", "flops_per_s": 5e13, "bytes_per_s": 3e12, "memory_bytes": "80GiB"},
        ...
      },
      "links": [{"between": ["cuda:0", "cuda:1"], "kind": "nvlink"}, ...],
      "default_link": "pcie"
    }

Device keys are torch device names ("cpu", "cuda:3"), so the planner's torch.device objects
find their spec even when the cluster is not this machine. A link names a known kind
(`comm.LINK_KINDS`: nvlink, pcie, host, network, loopback) or gives latency_s and bandwidth.
Pairs without a link use `default_link`, else the typical link for their device types.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence

import torch

from cost_model.comm import Link, default_link, p2p_time, ring_allreduce_time, slowest
from cost_model.devices import DeviceError, DeviceSpec

__all__ = ["DeviceDescriptionError", "DeviceSet", "parse_bytes"]

DeviceKey = str | torch.device
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}  # fmt: skip
_ALIASES = {"speed": "flops_per_s", "flops": "flops_per_s", "bandwidth": "bytes_per_s", "memory": "memory_bytes",
            "free_memory": "free_memory_bytes"}


class DeviceDescriptionError(ValueError):
    """A hand-written device description has problems; the message lists each one."""


def parse_bytes(value: Any) -> int:
    """An int byte count from a number or a string such as '80GiB', '16 GB' or '512MiB'.

    Raises:
        ValueError: not a number and not '<number> <unit>' with a unit among B, KB..TB, KiB..TiB.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{value!r} is not a size; write a number of bytes or e.g. '80GiB', '16GB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _key(device: DeviceKey) -> str:
    return str(torch.device(device))


def _spec_from_dict(key: str, data: Mapping[str, Any], problems: list[str]) -> DeviceSpec | None:
    known = {f.name for f in fields(DeviceSpec)}
    values: dict[str, Any] = {}
    for name, value in data.items():
        target = _ALIASES.get(name, name)
        if target not in known:
            problems.append(f"device {key!r}: unknown field {name!r}; use {sorted(known | set(_ALIASES))}")
            continue
        values[target] = value
    values.setdefault("name", key)
    values.setdefault("kind", torch.device(key).type)
    values.setdefault("op_overhead_s", 5e-6)
    values.setdefault("flops_per_s", 0.0)
    values.setdefault("bytes_per_s", 0.0)
    try:
        for name in ("memory_bytes", "free_memory_bytes"):
            if values.get(name) is not None:
                values[name] = parse_bytes(values[name])
        values.setdefault("memory_bytes", 0)
        for name in ("flops_per_s", "bytes_per_s", "op_overhead_s"):
            values[name] = float(values[name])
            if values[name] < 0:
                raise ValueError(f"{name}={values[name]} is negative")
        if values.get("compute_capability") is not None:
            values["compute_capability"] = tuple(int(x) for x in values["compute_capability"])
    except (TypeError, ValueError) as exc:
        problems.append(f"device {key!r}: {exc}")
        return None
    return DeviceSpec(**values)


@dataclass
class DeviceSet:
    """Devices by torch device name, and the links between pairs of them."""

    devices: dict[str, DeviceSpec]
    links: dict[frozenset[str], Link] = field(default_factory=dict)
    default_link: Link | None = None

    @property
    def names(self) -> list[str]:
        return list(self.devices)

    def spec(self, device: DeviceKey) -> DeviceSpec:
        """The spec of `device`. Raises DeviceError naming the devices this set has."""
        key = _key(device)
        if key not in self.devices:
            raise DeviceError(
                f"{key} is not in this device set ({', '.join(self.devices) or 'empty'}); describe it or plan on those"
            )
        return self.devices[key]

    def link(self, a: DeviceKey, b: DeviceKey) -> Link:
        """The link between two devices: described, else `default_link`, else the typical one."""
        ka, kb = _key(a), _key(b)
        if ka == kb:
            return default_link(torch.device(ka), torch.device(kb))
        found = self.links.get(frozenset((ka, kb)))
        if found is not None:
            return found
        return self.default_link or default_link(torch.device(ka), torch.device(kb))

    def transfer_time(self, nbytes: float, src: DeviceKey, dst: DeviceKey) -> float:
        """Point-to-point seconds: latency + nbytes / bandwidth of the pair's link."""
        return p2p_time(nbytes, self.link(src, dst))

    def allreduce_time(self, nbytes: float, devices: Sequence[DeviceKey]) -> float:
        """Ring all-reduce of `nbytes` over `devices` in this order (the ring closes at the end)."""
        n = len(devices)
        if n <= 1:
            return 0.0
        ring = [self.link(devices[i], devices[(i + 1) % n]) for i in range(n)]
        return ring_allreduce_time(nbytes, n, slowest(ring))

    def to_dict(self) -> dict[str, Any]:
        devices = {}
        for key, spec in self.devices.items():
            entry = {f.name: getattr(spec, f.name) for f in fields(DeviceSpec)}
            if entry["compute_capability"] is not None:
                entry["compute_capability"] = list(entry["compute_capability"])
            devices[key] = entry
        links = [
            {"between": sorted(pair), **link.to_dict()}
            for pair, link in sorted(self.links.items(), key=lambda kv: sorted(kv[0]))
        ]
        out: dict[str, Any] = {"devices": devices, "links": links}
        if self.default_link is not None:
            out["default_link"] = self.default_link.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceSet:
        """Build from a description (see the module docstring).

        Raises:
            DeviceDescriptionError: every problem found, one per line, each with its fix.
        """
        problems: list[str] = []
        raw = data.get("devices") if isinstance(data, Mapping) else None
        if isinstance(raw, Sequence) and not isinstance(raw, str):  # a list of {"device": "cuda:0", ...}
            raw = {str(d.get("device", d.get("name", ""))): {k: v for k, v in d.items() if k != "device"} for d in raw}
        if not isinstance(raw, Mapping) or not raw:
            raise DeviceDescriptionError(
                'the description needs \'devices\': {"cuda:0": {"flops_per_s": ..., "memory_bytes": ...}, ...}'
            )
        devices: dict[str, DeviceSpec] = {}
        for name, entry in raw.items():
            try:
                key = _key(name)
            except (RuntimeError, TypeError):
                problems.append(f"device {name!r} is not a torch device name; use 'cpu', 'cuda:0', ...")
                continue
            spec = _spec_from_dict(key, entry if isinstance(entry, Mapping) else {}, problems)
            if spec is not None:
                devices[key] = spec
        links: dict[frozenset[str], Link] = {}
        for i, entry in enumerate(data.get("links", []) or []):
            try:
                between = [_key(x) for x in entry["between"]]
                if len(between) != 2 or between[0] == between[1]:
                    raise ValueError("'between' must name two different devices")
                unknown = [b for b in between if b not in devices]
                if unknown:
                    raise ValueError(f"{unknown} not among the devices")
                links[frozenset(between)] = Link.from_dict({k: v for k, v in entry.items() if k != "between"})
            except (KeyError, TypeError, ValueError, RuntimeError) as exc:
                problems.append(f'links[{i}]: {exc}; write {{"between": ["cuda:0", "cuda:1"], "kind": "nvlink"}}')
        fallback = None
        if data.get("default_link") is not None:
            try:
                fallback = Link.from_dict(data["default_link"])
            except (TypeError, ValueError) as exc:
                problems.append(f"default_link: {exc}")
        if problems:
            raise DeviceDescriptionError(
                "the device description has problems:\n" + "\n".join(f"- {p}" for p in problems)
            )
        return cls(devices, links, fallback)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> DeviceSet:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise DeviceDescriptionError(f"the device description is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> DeviceSet:
        with open(path) as f:
            return cls.from_json(f.read())
