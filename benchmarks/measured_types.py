"""What one measured training run is, as data: its model, cluster, batch, parallel layout, kernels and throughput.

benchmarks/measured_runs.py holds the rows; this module holds their types and the checks every row must pass.

    Run
     ├── source: Source          which paper or page, which table; fit on it or hold it out (issue 37 item 4)
     ├── model: Model            the shape (GPT as Megatron-LM and MPT build it, or Llama); parameters from it
     ├── gpus, gpu, hosts        the cluster (a GPU type of cost_model/gpus.json, and the GPU as the source names it)
     ├── global_batch, seq       sequences a step, tokens a sequence
     ├── parallel: Parallel      t, p, context, replicas, micro-batch size, schedule, sharding, recomputation
     ├── kernels: Kernels        attention kernel, torch.compile, float8, async TP: the kernel set it ran
     ├── measured: Measured      what the source printed, each a Figure (value and the interval its rounding allows)
     └── provenance              where every number not in the source's table came from

[Note: FLOP counts] A source's MFU, TFLOP/s and aggregate FLOP/s rest on its own FLOPs per token (`FlopCount`), so a
row keeps its count with its figures. `implied_tokens_per_s` turns every figure of a row into the tokens/s it means
(an interval, from the printed rounding); `problems` asks that they overlap, which is how "MFU and tokens/s agree
by 6·N·tokens/s/(GPUs·peak)" is checked, N from the row's shape (`Model.parameters`), never from the source's
rounded "7B".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "FLOP_COUNTS", "Figure", "FlopCount", "Kernels", "Measured", "Model", "Parallel", "Recompute", "Run", "Schedule",
    "Sharding", "Source", "flops_per_token", "implied_tokens_per_s", "problems", "region", "rounded", "truncated",
]

FlopCount = Literal["6N", "6N+12lhs", "6N-emb+12lhs", "megatron", "megatron-eq3"]
FLOP_COUNTS: dict[str, str] = {
    "6N": "6 N per token, N every parameter (Llama 3's compute budget, 3.8e25 = 6 x 405e9 x 15.6e12, not its MFU)",
    "6N+12lhs": "6 N + 12 l h s per token, N every parameter, the attention products counted once, not halved for "
                "the causal mask (llm-foundry's collect_results.py; PaLM's appendix B, which Llama 3's MFU cites)",
    "6N-emb+12lhs": "6 (N - token embedding) + 12 l h s per token (torchtitan's utils.get_num_flop_per_token with "
                    "get_num_params(exclude_embedding=True))",
    "megatron": "72 s l h^2 (1 + s/6h) + 6 s h V per sequence: Megatron-LM's model FLOPs without recomputation "
                "(Korthikanti et al. 2022, https://arxiv.org/abs/2205.05198, section 6)",
    "megatron-eq3": "96 B s l h^2 (1 + s/6h + V/16lh) per step: SC'21 eq. 3, which counts the recomputed forward "
                    "(Narayanan et al. 2021, https://arxiv.org/abs/2104.04473, section 5.1)",
}
Sharding = Literal["none", "zero1", "zero2", "zero3"]
Recompute = Literal["none", "selective", "full"]
Schedule = Literal["none", "1f1b", "interleaved-1f1b"]


@dataclass(frozen=True)
class Source:
    """A paper or page with measured runs, and what its table states (the fields a row needs no provenance for).

    `key`: short name rows are grouped by. `cite`: authors, title, year, table. `url`: where it lives, at a
    commit where it is a repository's file. `read`: what was read to write the rows (the file at a commit, or a
    text copy of a paper). `gives`: dotted field names of `Run` the table states for every row (e.g.
    "parallel.tensor", "measured.mfu"). `split`: "fit" (prices may be fitted on it) or "held-out" (only judged).
    """

    key: str
    cite: str
    url: str
    read: str
    gives: frozenset[str]
    split: Literal["fit", "held-out"]


@dataclass(frozen=True)
class Figure:
    """A number as a source printed it: `value`, and `low`..`high`, the values its rounding (or truncation) allows."""

    value: float
    low: float
    high: float

    def __post_init__(self) -> None:
        if not self.low <= self.value <= self.high:
            raise ValueError(f"Figure {self.value} outside its interval [{self.low}, {self.high}]")

    def scaled(self, factor: float) -> tuple[float, float]:
        """(low, high) times a positive factor."""
        return self.low * factor, self.high * factor


def rounded(value: float, step: float) -> Figure:
    """A figure printed rounded to `step` (43% -> rounded(0.43, 0.01); 39.3k -> rounded(39300, 100))."""
    return Figure(value, value - step / 2, value + step / 2)


def truncated(value: float, step: float = 1.0) -> Figure:
    """A figure printed truncated to `step` (Python's int(): llm-foundry's token counts)."""
    return Figure(value, value, value + step)


@dataclass(frozen=True)
class Model:
    """A model's shape. `family` "gpt": learned positions (`positions` rows), pre-norm LayerNorm layers with biases, a
    fused q/k/v projection, a GELU MLP of 4h, a final LayerNorm and a head tied to the word embedding (Megatron-LM's
    GPT as SC'21 and MegaScale ran it; MPT as llm-foundry benchmarked it: learned positions and biases, as its
    NumParams column shows). "llama": RMSNorm, grouped-query attention with rotary positions, SwiGLU of `ffn`, no
    biases, an untied head. `written`: how the code that ran it wrote the norm and rotary positions, as one kernel
    each ("kernels") or as torchtitan's eager PyTorch ops at 9dec370 ("torchtitan-2412":
    benchmarks/published_models.py)."""

    family: Literal["gpt", "llama"]
    layers: int
    width: int
    heads: int
    vocab: int
    positions: int = 0  # gpt: rows of the position table (the run's sequence length); llama: 0
    ffn: int = 0  # llama
    kv_heads: int = 0  # llama
    written: Literal["kernels", "torchtitan-2412"] = "kernels"  # llama

    def parameters(self) -> int:
        """Every parameter (a tied head counted once)."""
        h, layers = self.width, self.layers
        if self.family == "gpt":
            return self.vocab * h + self.positions * h + layers * (12 * h * h + 13 * h) + 2 * h
        kv = self.kv_heads * (h // self.heads)
        per_layer = h * (h + 2 * kv) + h * h + 3 * h * self.ffn + 2 * h
        return 2 * self.vocab * h + layers * per_layer + h

    def embedding(self) -> int:
        """Parameters of the token embedding alone."""
        return self.vocab * self.width


@dataclass(frozen=True)
class Parallel:
    """How a run split its work. Degrees multiply to the GPU count: tensor x context x pipeline x data.

    `data`: replicas (data-parallel ranks, sharded or not). `micro_batch_size`: sequences per micro-batch per
    replica (None: the source does not say). `virtual_stages`: model chunks per pipeline rank (1: none).
    `sharding_as_run`: the trainer's own words (FULL_SHARD, ZeRO-2, ...); `sharding`: the nearest mode of
    rules/sharding.py (None: unknown). `recompute_as_run` likewise for activation recomputation.
    """

    tensor: int
    pipeline: int
    data: int
    context: int = 1
    micro_batch_size: int | None = None
    virtual_stages: int | None = 1
    schedule: Schedule = "none"
    sharding_as_run: str = "none"
    sharding: Sharding | None = "none"
    sequence_parallel: bool | None = False
    recompute_as_run: str = "none"
    recompute: Recompute | None = "none"


@dataclass(frozen=True)
class Kernels:
    """The kernel set a run used. `kernels`: "fused" where attention saved flash statistics instead of scores (and
    norms/activations were fused or compiled), "eager" where scores were written out (issue 37 item 2).
    `attention`: the attention kernel as the source or its code names it. `float8`: None, "tensorwise" or
    "rowwise" (float8 linear layers, torchao)."""

    kernels: Literal["eager", "fused"]
    attention: str
    compile: bool = False
    float8: str | None = None
    async_tp: bool = False


@dataclass(frozen=True)
class Measured:
    """What the source printed for a run (None: not printed). FLOP figures rest on `flops` ([Note: FLOP counts])
    over `peak_tflops` per GPU, the peak the source divides by."""

    flops: FlopCount
    peak_tflops: float
    tokens_per_s_per_gpu: Figure | None = None
    tokens_per_s: Figure | None = None
    mfu: Figure | None = None
    tflops_per_gpu: Figure | None = None
    peak_fraction: Figure | None = None  # SC'21's "percentage of theoretical peak" (eq. 3 over 312)
    aggregate_pflops: Figure | None = None
    iteration_s: Figure | None = None
    memory_gib: Figure | None = None  # peak memory per GPU, as measured


@dataclass(frozen=True)
class Run:
    """One measured training run (module docstring). `key`: unique, e.g. "sc21-1.7B". `where`: the table and row.
    `gpu`: its type in cost_model/gpus.json; `gpu_as_stated`: the GPU as the source describes it.
    `inter_gbit_per_s`: NIC line rate per GPU between hosts, and `inter_kind` its fabric (None: not stated).
    `precision_as_run`: the source's words; `precision`: cost_model.precision.Precision.parse's form.
    `parameters`: the source's parameter count (checked against the shape's).
    `provenance`: (dotted field, where its number comes from) for every number the source's table does not state.
    `notes`: definitions, ambiguities and disagreements found in the source.
    """

    key: str
    source: Source
    where: str
    name: str
    model: Model
    gpu: str
    gpu_as_stated: str
    gpus: int
    gpus_per_host: int
    inter_kind: Literal["infiniband", "roce"] | None
    inter_gbit_per_s: float | None
    global_batch: int
    seq: int
    parallel: Parallel
    kernels: Kernels
    precision_as_run: str
    precision: str
    measured: Measured
    parameters: Figure | None = None  # the source's own parameter count, where it prints one
    provenance: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def split(self) -> Literal["fit", "held-out"]:
        return self.source.split

    @property
    def family(self) -> Literal["A100", "H100"] | None:
        """The GPU generation the table's coverage is counted by."""
        return "A100" if self.gpu.startswith("A100") else "H100" if self.gpu.startswith("H100") else None


def region(run: Run) -> Literal["fsdp-only", "fsdp+tp/pp", "3d"]:
    """Which region of the search a run lies in: sharded data parallelism alone; sharding with tensor or pipeline
    splits (FSDP + TP (+ PP), Llama 3's 4D); tensor and pipeline splits over unsharded (or unstated) replicas."""
    p = run.parallel
    split = p.tensor > 1 or p.pipeline > 1 or p.context > 1
    sharded = p.sharding not in (None, "none")
    if sharded:
        return "fsdp+tp/pp" if split else "fsdp-only"
    return "3d"


def flops_per_token(model: Model, seq: int, count: FlopCount) -> float:
    """FLOPs one token costs under a source's count ([Note: FLOP counts])."""
    n, l_, h, v = model.parameters(), model.layers, model.width, model.vocab
    if count == "6N":
        return 6.0 * n
    if count == "6N+12lhs":
        return 6.0 * n + 12.0 * l_ * h * seq
    if count == "6N-emb+12lhs":
        return 6.0 * (n - model.embedding()) + 12.0 * l_ * h * seq
    if count == "megatron":
        return 72.0 * l_ * h * h * (1 + seq / (6 * h)) + 6.0 * h * v
    return 96.0 * l_ * h * h * (1 + seq / (6 * h) + v / (16 * l_ * h))  # megatron-eq3


def implied_tokens_per_s(run: Run) -> dict[str, tuple[float, float]]:
    """The tokens/s (whole job) each printed figure of `run` means, as (low, high) from its rounding."""
    m, g = run.measured, run.gpus
    per_token = flops_per_token(run.model, run.seq, m.flops)
    peak = m.peak_tflops * 1e12
    out: dict[str, tuple[float, float]] = {}
    if m.tokens_per_s_per_gpu is not None:
        out["tokens_per_s_per_gpu"] = m.tokens_per_s_per_gpu.scaled(g)
    if m.tokens_per_s is not None:
        out["tokens_per_s"] = m.tokens_per_s.scaled(1.0)
    if m.mfu is not None:
        out["mfu"] = m.mfu.scaled(g * peak / per_token)
    if m.peak_fraction is not None:
        out["peak_fraction"] = m.peak_fraction.scaled(g * peak / per_token)
    if m.tflops_per_gpu is not None:
        out["tflops_per_gpu"] = m.tflops_per_gpu.scaled(g * 1e12 / per_token)
    if m.aggregate_pflops is not None:
        out["aggregate_pflops"] = m.aggregate_pflops.scaled(1e15 / per_token)
    if m.iteration_s is not None:
        tokens = run.global_batch * run.seq
        out["iteration_s"] = (tokens / m.iteration_s.high, tokens / m.iteration_s.low)
    return out


def _numbers(run: Run) -> dict[str, float | None]:
    """Every number of a run by dotted name (what a citation must cover)."""
    fields: dict[str, float | None] = {"gpus": run.gpus, "gpus_per_host": run.gpus_per_host,
                                       "global_batch": run.global_batch, "seq": run.seq,
                                       "inter_gbit_per_s": run.inter_gbit_per_s,
                                       "parameters": None if run.parameters is None else run.parameters.value}
    for part in ("model", "parallel", "measured"):
        for f in dataclasses.fields(getattr(run, part)):
            value = getattr(getattr(run, part), f.name)
            if isinstance(value, Figure):
                value = value.value
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                fields[f"{part}.{f.name}"] = value
    if run.parallel.pipeline == 1 and run.parallel.virtual_stages == 1:
        del fields["parallel.virtual_stages"]  # no pipeline, no chunks: nothing to cite
    return fields


_FIELDS = {"gpus", "gpus_per_host", "global_batch", "seq", "inter_gbit_per_s", "parameters"} | {
    f"{part}.{f.name}" for part, kind in (("model", Model), ("parallel", Parallel), ("measured", Measured))
    for f in dataclasses.fields(kind)}
SLACK = 0.003  # relative: a parameter count from the shape where the source counted its own (norms, biases)


def problems(run: Run) -> list[str]:
    """Everything wrong with one row: missing or impossible fields, figures that disagree, numbers without a source."""
    out: list[str] = []
    p, mo = run.parallel, run.model
    if not (run.source.cite and run.source.url and run.where):
        out.append("no source: give the paper or page, its URL and the table row")
    if min(mo.layers, mo.width, mo.heads, mo.vocab) < 1 or mo.width % mo.heads:
        out.append(f"model shape incomplete or heads not dividing width: {mo}")
    if mo.family == "gpt" and mo.positions < run.seq:
        out.append(f"a gpt model needs positions >= seq ({mo.positions} < {run.seq})")
    if mo.family == "llama" and (mo.ffn < 1 or mo.kv_heads < 1 or mo.heads % mo.kv_heads):
        out.append(f"a llama model needs ffn and kv_heads dividing heads: {mo}")
    if run.family is None:
        out.append(f"gpu {run.gpu!r} is neither an A100 nor an H100 type of cost_model/gpus.json")
    if min(run.gpus, run.gpus_per_host, run.global_batch, run.seq) < 1 or run.gpus % run.gpus_per_host:
        out.append(f"gpus {run.gpus}, per host {run.gpus_per_host}, batch {run.global_batch}, seq {run.seq}: "
                   "each >= 1 and whole hosts")
    degrees = p.tensor * p.context * p.pipeline * p.data
    if degrees != run.gpus:
        out.append(f"t{p.tensor} x cp{p.context} x p{p.pipeline} x d{p.data} = {degrees} GPUs, not {run.gpus}")
    if run.global_batch % p.data:
        out.append(f"global batch {run.global_batch} does not divide over {p.data} replicas")
    elif p.micro_batch_size is not None and (run.global_batch // p.data) % p.micro_batch_size:
        out.append(f"{run.global_batch // p.data} sequences per replica are not whole micro-batches of "
                   f"{p.micro_batch_size}")
    if p.pipeline == 1 and p.schedule != "none" or p.pipeline > 1 and p.schedule == "none":
        out.append(f"schedule {p.schedule!r} with {p.pipeline} pipeline stages")
    if p.virtual_stages is not None and (p.virtual_stages > 1) != (p.schedule == "interleaved-1f1b"):
        out.append(f"{p.virtual_stages} virtual stages with schedule {p.schedule!r}")
    if run.parameters is not None:
        n = mo.parameters()
        if not run.parameters.low * (1 - SLACK) <= n <= run.parameters.high * (1 + SLACK):
            out.append(f"the shape has {n:,} parameters; the source says {run.parameters.value:,.0f}")
    implied = implied_tokens_per_s(run)
    if not {"tokens_per_s_per_gpu", "tokens_per_s", "mfu", "tflops_per_gpu"} & set(implied):
        out.append("no throughput: give tokens/s (per GPU or in all), MFU or TFLOP/s per GPU")
    if implied:
        low = max(lo for lo, _ in implied.values())
        high = min(hi for _, hi in implied.values())
        if low > high * (1 + SLACK):
            shown = ", ".join(f"{k} {lo:,.0f}..{hi:,.0f}" for k, (lo, hi) in implied.items())
            out.append(f"figures disagree on tokens/s (count {run.measured.flops}, peak "
                       f"{run.measured.peak_tflops} TFLOP/s, N {mo.parameters():,}): {shown}")
    cited = {name for name, why in run.provenance if why}
    for name, value in _numbers(run).items():
        if value and name not in run.source.gives and name not in cited:  # 0: a field the family has not
            out.append(f"{name} = {value:g} has no citation: the table does not give it; add provenance")
    unknown = {name for name, _ in run.provenance} - _FIELDS
    if unknown:
        out.append(f"provenance names no field of the row: {sorted(unknown)}")
    return out
