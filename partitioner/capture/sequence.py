"""Whether a traced graph's sequence can split over ranks: its causal attentions, positions, what stays whole and why.

runtime.context_graph reads the graph's shapes ([Note: splitting the sequence of a graph]): the sequence's
symbol, the ranges of positions it builds (RoPE, position tables), its attentions and the ops that mix
tokens. What it cannot know from shapes is what an attention's mask is: runtime.context_parallel makes
the causal mask from global positions, so an attention splits only where its mask is the causal one.
That is checked here by running the mask's own nodes: they must depend on the inputs' sizes only (a
padding mask read from an input is not), and give the causal mask at the example's length (at most
`CHECK_TOKENS`: a sliding window wider than that would pass unseen) for every batch row and head. An
attention with is_causal=True and no mask is causal as it is; one with another mask (a sliding
window, bidirectional, padding) stays whole, and then the sequence cannot be split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection

import torch
import torch.fx

from partitioner.capture.shardable_groups import divisors
from runtime.context_graph import ContextGraph, sequence_dims

__all__ = ["CHECK_TOKENS", "LONG_SEQUENCE", "SequenceSplit", "SplitAttention", "WholeAttention", "find_sequence_split",
           "long_sequence"]

CHECK_TOKENS = 1024  # the longest sequence a mask is built at to check it
# Sequences shorter than this are not split: published runs split from their long-context stages on (Llama 3
# 405B at 131,072 tokens, NeMo's Llama 2 at 128k; torchtitan from 32k), and a model at an ordinary length plans
# exactly as it did before context parallelism was searched.
LONG_SEQUENCE = 16384


def long_sequence(values: Collection[Any]) -> bool:
    """Whether an example holds a sequence long enough to split: token ids (b, s) or hidden states (b, s, ...)
    with s >= LONG_SEQUENCE (a wide feature vector (b, h) is not one)."""
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] >= LONG_SEQUENCE:
            if value.dim() >= 3 or not (value.dtype.is_floating_point or value.dtype.is_complex):
                return True
    return False


@dataclass(frozen=True)
class SplitAttention:
    """An attention whose sequence splits: queries stay on their rank, keys and values are gathered."""

    node: str
    path: str  # its module (the plan's StagePlan.context_attention)
    mask: str  # "is_causal" or "causal mask (checked at N tokens)"


@dataclass(frozen=True)
class WholeAttention:
    """An attention (or an op) that needs the whole sequence on one rank, and why."""

    node: str
    path: str
    reason: str


@dataclass
class SequenceSplit:
    """Everything find_sequence_split found in one graph."""

    length: int | None = None  # the example's sequence length
    why_not: str = ""  # set where the graph has no sequence to split
    attention: list[SplitAttention] = field(default_factory=list)
    whole: list[WholeAttention] = field(default_factory=list)
    inputs: dict[str, int] = field(default_factory=dict)  # graph input -> its sequence dim
    positions: list[str] = field(default_factory=list)  # nodes building positions (become global positions)

    @property
    def splits(self) -> bool:
        return not self.why_not and not self.whole and bool(self.attention)

    def degrees(self) -> tuple[int, ...]:
        """Context degrees that cut the example's sequence into 2 x degree equal chunks (load balance)."""
        if not self.splits or not self.length:
            return (1,)
        return tuple(d for d in divisors(self.length) if self.length % (2 * d) == 0 or d == 1)

    def attentions_within(self, nodes: Collection[str]) -> list[str]:
        """The module paths of the split attentions among `nodes` (a stage's): its context_attention."""
        inside = set(nodes)
        return list(dict.fromkeys(a.path for a in self.attention if a.node in inside))

    def report(self) -> str:
        if self.why_not:
            return f"the sequence stays whole: {self.why_not}"
        lines = [f"sequence of {self.length} tokens, inputs {self.inputs}; positions from {', '.join(self.positions)}"]
        lines += [f"splits: {a.path} ({a.node}): {a.mask}" for a in self.attention]
        lines += [f"whole: {w.path or w.node}: {w.reason}" for w in self.whole]
        return "\n".join(lines)


def _hint(size: Any) -> int | None:
    node = getattr(size, "node", None)
    hint = getattr(node, "hint", None) if node is not None else size
    return int(hint) if hint is not None else None


def find_sequence_split(gm: torch.fx.GraphModule) -> SequenceSplit:
    """How the sequence of `gm` (traced by torch.export, its sequence free) can be split (module docstring)."""
    found = ContextGraph.of(gm)
    if found.symbol is None:
        return SequenceSplit(why_not=found.why_not)
    out = SequenceSplit()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            dims = sequence_dims(node.meta.get("val"), found.symbol)
            if len(dims) == 1:
                out.inputs[node.name] = dims[0]
                out.length = out.length or _hint(node.meta["val"].shape[dims[0]])
    out.positions = sorted(found.positions) + sorted(found.tables)
    for name, why in found.blocked.items():
        out.whole.append(WholeAttention(name, found.attention.get(name, ""), why))
    built: dict[torch.fx.Node, str] = {}  # mask -> why it is not causal: every layer reads one mask (Hugging Face)
    for node in gm.graph.nodes:
        if node.name not in found.attention:
            continue
        path = found.attention[node.name]
        if found.causal[node.name]:
            out.attention.append(SplitAttention(node.name, path, "is_causal"))
            continue
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        why = _not_causal(gm, node, mask, found, out.length, built)
        if why:
            out.whole.append(WholeAttention(node.name, path, why))
        else:
            tokens = min(out.length or CHECK_TOKENS, CHECK_TOKENS)
            out.attention.append(SplitAttention(node.name, path, f"causal mask (checked at {tokens} tokens)"))
    if out.whole and not out.why_not:
        out.why_not = f"{len(out.whole)} ops need the whole sequence on one rank"
    return out


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return seen


def _not_causal(gm: torch.fx.GraphModule, attention: torch.fx.Node, mask: Any, found: ContextGraph,
                length: int | None, built: dict[torch.fx.Node, str]) -> str:
    """Why the mask of `attention` is not the causal one ('' where it is); a mask is built once (`built`)."""
    if attention.kwargs.get("is_causal") or (len(attention.args) > 5 and attention.args[5]):
        return "it is causal and also has a mask: both apply, and the mask is not known"
    if not isinstance(mask, torch.fx.Node):
        return "no mask and not causal: every query attends to every key (bidirectional)"
    nodes = _ancestors(mask)
    read = [n.name for n in nodes if n.op == "placeholder" and any(
        u in nodes and "sym_size" not in str(u.target) for u in n.users)]
    if read:
        return f"its mask reads the values of input {', '.join(read)} (padding, documents): not only positions"
    if mask not in built:
        built[mask] = _built_not_causal(gm, nodes, mask, found, length)
    return built[mask]


def _built_not_causal(gm: torch.fx.GraphModule, nodes: set[torch.fx.Node], mask: torch.fx.Node, found: ContextGraph,
                      length: int | None) -> str:
    """Why `mask`, built by its own nodes, is not the causal one ('' where it is)."""
    tokens = min(length or CHECK_TOKENS, CHECK_TOKENS)
    try:
        with torch.device("cpu"):  # a model planned on meta runs under meta as the default device
            value = _evaluate(gm, nodes, mask, found, tokens)
    except Exception as exc:  # noqa: BLE001 - a mask we cannot build is not known to be causal
        return f"its mask could not be built at {tokens} tokens to check it ({type(exc).__name__}: {exc})"
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=value.device).tril()
    allowed = value if value.dtype == torch.bool else value > torch.finfo(value.dtype).min / 2
    if tuple(allowed.shape[-2:]) != (tokens, tokens) or not bool((allowed == causal).all()):
        return f"its mask is not the causal one at {tokens} tokens (a sliding window, a prefix, or bidirectional)"
    return ""


def _evaluate(gm: torch.fx.GraphModule, nodes: set[torch.fx.Node], mask: torch.fx.Node, found: ContextGraph,
              tokens: int) -> torch.Tensor:
    """The mask built by its own nodes for one sample of `tokens` tokens (other sizes as in the example), on the CPU:
    a plan's example is the whole batch (1,536 samples of a 7B Llama: 6 GiB a mask at 1,024 tokens)."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs = []
    for node in gm.graph.nodes:
        if node in nodes:
            env[node] = graph.node_copy(node, env.__getitem__)
            if "device" in node.kwargs:  # a model on meta builds its mask on meta: build it on the CPU here
                env[node].kwargs = {**env[node].kwargs, "device": torch.device("cpu")}
            if node.op == "placeholder":
                val = node.meta["val"]
                seq = sequence_dims(val, found.symbol)
                shape = [tokens if d in seq else 1 if d == 0 < min(seq, default=0) else (_hint(s) or 1)
                         for d, s in enumerate(val.shape)]  # dim 0 before the sequence dim: the batch
                inputs.append(torch.zeros(shape, dtype=val.dtype))
    graph.output(env[mask])
    with torch.no_grad():
        built: torch.Tensor = torch.fx.GraphModule(gm, graph)(*inputs)
    return built

