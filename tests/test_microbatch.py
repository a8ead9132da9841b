"""Scatter along the batch dimension and gather back, structure kept."""

from __future__ import annotations

import pytest
import torch

from runtime.microbatch import batch_size, gather, scatter


def test_uneven_split_sizes_and_shared_values() -> None:
    x = torch.arange(10).view(10, 1)
    mask = torch.ones(3, 3)  # not batch-sized: given whole to every micro-batch
    chunks = scatter([x, {"m": mask, "flag": True}], 4)
    assert [c[0].shape[0] for c in chunks] == [3, 3, 2, 2]
    assert all(c[1]["m"] is mask and c[1]["flag"] is True for c in chunks)
    assert torch.equal(torch.cat([c[0] for c in chunks]), x)


def test_gather_restores_structure() -> None:
    outs = [{"a": torch.full((2, 3), float(i)), "b": (torch.ones(2), "tag")} for i in range(3)]
    merged = gather(outs)
    assert merged["a"].shape == (6, 3) and merged["b"][0].shape == (6,) and merged["b"][1] == "tag"
    assert torch.equal(merged["a"][2:4], torch.ones(2, 3))


def test_errors() -> None:
    with pytest.raises(ValueError, match="micro_batches=5 but the batch has 4 samples"):
        scatter([torch.ones(4, 2)], 5)
    with pytest.raises(ValueError, match="micro_batches=0"):
        scatter([torch.ones(4, 2)], 0)
    with pytest.raises(ValueError, match="no batch dimension"):
        batch_size([torch.tensor(1.0)])
    with pytest.raises(ValueError, match="hold no tensor"):
        batch_size([1, None])
    with pytest.raises(ValueError, match="scalar tensor"):
        gather([torch.tensor(1.0), torch.tensor(2.0)])
