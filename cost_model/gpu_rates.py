"""A table GPU's rates as the analytic model prices them: the fraction of its peak a matrix product and a copy reach.

E(precision), the fraction of a precision's dense peak that a 4096-cube product reaches, is the table's measured
`gemm_efficiency` (cost_model/gpus.json, scaled from a large product to the cube by ops.gemm_efficiency's shape
rule), else DEFAULT_GPU_EFFICIENCY; a GPU measured here (cost_model.devices.measure_device) replaces it for the
precision it measured and scales the others by the same ratio (GpuRates). Memory-bound kernels run at the table's
bandwidth times `bandwidth_efficiency`. cost_model/analytic.py's Note says where each is used.
"""

from __future__ import annotations

import dataclasses

from cost_model.gpu_table import GpuType
from cost_model.ops import gemm_efficiency

__all__ = ["DEFAULT_BANDWIDTH_EFFICIENCY", "DEFAULT_GPU_EFFICIENCY", "GPU_EFFICIENCY_RANGE", "REFERENCE_MATMUL",
           "STATED", "TABLE", "GpuRates", "bandwidth_efficiency", "table_efficiency"]

# Side of the square product `measure_device` times on a GPU (efficiency is relative to it).
REFERENCE_MATMUL = 4096.0
# Fraction of a table GPU's dense peak that a 4096-cube matrix product reaches, for GPUs that
# are not here to measure: large bf16 GEMMs reach about 0.7-0.8 of peak on A100 and H100 (cuBLAS).
DEFAULT_GPU_EFFICIENCY = 0.7
# A measured efficiency is clipped to this range: below it the measurement was disturbed
# (a busy GPU, clocks still ramping), above it the table or the measurement is wrong.
GPU_EFFICIENCY_RANGE = (0.3, 1.0)
# Fraction of the table's peak memory bandwidth a large device copy reaches, for a type whose table entry has
# no measured `memory_efficiency` (gpus.json: A100 0.87, H100 SXM 0.90; see `bandwidth_efficiency`).
DEFAULT_BANDWIDTH_EFFICIENCY = 0.8
# s(M, N, K) of the 4096 cube relative to an infinitely large product (ops.gemm_efficiency's shape rule).
_CUBE = 1.0 / gemm_efficiency(1e18, 1e18, 1e18, "cuda", REFERENCE_MATMUL)
# DeviceSpec.matmul_precision values for a described GPU: flops_per_s is a stated fraction of the fp32 peak
# for every precision (STATED), or stands for nothing: the table's efficiency by precision (TABLE).
STATED, TABLE = "stated", "table"


@dataclasses.dataclass(frozen=True)
class GpuRates:
    """A table GPU as priced here: its type, E of the precision measured (None: the table's for each), its
    bandwidth, and how its measured E compares with the table's (1 where nothing was measured)."""

    gpu: GpuType
    efficiency: float | None
    bytes_per_s: float
    reference: str = "fp32"
    scale: float = 1.0

    def at(self, precision: str) -> float:
        """E(precision): the fraction of its peak a 4096-cube product reaches (see the Note)."""
        own = table_efficiency(self.gpu, precision)
        if self.efficiency is None:
            return own
        if precision == self.reference or self.reference == STATED:
            return self.efficiency
        return min(own * self.scale, GPU_EFFICIENCY_RANGE[1])  # never above the peak


def bandwidth_efficiency(gpu: GpuType) -> float:
    """The fraction of a table GPU's peak memory bandwidth its memory-bound kernels reach: the table's measured
    `memory_efficiency` (gpus.json, with its source), else DEFAULT_BANDWIDTH_EFFICIENCY."""
    return gpu.memory_efficiency if gpu.memory_efficiency is not None else DEFAULT_BANDWIDTH_EFFICIENCY


def table_efficiency(gpu: GpuType, precision: str) -> float:
    """E(precision) of a GPU not measured here: its table fraction scaled to the 4096 cube, else the default."""
    measured = gpu.gemm_efficiency(precision)
    return measured * _CUBE if measured is not None else DEFAULT_GPU_EFFICIENCY
