"""A checkpoint read under the model's own names: the renames and conversions transformers' `from_pretrained` applies.

[Note: checkpoint names a model does not use] Hugging Face models load checkpoints whose keys are
not their own state-dict keys: legacy names (GPT-NeoX's `embed_out.weight` is `lm_head.weight`;
`save_pretrained` writes it back so), and layouts converted on load (Mixtral's experts, saved one
`experts.{i}.w1.weight` each, are stacked into `experts.gate_up_proj`). transformers lists both per
model (`conversion_mapping.get_model_conversion_mapping`: `WeightRenaming` and `WeightConverter`
entries) and renames every checkpoint key through them (`core_model_loading.rename_source_key`),
falling back to the key itself where the renamed one is not the model's. `named_as_model` does the
same and returns a `WeightSource` keyed by the model's names: a renamed key reads its one tensor;
a converted key reads its source tensors (the experts of one layer) and runs the converter's
operations, so the host holds that layer's tensors twice for a moment. Anything else (not a
transformers model, transformers absent or too old to have the mapping) reads the keys as they are.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
from torch import nn

from runtime.errors import PartitionError
from runtime.weights import WeightSource

__all__ = ["NamedSource", "named_as_model"]


def _mapping(model: nn.Module) -> tuple[list[Any], list[Any], Any] | None:
    """(renamings, converters, rename function) transformers loads `model` with; None where there are none."""
    if not type(model).__module__.startswith("transformers.") or not hasattr(model, "config"):
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # transformers 4, or a layout of 5 without these: keys read as they are
        return None
    transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]  # a PreTrainedModel (module above)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return (renamings, converters, rename_source_key) if renamings or converters else None


def _natural(key: str) -> list[Any]:
    """Sort key for 'experts.10' after 'experts.9' (the order a converter stacks its sources in)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


class NamedSource:
    """`inner` under the model's names: `renamed` model key -> file key, `converted` model key -> (converter,
    [(file key, source pattern)]); `unused` are the file's keys that name no tensor of the model."""

    def __init__(self, inner: WeightSource, renamed: dict[str, str],
                 converted: dict[str, tuple[Any, list[tuple[str, str]]]], model: nn.Module, unused: list[str]) -> None:
        self.inner = inner
        self.unused = unused
        self.renamed = renamed
        self.converted = converted
        self.model = model
        self.specs = {k: (tuple(t.shape), t.dtype) for k, t in model.state_dict(keep_vars=True).items()}

    def keys(self) -> list[str]:
        return [*self.renamed, *self.converted]

    def spec(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        if key in self.renamed:
            return self.inner.spec(self.renamed[key])
        return self.specs[key]  # checked against what the conversion gives in read_into

    def read_into(self, key: str, out: torch.Tensor) -> None:
        if key in self.renamed:
            self.inner.read_into(self.renamed[key], out)
            return
        value = self._convert(key)
        if tuple(value.shape) != tuple(out.shape):
            sources = ", ".join(k for k, _ in self.converted[key][1][:3])
            raise PartitionError(f"{key!r}: converting the checkpoint's {sources} ... as from_pretrained does gives "
                                 f"shape {tuple(value.shape)}, the model expects "
                                 f"{tuple(out.shape)}; build the model with the checkpoint's configuration")
        with torch.no_grad():
            out.copy_(value)

    def _convert(self, key: str) -> torch.Tensor:
        template, sources = self.converted[key]
        converter = copy.deepcopy(template)
        for file_key, pattern in sources:
            shape, dtype = self.inner.spec(file_key)
            tensor = torch.empty(shape, dtype=dtype)
            self.inner.read_into(file_key, tensor)
            converter.add_tensor(key, file_key, pattern, tensor)
        made = converter.convert(key, model=self.model, config=getattr(self.model, "config", None))
        value = made.get(key)
        if value is None:
            raise PartitionError(f"{key!r}: converting the checkpoint's {len(sources)} tensors as from_pretrained does "
                                 f"gave {', '.join(list(made)[:3])}, not this key")
        result: torch.Tensor = value[0] if isinstance(value, list) else value
        return result

    def close(self) -> None:
        self.inner.close()


def named_as_model(source: WeightSource, model: nn.Module) -> WeightSource:
    """`source` read under `model`'s state-dict names (see [Note: checkpoint names a model does not use])."""
    found = _mapping(model)
    if found is None:
        return source
    renamings, converters, rename = found
    own = dict.fromkeys(model.state_dict(keep_vars=True), True)
    prefix = getattr(model, "base_model_prefix", None)
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    renamed: dict[str, str] = {}
    converted: dict[str, tuple[Any, list[tuple[str, str]]]] = {}
    unused: list[str] = []
    for key in sorted(source.keys(), key=_natural):
        name, pattern = rename(key, renamings, converters, prefix, own)
        if name not in own and key in own:
            name, pattern = key, None
        if name not in own:
            unused.append(key)
            continue
        if pattern is None:
            if name not in renamed or key == name:  # the model's own name wins over a legacy one
                renamed[name] = key
            continue
        converter = by_pattern[pattern]
        for target in converter.target_patterns:  # one source may give several targets (qkv -> q, k, v)
            converted.setdefault(name.replace(converter.target_patterns[0], target), (converter, []))[1].append(
                (key, pattern))
    if all(k == v for k, v in renamed.items()) and not converted:
        return source
    return NamedSource(source, renamed, converted, model, unused)
