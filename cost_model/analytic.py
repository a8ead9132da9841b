"""Analytic cost model: per-op-class roofline time per node, latency + bandwidth per transfer.

    forward  = overhead + max(FLOPs / (matmul rate * efficiency), bytes / copy bandwidth)
    backward = 2 * the compute part for matrix products, the class's own bytes otherwise

The rates are a DeviceSpec's: measured once per device (a large matmul, a large copy and a
tiny op, `measure_device`) or described by hand (`DeviceSet`). Given the specs, the model
is deterministic. Operator classes and their constants live in `ops.py`.

A CUDA GPU of the table (`gpu_table.py`: by the spec's `gpu_type`, else its name) is priced
from the table instead (see [Note: GPU rates from the table]).
"""

# [Note: GPU rates from the table]
# The matmul/conv rate of a known GPU is the table's dense peak for the node's precision:
# fp32 reads the TF32 peak where torch lets that family use TF32 (`tf32_enabled`), bf16 and
# fp16 their own; a node inside `torch.autocast(device_type="cuda")` in forward (node.meta
# ["autocast"], from partitioner/trace) is priced at the autocast dtype. The peak is scaled
# by an efficiency by precision and shape:
#     rate = peak(precision) x E(precision) x s(M, N, K)      s = 1 at the 4096 cube (ops.gemm_efficiency)
#     E(precision) = gemm(precision) x s_inf                  the table's measured fraction for large products
#                                                             (gpus.json gemm_efficiency), scaled to the cube
# A precision the table has no measurement for takes E = DEFAULT_GPU_EFFICIENCY. Where the GPU is
# here, the spec's flops_per_s (a 4096-cube matmul, fp32 or TF32 as its `matmul_precision` says)
# over the matching peak, clipped to GPU_EFFICIENCY_RANGE, replaces E of that precision, and the
# others keep their ratio to it (at most 1); a spec whose matmul_precision is STATED (a Cluster given an
# efficiency) states E for every precision, and one whose matmul_precision is TABLE (a Cluster) takes
# the table's E by precision. Fused attention
# (F.scaled_dot_product_attention) runs at the table's attention_efficiency of the peak on its own
# FLOPs: half the counted ones under is_causal (a flash kernel skips the masked blocks), backward
# 2.5 x forward (it recomputes the scores: five products to two). Memory-bound work runs at the
# table's bandwidth scaled the same way (the measured copy rate, or the table's measured memory_efficiency
# of the peak: `bandwidth_efficiency`). Other devices keep their measured fp32 rate (x 8 for half precision
# off the CPU).
# A `matmul` dtype given (FP8 training: Transformer Engine's fp8_autocast, DeepSeek-V3's FP8 GEMMs) prices
# every matrix product of a table GPU at that precision's peak and efficiency, forward and backward (both
# run FP8 there); fused attention and memory-bound work keep the node's own dtype, as those recipes run them.
# With `float8` (torchao's recipe) each product with a weight also pays its casts (cost_model/float8_casts.py).

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx

from cost_model.cluster import DeviceSet
from cost_model.comm import default_link, p2p_time, ring_allreduce_time, slowest
from cost_model.devices import DeviceError, DeviceSpec, device_present, measure_device, tf32_enabled
from cost_model.float8_casts import FLOAT8_RECIPES, cast_seconds
from cost_model.gpu_rates import (
    DEFAULT_BANDWIDTH_EFFICIENCY,
    DEFAULT_GPU_EFFICIENCY,
    GPU_EFFICIENCY_RANGE,
    REFERENCE_MATMUL,
    STATED,
    TABLE,
    GpuRates,
    bandwidth_efficiency,
    table_efficiency,
)
from cost_model.gpu_table import GpuTable, GpuType, precision_of
from cost_model.interface import BACKWARD_FACTOR, CostModel
from cost_model.ops import OpCost, classify, gemm_dims, gemm_efficiency, op_costs

__all__ = [
    "AnalyticCostModel",
    "BACKWARD_FACTOR",
    "CostModel",
    "DEFAULT_BANDWIDTH_EFFICIENCY",
    "DEFAULT_GPU_EFFICIENCY",
    "FLASH_BACKWARD",
    "GPU_EFFICIENCY_RANGE",
    "STATED",
    "TABLE",
    "bandwidth_efficiency",
    "table_efficiency",
]

log = logging.getLogger(__name__)

_COMPUTE_OPS = ("call_function", "call_method", "call_module")
# Side of the square product `measure_device` times, by device type (efficiency is relative to it).
_REFERENCE_MATMUL = {"cpu": 1024.0}
_REFERENCE_MATMUL_DEFAULT = REFERENCE_MATMUL
# Tensor cores: half-precision matrix products run this much faster than the fp32 rate.
_HALF_SPEEDUP = {"float16": 8.0, "bfloat16": 8.0}

# One eager kernel launch, for a GPU that is not here to measure: the CUDA driver's launch from C measured at
# 4.90 us (https://github.com/JuliaGPU/CUDAdrv.jl/pull/15, its launch_overhead perftest), above PyTorch's own
# eager dispatch of an op that launches nothing (torch.split on CUDA: 3.3-3.4 us a call in PyTorch's operator
# micro-benchmark, https://github.com/pytorch/pytorch/pull/32194). The launches of a step overlap the GPU's
# work except where kernels are shorter than this (ops.py counts launches per class).
_GPU_OP_OVERHEAD_S = 5e-6
_ATTENTION = "scaled_dot_product_attention"
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
FLASH_BACKWARD = 2.5  # a flash kernel's backward FLOPs over its forward's (Dao 2023, FlashAttention-2, section 3)

Specs = Mapping[Any, DeviceSpec] | DeviceSet | None


def _memory_bytes(node: Mapping[str, Any], cost: OpCost, out_bytes: float) -> tuple[float, float]:
    """(forward, backward) bytes a memory-bound node moves: per output byte, per input byte (the graph's
    `input_ratio`, else the class's `inputs`) and per output element (a mask), as ops.py's table counts them."""
    ratio = node.get("input_ratio")
    in_bytes = out_bytes * (float(ratio) if ratio is not None else cost.inputs)
    masks = 0.0
    if cost.mask:
        dtypes = node.get("dtypes") or ["float32"]
        masks = cost.mask * out_bytes / _ITEMSIZE.get(str(dtypes[0]).removeprefix("torch."), 4)
    forward = cost.fwd_bytes * out_bytes + cost.fwd_in * in_bytes + masks
    backward = cost.bwd_bytes * out_bytes + cost.bwd_in * in_bytes + masks
    return forward, backward


def _clip(value: float) -> float:
    low, high = GPU_EFFICIENCY_RANGE
    return min(max(value, low), high)


def _autocast_dtype(regions: Any, device_kind: str) -> str | None:
    """The dtype of the autocast region for `device_kind` among ((device, dtype), ...), as 'bfloat16'."""
    if isinstance(regions, Mapping):
        regions = regions.items()
    for device, dtype in regions or ():
        if str(device) == device_kind:
            return str(dtype).removeprefix("torch.")
    return None


class AnalyticCostModel:
    """Roofline per operator class, from device rates; links from a DeviceSet or typical values.

    Args:
        specs: rates per device, as {torch.device or name: DeviceSpec} or a DeviceSet
            (which also supplies the links). Devices missing here, or with rate 0, are
            measured on first use when present in this process; an absent CUDA device whose
            spec names a known GPU (`gpu_type`, or its `name`) takes the table's rates.
        measure: how to measure a present device (tests pass a fake).
        gpus: the GPU table (default: `cost_model/gpus.json`; `GpuTable.load(extra=...)` adds types).
        tf32: whether fp32 matrix products and convolutions run on TF32; None reads torch's
            switches when each node is priced (`devices.tf32_enabled`).
        matmul: the dtype matrix products run in where it is not the node's (cost_model.precision.Precision.matmul:
            "float8_e4m3fn" for FP8 training); None: the node's own (see the Note).
        float8: torchao's float8 recipe of the linear layers ("tensorwise" or "rowwise"), whose casts are priced
            (needs an FP8 `matmul`); None: casts fused into other kernels (Transformer Engine) or no FP8.
        keep: module paths whose products keep the node's dtype under `matmul` (a node whose module path contains
            one: torchtitan's float8 `filter_fqns`, which its recipes set to the output layer).
    """

    def __init__(
        self,
        specs: Specs = None,
        measure: Callable[[torch.device], DeviceSpec] = measure_device,
        gpus: GpuTable | None = None,
        tf32: bool | None = None,
        matmul: str | None = None,
        float8: str | None = None,
        keep: Sequence[str] = (),
    ) -> None:
        if float8 is not None and (float8 not in FLOAT8_RECIPES or precision_of(matmul or "") != "fp8"):
            raise ValueError(f"float8={float8!r} with matmul={matmul!r}: a recipe ({', '.join(FLOAT8_RECIPES)}) "
                             "prices the casts of FP8 products; pass matmul='float8_e4m3fn' with it")
        self.device_set = specs if isinstance(specs, DeviceSet) else None
        given = specs.devices if isinstance(specs, DeviceSet) else dict(specs or {})
        self._specs: dict[str, DeviceSpec] = {str(torch.device(k)): v for k, v in given.items()}
        self._measure = measure
        self._kinds: dict[str, str] = {}
        self._autocast: dict[str, Any] = {}
        self._gpus = gpus if gpus is not None else GpuTable.load()
        self._tf32 = tf32
        self._matmul = matmul or None
        self._float8 = float8
        self._keep = tuple(keep)
        self._rates: dict[str, GpuRates | None] = {}
        self._stated: set[str] = set()  # devices whose matmul rate is the stated default, not measured
        self._causal: set[str] = set()  # fused attention nodes called with is_causal=True

    def prepare(self, graph_module: torch.fx.GraphModule, flat_inputs: Sequence[Any] = ()) -> None:
        """Learn each module call's class (Conv2d, MaxPool2d, ...) and autocast region from the traced graph."""
        for node in graph_module.graph.nodes:
            if node.op == "call_module":
                self._kinds[node.name] = type(graph_module.get_submodule(str(node.target))).__name__
            if node.meta.get("autocast"):
                self._autocast[node.name] = node.meta["autocast"]
            if node.op == "call_function" and _ATTENTION in str(getattr(node.target, "__name__", node.target)):
                if node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False) is True:
                    self._causal.add(node.name)

    def spec(self, device: torch.device | str) -> DeviceSpec:
        """The rates used for `device`, measuring it once if it is present and not described.

        An absent CUDA device described as a known GPU (`DeviceSpec.gpu_type`, or a name such
        as "NVIDIA H100 80GB HBM3") gets the table's rates where its own are 0.

        Raises:
            DeviceError: the device is neither described nor present here.
            UnknownGpuError: its `gpu_type` is not in the GPU table.
        """
        key = str(torch.device(device))
        spec = self._specs.get(key)
        if spec is not None and spec.measured:
            return spec
        if not device_present(torch.device(key)):
            filled = self._from_table(key, spec)
            if filled is not None:
                self._specs[key] = filled
                if spec is not None and not spec.flops_per_s:
                    self._stated.add(key)
                return filled
            raise DeviceError(
                f"no rates for {key}: it is not present here and not described; pass "
                f"AnalyticCostModel(DeviceSet.from_dict({{'devices': {{'{key}': {{'gpu_type': 'H100-SXM'}}}}}})) "
                f"for a known GPU ({', '.join(self._gpus.names)}), or describe it with {{'flops_per_s': ..., "
                "'bytes_per_s': ..., 'memory_bytes': ...}"
            )
        measured = self._measure(torch.device(key))
        if spec is not None:  # keep what discovery knew (memory, cores), add the rates
            measured = dataclasses.replace(
                spec,
                flops_per_s=measured.flops_per_s,
                bytes_per_s=measured.bytes_per_s,
                op_overhead_s=measured.op_overhead_s,
                matmul_precision=measured.matmul_precision,
            )
        self._specs[key] = measured
        return measured

    def _gpu(self, key: str, spec: DeviceSpec | None) -> GpuType | None:
        """The table's type for a CUDA device's spec: its `gpu_type` (must be known), else by name and memory."""
        if spec is None or torch.device(key).type != "cuda" or (spec.kind or "cuda") != "cuda":
            return None
        if spec.gpu_type:
            return self._gpus.get(spec.gpu_type, spec.memory_bytes or None)
        return self._gpus.lookup(spec.name, spec.memory_bytes or None)

    def _from_table(self, key: str, spec: DeviceSpec | None) -> DeviceSpec | None:
        """An absent known GPU's spec with the rates it lacks taken from the table (default efficiencies)."""
        gpu = self._gpu(key, spec)
        if spec is None or gpu is None:
            return None
        flops = spec.flops_per_s or DEFAULT_GPU_EFFICIENCY * gpu.fp32_flops
        return dataclasses.replace(
            spec,
            flops_per_s=flops,
            bytes_per_s=spec.bytes_per_s or bandwidth_efficiency(gpu) * gpu.memory_bytes_per_s,
            op_overhead_s=spec.op_overhead_s or _GPU_OP_OVERHEAD_S,
            memory_bytes=spec.memory_bytes or gpu.memory_bytes,
            kind=spec.kind or "cuda",
            gpu_type=gpu.name,
            matmul_precision=spec.matmul_precision if spec.flops_per_s else "fp32",
        )

    def gpu_rates(self, device: torch.device | str, precision: str = "bf16") -> tuple[GpuType, float, float] | None:
        """(table type, E of `precision` at the 4096 cube, bytes/s) a CUDA device is priced with, or None where it
        is not a known GPU.

        See [Note: GPU rates from the table] in this module.
        """
        rates = self._rates_for(str(torch.device(device)))
        return (rates.gpu, rates.at(precision_of(precision)), rates.bytes_per_s) if rates is not None else None

    def _rates_for(self, key: str) -> GpuRates | None:
        if key not in self._rates:
            self._rates[key] = self._calibrate(key, self.spec(key))
        return self._rates[key]

    def _calibrate(self, key: str, spec: DeviceSpec) -> GpuRates | None:
        gpu = self._gpu(key, spec)
        if gpu is None:
            return None
        reference = spec.matmul_precision
        if reference not in ("fp32", "tf32", STATED, TABLE):  # not recorded: above the fp32 peak it can only be TF32
            reference = "tf32" if spec.flops_per_s > gpu.fp32_flops * 1.05 else "fp32"
        low, high = GPU_EFFICIENCY_RANGE
        bandwidth = min(max(spec.bytes_per_s, low * gpu.memory_bytes_per_s), high * gpu.memory_bytes_per_s)
        if key in self._stated or reference == TABLE:
            log.debug("%s (%s) priced as %s: not here to measure, the table's efficiency by precision (bf16 %.2f, "
                      "fp32 %.2f at the 4096 cube); memory %.0f GB/s", key, spec.name, gpu.name,
                      table_efficiency(gpu, "bf16"), table_efficiency(gpu, "fp32"), bandwidth / 1e9)
            return GpuRates(gpu, None, bandwidth)
        raw = spec.flops_per_s / gpu.peak("fp32" if reference == STATED else reference)
        efficiency = _clip(raw)
        clipped = "" if math.isclose(raw, efficiency) else f", clipped to {GPU_EFFICIENCY_RANGE}"
        log.debug("%s (%s) priced as %s: %.1f TFLOP/s %s measured or described, %.2f of the %.1f peak%s, other "
                  "precisions by the table's ratios; memory %.0f GB/s", key, spec.name, gpu.name,
                  spec.flops_per_s / 1e12, reference, raw, gpu.peak(reference) / 1e12, clipped, bandwidth / 1e9)
        scale = 1.0 if reference == STATED else efficiency / table_efficiency(gpu, reference)
        return GpuRates(gpu, efficiency, bandwidth, reference, scale)

    def _kind(self, device: torch.device, spec: DeviceSpec) -> str:
        return spec.kind or torch.device(device).type

    def _precision(self, dtype: str, family: str) -> str:
        """The table column for a dtype: fp32 products read the TF32 peak where TF32 is on."""
        precision = precision_of(dtype)
        if precision == "fp32":
            tf32 = self._tf32 if self._tf32 is not None else tf32_enabled("conv" if family == "conv" else "matmul")
            return "tf32" if tf32 else "fp32"
        return precision

    def _times(self, node: Mapping[str, Any], device: torch.device) -> tuple[float, float]:
        if node.get("op") not in _COMPUTE_OPS:
            return 0.0, 0.0
        spec = self.spec(device)
        device_kind = self._kind(device, spec)
        rates = self._rates_for(str(torch.device(device))) if device_kind == "cuda" else None
        bytes_per_s = rates.bytes_per_s if rates is not None else spec.bytes_per_s
        name = str(node.get("name", ""))
        kind = self._kinds.get(name)
        cls = classify(node, kind)
        cost = op_costs(device_kind)[cls]
        overhead = spec.op_overhead_s
        out_bytes = float(node.get("out_bytes", 0) or 0)
        memory_fwd, memory_bwd = (x / bytes_per_s for x in _memory_bytes(node, cost, out_bytes))
        if cls in ("gemm", "conv"):
            flops = float(node["flops"])
            shapes = node.get("shapes") or [()]
            _, m, n, k = gemm_dims(shapes[0], flops, "conv" if cls == "conv" else kind or str(node.get("target", "")))
            reference = _REFERENCE_MATMUL.get(device_kind, _REFERENCE_MATMUL_DEFAULT)
            family = "conv" if cls == "conv" else "matmul"
            shape_efficiency = gemm_efficiency(m, n, k, device_kind, reference, family)
            dtypes = node.get("dtypes") or []
            dtype = str(dtypes[0]) if dtypes else "float32"
            if device_kind != "cpu":  # under autocast, products run at its dtype (cpu keeps its fitted path)
                dtype = _autocast_dtype(self._autocast.get(name) or node.get("autocast"), device_kind) or dtype
            if rates is not None and cls == "gemm" and _ATTENTION in str(node.get("target", "")):
                return self._attention(node, name, flops, rates, self._precision(dtype, family), cost, overhead)
            kept = any(path in str(node.get("module") or "") for path in self._keep)
            matmul = self._matmul if cls == "gemm" and not kept else None  # the products' dtype where asked
            if rates is not None:
                precision = self._precision(matmul or dtype, family)
                rate = rates.gpu.peak(precision) * rates.at(precision) * shape_efficiency
            else:
                rate = spec.flops_per_s * shape_efficiency
                if device_kind != "cpu" and dtype in _HALF_SPEEDUP:
                    rate *= _HALF_SPEEDUP[dtype]
            param_bytes = float(node.get("param_bytes", 0) or 0)
            moved = (2.0 * out_bytes + param_bytes) / bytes_per_s
            compute = max(flops / rate, moved)
            forward, backward = cost.fwd_overhead * overhead + compute, cost.bwd_overhead * overhead
            casts = (0.0, 0.0)
            if self._float8 and rates is not None and matmul and (  # a linear layer's (its weight: an input
                    param_bytes > 0 or "linear" in str(node.get("target", ""))):  # where torch.export lifts it)
                casts = cast_seconds(m, k, n, self._float8, bytes_per_s, overhead)
            return forward + casts[0], backward + BACKWARD_FACTOR * compute + casts[1]
        if cls == "embedding":  # backward writes a dense gradient as large as the table
            memory_bwd += 2.0 * float(node.get("param_bytes", 0) or 0) / bytes_per_s
        forward = cost.fwd_overhead * overhead + memory_fwd
        backward = cost.bwd_overhead * overhead + memory_bwd if node.get("shapes") else 0.0
        return forward, backward

    def _attention(self, node: Mapping[str, Any], name: str, flops: float, rates: GpuRates, precision: str,
                   cost: Any, overhead: float) -> tuple[float, float]:
        """(forward, backward) seconds of a fused attention node on a table GPU (see the Note)."""
        work = flops * (0.5 if name in self._causal else 1.0)
        peak = rates.gpu.peak(precision) * rates.at(precision) / table_efficiency(rates.gpu, precision)
        forward_eff, backward_eff = rates.gpu.attention or (rates.at(precision),) * 2
        out_bytes = float(node.get("out_bytes", 0) or 0)
        moved = 4.0 * out_bytes / rates.bytes_per_s  # q, k, v and the output at least once (GQA: fewer)
        forward = max(work / (peak * forward_eff), moved)
        backward = max(FLASH_BACKWARD * work / (peak * backward_eff), 2.0 * moved)
        return cost.fwd_overhead * overhead + forward, cost.bwd_overhead * overhead + backward

    def forward_time(self, node: Mapping[str, Any], device: torch.device) -> float:
        """Forward seconds of one vertex on `device`."""
        return self._times(node, device)[0]

    def backward_time(self, node: Mapping[str, Any], device: torch.device) -> float:
        """Backward seconds of one vertex on `device`."""
        return self._times(node, device)[1]

    def node_time(self, node: Mapping[str, Any], device: torch.device) -> float:
        forward, backward = self._times(node, device)
        return forward + backward

    def transfer_time(self, nbytes: float, src: torch.device, dst: torch.device) -> float:
        if self.device_set is not None:
            return self.device_set.transfer_time(nbytes, src, dst)
        return p2p_time(nbytes, default_link(torch.device(src), torch.device(dst)))

    def allreduce_time(self, nbytes: float, devices: Sequence[torch.device]) -> float:
        """Ring all-reduce seconds of `nbytes` among `devices` (data-parallel replicas)."""
        if self.device_set is not None:
            return self.device_set.allreduce_time(nbytes, devices)
        n = len(devices)
        if n <= 1:
            return 0.0
        ring = [default_link(torch.device(devices[i]), torch.device(devices[(i + 1) % n])) for i in range(n)]
        return ring_allreduce_time(nbytes, n, slowest(ring))
