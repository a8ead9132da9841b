"""Scatter along the batch dimension and gather back, structure kept."""

from __future__ import annotations

import pytest
import torch

from runtime.microbatch import batch_size, check_merge_spec, gather, scatter


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
    with pytest.raises(ValueError, match=r"output \(the output\) is a tensor of shape \(\) .*output_merge_spec"):
        gather([torch.tensor(1.0), torch.tensor(2.0)])


def test_outputs_without_batch_dimension_merge_by_rule_or_once_never_concatenated() -> None:
    aux = torch.ones(1)
    outs = [(torch.full((2, 3), float(i)), aux, torch.tensor(float(i + 1)), 5) for i in range(3)]
    sizes, batched = [2, 2, 2], [True, False, False]
    with pytest.raises(ValueError, match=r"output \[2\] is a tensor of shape \(\).*output_merge_spec=\{'\[2\]'"):
        gather(outs, sizes, batched)
    y, a, loss, k = gather(outs, sizes, batched, {"[2]": "sum"})
    assert y.shape == (6, 3) and a is aux and float(loss) == 6.0 and k == 5  # same in every micro-batch: once
    assert float(gather(outs, [3, 2, 1], batched, {"[2]": "mean"})[2]) == pytest.approx((1 * 3 + 2 * 2 + 3 * 1) / 6)
    assert float(gather(outs, sizes, batched, "first")[2]) == 1.0
    assert gather(outs, sizes, batched, {"[1]": ("cat", 0), "[2]": "sum"})[1].shape == (3,)
    with pytest.raises(ValueError, match="output_merge_spec rule 'max'"):
        check_merge_spec({"[0]": "max"})  # type: ignore[dict-item]


def test_input_split_spec_dims() -> None:
    x, table = torch.arange(8.0).view(8, 1), torch.arange(16.0).view(8, 2)  # the table has as many rows as the batch
    chunks = scatter([x, table], 4, ["auto", None])
    assert all(c[1] is table for c in chunks) and [c[0].shape[0] for c in chunks] == [2, 2, 2, 2]
    cols = scatter([x, torch.zeros(3, 8)], 2, ["auto", 1])
    assert [tuple(c[1].shape) for c in cols] == [(3, 4), (3, 4)]
