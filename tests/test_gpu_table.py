"""The GPU table: its data, lookup by every spelling torch and NVML use, unknown names, user extensions."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from cost_model.gpu_table import (
    PRECISIONS,
    GpuTable,
    GpuTableError,
    UnknownGpuError,
    default_table,
    gpu_spec,
    gpu_type,
    precision_of,
)

GIB = 1 << 30


def test_every_builtin_entry_is_complete_and_dense() -> None:
    table = default_table()
    assert len(table.names) >= 17 and len(set(table.names)) == len(table.names)
    for gpu in table.types:
        assert gpu.source.startswith("https://"), gpu.name
        assert gpu.memory_bytes >= 16 * GIB and gpu.memory_bytes_per_s >= 300e9 and gpu.nvlink_bytes_per_s >= 0
        # tensor-core precisions never below fp32; no dense bf16 figure above 2.5 PFLOP/s (a sparse one crept in)
        assert gpu.fp32_flops <= gpu.tf32_flops <= gpu.bf16_flops <= 2.5e15, gpu.name
        assert gpu.fp16_flops >= gpu.fp32_flops


def test_published_figures_of_the_common_types() -> None:
    h100 = gpu_type("H100")
    assert h100.name == "H100-SXM"
    got = (h100.fp32_flops, h100.tf32_flops, h100.bf16_flops, h100.fp16_flops)
    assert got == pytest.approx((66.9e12, 494.7e12, 989.4e12, 989.4e12))
    assert (h100.memory_bytes, h100.memory_bytes_per_s, h100.nvlink_bytes_per_s) == (80 * GIB, 3.35e12, 450e9)
    a100 = gpu_type("A100-80GB")
    assert (a100.name, a100.bf16_flops, a100.tf32_flops, a100.memory_bytes_per_s) == (
        "A100-SXM4-80GB", 312e12, 156e12, 2039e9)
    assert gpu_type("A100-40GB").memory_bytes_per_s == 1555e9
    v100 = gpu_type("V100")
    assert v100.tf32_flops == v100.bf16_flops == v100.fp32_flops == 15.7e12 and v100.fp16_flops == 125e12
    assert gpu_type("L4").bf16_flops == 121e12  # the datasheet's 242 is with sparsity
    assert gpu_type("H200").memory_bytes == 141 * GIB


@pytest.mark.parametrize(
    "name, memory_gib, expected",
    [
        # as torch.cuda.get_device_name / NVML spell them
        ("NVIDIA H100 80GB HBM3", 79.1, "H100-SXM"),
        ("NVIDIA H100 PCIe", 79.1, "H100-PCIe"),
        ("NVIDIA H100 NVL", 93.6, "H100-NVL"),
        ("NVIDIA H200", 139.8, "H200"),
        ("NVIDIA H200 NVL", 139.8, "H200-NVL"),
        ("NVIDIA A100-SXM4-80GB", 79.2, "A100-SXM4-80GB"),
        ("NVIDIA A100-SXM4-40GB", 39.4, "A100-SXM4-40GB"),
        ("NVIDIA A100-PCIE-40GB", 39.4, "A100-PCIe-40GB"),
        ("NVIDIA A100 80GB PCIe", 79.2, "A100-PCIe-80GB"),
        ("Tesla V100-SXM2-16GB", 15.8, "V100-SXM2-16GB"),
        ("Tesla V100-SXM2-32GB", 31.7, "V100-SXM2-32GB"),
        ("Tesla V100-PCIE-32GB", 31.7, "V100-PCIe-32GB"),
        ("Tesla T4", 14.6, "T4"),
        ("NVIDIA A10", 22.1, "A10"),
        ("NVIDIA L4", 22.0, "L4"),
        ("NVIDIA L40S", 44.4, "L40S"),
        ("NVIDIA GeForce RTX 4090", 23.6, "RTX-4090"),
        ("NVIDIA B200", 178.4, "B200"),
        # short forms a user types
        ("h100", None, "H100-SXM"),
        ("H100-SXM5-80GB", None, "H100-SXM"),
        ("a100_80gb", None, "A100-SXM4-80GB"),
        ("A100-SXM-40G", None, "A100-SXM4-40GB"),
        ("RTX4090", None, None),  # one token: not 'rtx 4090'
        ("4090", None, "RTX-4090"),
    ],
)
def test_lookup_by_every_spelling(name: str, memory_gib: float | None, expected: str | None) -> None:
    found = gpu_spec(name, int(memory_gib * GIB) if memory_gib else None)
    assert (found.name if found else None) == expected


def test_memory_picks_among_equally_specific_matches() -> None:
    assert gpu_spec("NVIDIA A100-SXM4", 79 * GIB).name == "A100-SXM4-80GB"  # type: ignore[union-attr]
    assert gpu_spec("NVIDIA A100-SXM4", 39 * GIB).name == "A100-SXM4-40GB"  # type: ignore[union-attr]
    assert gpu_spec("A100", 40 * GIB).name == "A100-SXM4-40GB"  # type: ignore[union-attr]
    assert gpu_spec("A100").name == "A100-SXM4-80GB"  # type: ignore[union-attr]  # first in the file
    assert gpu_spec("A100 PCIe", 39 * GIB).name == "A100-PCIe-40GB"  # type: ignore[union-attr]
    # the name's own memory is more specific than the device's
    assert gpu_spec("NVIDIA A100-SXM4-40GB", 80 * GIB).name == "A100-SXM4-40GB"  # type: ignore[union-attr]


def test_devices_that_are_not_in_the_table() -> None:
    for name in ("cpu", "cuda:0", "NVIDIA A10G", "NVIDIA L40", "Tesla V100S-PCIE-32GB", "", "gpu", "NVIDIA"):
        assert gpu_spec(name) is None, name


def test_unknown_type_names_close_matches_and_how_to_add_one() -> None:
    with pytest.raises(UnknownGpuError) as info:
        gpu_type("H1000")
    message = str(info.value)
    assert "'H1000'" in message and "close matches: H100-SXM" in message
    assert "B200" in message and "extra=" in message  # every known type, and the fix
    with pytest.raises(UnknownGpuError, match="close matches: A10"):
        gpu_type("A10G")
    with pytest.raises(ValueError, match="Known types"):  # a ValueError, as the other bad-input errors
        gpu_type("TPU-v5")


ENTRY = {
    "name": "MI300X",
    "aliases": ["AMD Instinct MI300X", "MI300X"],
    "tflops": {"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4},
    "memory_gib": 192,
    "memory_gb_per_s": 5300,
    "source": "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html",
}


def test_user_extension_from_a_dict_or_a_file(tmp_path: Any) -> None:
    assert gpu_spec("AMD Instinct MI300X") is None
    table = GpuTable.load(extra={"gpus": [ENTRY]})
    mi300 = table.get("AMD Instinct MI300X")
    assert (mi300.bf16_flops, mi300.memory_bytes, mi300.nvlink_bytes_per_s) == (1307.4e12, 192 * GIB, 0.0)
    assert table.get("H100").name == "H100-SXM"  # the built-in types stay
    path = tmp_path / "mine.json"
    path.write_text(json.dumps([ENTRY]))  # a bare list works too
    assert gpu_spec("MI300X", extra=path).name == "MI300X"  # type: ignore[union-attr]
    assert gpu_type("MI300X", extra=str(path)).fp32_flops == 163.4e12
    assert default_table().lookup("MI300X") is None  # the built-in table is not changed


def test_extension_replaces_a_builtin_type_and_wins_ties() -> None:
    slower = {**ENTRY, "name": "H100-SXM", "aliases": ["H100"], "tflops": {"fp32": 60}, "memory_gib": 80}
    table = GpuTable.load(extra={"gpus": [slower]})
    h100 = table.get("NVIDIA H100 80GB HBM3")
    assert h100.bf16_flops == h100.tf32_flops == 60e12  # missing precisions run at the fp32 rate
    assert table.names.count("H100-SXM") == 1 and table.names[0] == "H100-SXM"
    custom = {**ENTRY, "name": "H100-cloud", "aliases": ["H100"], "memory_gib": 80}
    assert GpuTable.load(extra=[custom]).get("H100").name == "H100-cloud"  # extras first among equals


def test_bad_extension_lists_every_problem(tmp_path: Any) -> None:
    bad = [
        {"name": "", "tflops": {"fp32": 1}, "memory_gib": 1, "memory_gb_per_s": 1},
        {"name": "X", "tflops": {"int8": 5}, "memory_gib": "lots", "memory_gb_per_s": -1, "colour": "red"},
        {"name": "Y", "tflops": {"fp32": 1, "fp4": 2}, "memory_gib": 1, "memory_gb_per_s": 1, "aliases": "Y"},
        "Z",
    ]
    with pytest.raises(GpuTableError) as info:
        GpuTable.load(extra=bad)
    message = str(info.value)
    for part in ("needs a 'name'", "at least 'fp32'", "memory_gib='lots'", "memory_gb_per_s=-1", "colour",
                 "fp4", "aliases must be a list", "'Z' is not an object"):
        assert part in message, part
    two = [{**ENTRY}, {**ENTRY}]
    with pytest.raises(GpuTableError, match="appear twice"):
        GpuTable.load(extra=two)
    with pytest.raises(GpuTableError, match="cannot read"):
        GpuTable.load(extra=tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(GpuTableError, match="not valid JSON"):
        GpuTable.load(extra=broken)
    with pytest.raises(GpuTableError, match="'gpus'"):
        GpuTable.load(extra={"types": []})


def test_measured_kernel_fractions_and_their_checks() -> None:
    # stas00's "Maximum Achievable Matmul FLOPS" table: bf16 torch.mm at its best shape, 792.1 of 989 TFLOP/s on
    # H100 SXM, 267.9 of 312 on A100 SXM (gpus.json gemm_efficiency); fp32 not measured there
    assert gpu_type("H100").gemm_efficiency("bf16") == pytest.approx(792.1 / 989, abs=1e-3)
    assert gpu_type("A100-80GB").gemm_efficiency(torch.bfloat16) == pytest.approx(267.9 / 312, abs=1e-3)
    assert gpu_type("H100").gemm_efficiency("fp32") is None and gpu_type("V100").attention is None
    bad = {**ENTRY, "gemm_efficiency": {"bf16": 1.2, "int4": 0.5}, "attention_efficiency": {"forward": 0.5}}
    with pytest.raises(GpuTableError) as info:
        GpuTable.load(extra=[bad])
    for part in ("gemm_efficiency=", "fraction of its peak in (0, 1]", "attention_efficiency=", "'backward'"):
        assert part in str(info.value), part


def test_precisions_from_dtypes() -> None:
    assert [precision_of(d) for d in (torch.float32, torch.bfloat16, torch.float16, "half", "tf32")] == [
        "fp32", "bf16", "fp16", "fp16", "tf32"]
    assert precision_of(torch.float64) == "fp32" and precision_of("int8") == "fp32"
    h100 = gpu_type("H100")
    assert [h100.peak(p) for p in PRECISIONS] == [66.9e12, 494.7e12, 989.4e12, 989.4e12, 1979e12]
    assert h100.peak(torch.bfloat16) == 989.4e12
    assert precision_of(torch.float8_e4m3fn) == precision_of("float8_e5m2") == "fp8"
    # the datasheet's dense FP8 figure (half the sparse 3,958) where the GPU has FP8 tensor cores; an A100 has
    # none: an FP8 product runs no faster than fp16 there
    assert gpu_type("A100-SXM4-80GB").peak("fp8") == gpu_type("A100-SXM4-80GB").peak("fp16") == 312e12
    assert h100.gemm_efficiency("fp8") == 0.783  # DeepGEMM: 1550 of 1979 TFLOP/s
