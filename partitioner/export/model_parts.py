"""A plan's stages as torchtitan's model parts: which of tok_embeddings, layers.N, norm and lm_head each stage holds.

torchtitan cuts its decoders (`torchtitan.distributed.pipeline_parallel._split_module`) by top-level
names only: `tok_embeddings`, the items `layers.N` of its layer dict, `norm` and `lm_head`; a name
inside a layer (`layers.3.attention_norm`) keeps nothing. The plan's model has its own names
(`model.layers.3` in Hugging Face Llama, `blocks.3` in a GPT), so each stage's part is read from
the plan's graph by role:

    before the first layer, with weights  -> tok_embeddings
    <layer list>.N (the repeated blocks)  -> layers.N
    after the last layer, first module    -> norm
    after the last layer, last module     -> lm_head

A cut inside one of these puts it whole in the stage that runs most of its FLOPs (what moved is
said in `ModelParts.moved`); a stage left holding none of them cannot be placed and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from partitioner.errors import PartitionError
from runtime.plan import Plan

__all__ = ["ModelParts", "model_parts"]

_NO_WORK = ("placeholder", "output")
Node = Mapping[str, Any]


@dataclass(frozen=True)
class ModelParts:
    """Each stage's torchtitan module names (`module_fqns_per_model_part`), and where they came from.

    Attributes:
        parts: for each stage, the names torchtitan's split keeps, in model order.
        layer_list: the plan model's module path of its repeated layers ("model.layers", "blocks").
        layers: how many layers the plan's model has (torchtitan's --config must build as many).
        sources: torchtitan name -> the plan model's modules it stands for.
        moved: one sentence per name the plan cuts between stages, saying where it went whole.
    """

    parts: list[list[str]]
    layer_list: str
    layers: int
    sources: dict[str, list[str]]
    moved: list[str]


def model_parts(plan: Plan) -> ModelParts:
    """The names of torchtitan's decoder each stage of `plan` holds (module docstring).

    Raises:
        PartitionError: the plan carries no graph; its model has no list of repeated layers;
            weights sit between layers; or a stage holds no whole part (the stage and the fix named).
    """
    if plan.graph is None:
        raise PartitionError("the plan carries no graph, so which layers each stage holds is unknown (plans made by "
                             "plan() and partition() carry one; attach one with "
                             "partitioner.predict.graph_data.attach_graph)")
    work = sorted((n for n in plan.graph["nodes"] if n.get("op") not in _NO_WORK and n.get("stage", -1) >= 0),
                  key=lambda n: n["position"])
    key, count = _layer_list(work)
    units, sources = _units(work, key, count)
    stages = len(plan.stages)
    placed: dict[str, int] = {}
    moved: list[str] = []
    for name, nodes in units.items():
        placed[name], sentence = _place(name, nodes, sources[name])
        if sentence:
            moved.append(sentence)
    placed.setdefault("tok_embeddings", min(placed.values()))
    last = max(placed.values())
    placed.setdefault("norm", placed.get("lm_head", last))
    placed.setdefault("lm_head", placed["norm"])
    order = ["tok_embeddings", *(f"layers.{k}" for k in range(count)), "norm", "lm_head"]
    parts: list[list[str]] = [[] for _ in range(stages)]
    for name in order:
        parts[placed[name]].append(name)
    _check_order(order, placed, sources)
    for s, part in enumerate(parts):
        if not part:
            touched = [f"{name} (placed in stage {placed[name]})" for name, nodes in units.items()
                       if any(n["stage"] == s for n in nodes)]
            what = f"only parts of {', '.join(touched)}" if touched else "no weights of the model"
            raise PartitionError(f"stage {s} runs {what}: torchtitan's stages hold whole modules (tok_embeddings, "
                                 "layers.N, norm, lm_head), each in the stage that runs most of it, so this stage "
                                 f"cannot be placed. Fix: plan with fewer stages ({len(parts)} now, the model has "
                                 f"{count} layers), so that every stage runs most of one layer at least")
    return ModelParts(parts, key, count, {k: v for k, v in sources.items() if v}, moved)


def _layer_list(work: Sequence[Node]) -> tuple[str, int]:
    """(module path of the repeated layers, how many), e.g. ("model.layers", 32): the outermost list of two or more
    (then the longest, then the one running most nodes)."""
    found: dict[str, set[int]] = {}
    size: dict[str, int] = {}
    for node in work:
        parts = str(node["module"]).split(".") if node["module"] else []
        for i in range(1, len(parts)):
            if parts[i].isdigit():
                found.setdefault(".".join(parts[:i]), set()).add(int(parts[i]))
                size[".".join(parts[:i])] = size.get(".".join(parts[:i]), 0) + 1
    if not found:
        raise PartitionError("the plan's model has no list of repeated layers (a ModuleList or Sequential such as "
                             "layers.0, layers.1, ...): torchtitan pipelines its decoders by layers.N, so this model "
                             "has no torchtitan form; run the plan on torch.distributed.pipelining (the CSV) instead")
    many = [k for k, v in found.items() if len(v) >= 2] or list(found)
    key = min(many, key=lambda k: (k.count("."), -len(found[k]), -size[k], k))
    indices = sorted(found[key])
    if indices != list(range(len(indices))):
        raise PartitionError(f"the plan's layers {key} are numbered {indices}, not 0..{len(indices) - 1}: torchtitan's "
                             "layers.N must be the plan's layers in order")
    return key, len(indices)


def _layer_of(module: str, key: str) -> int | None:
    if not module.startswith(key + "."):
        return None
    head = module[len(key) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _units(work: Sequence[Node], key: str, count: int) -> tuple[dict[str, list[Node]], dict[str, list[str]]]:
    """torchtitan name -> the plan's nodes it stands for, and -> the plan's modules (module docstring's table)."""
    units: dict[str, list[Node]] = {f"layers.{k}": [] for k in range(count)}
    for node in work:
        k = _layer_of(str(node["module"]), key)
        if k is not None:
            units[f"layers.{k}"].append(node)
    begin = min(n["position"] for nodes in units.values() for n in nodes)
    end = max(n["position"] for nodes in units.values() for n in nodes)
    outside = [n for n in work if _layer_of(str(n["module"]), key) is None]
    between = [n for n in outside if begin < n["position"] < end and n.get("param_bytes", 0) > 0]
    if between:
        odd = between[0]
        raise PartitionError(f"{odd['name']} ({odd['module'] or 'the model itself'}) uses weights between the layers "
                             f"of {key}; torchtitan's decoder has no module there (only tok_embeddings, layers.N, "
                             "norm, lm_head), so this model has no torchtitan form")
    pre = [n for n in outside if n["position"] < begin and n.get("param_bytes", 0) > 0]
    post_modules = list(dict.fromkeys(str(n["module"]) for n in outside if n["position"] > end and n["module"]))
    post = {m: [n for n in outside if n["position"] > end and n["module"] == m] for m in post_modules}
    if pre:
        units["tok_embeddings"] = pre
    if post_modules:
        units["lm_head"] = post[post_modules[-1]]
    if len(post_modules) > 1:
        units["norm"] = [n for m in post_modules[:-1] for n in post[m]]
    sources = {name: [f"{key}.{name[len('layers.'):]}"] if name.startswith("layers.") else
               list(dict.fromkeys(str(n["module"]) or "the model's own weights" for n in nodes))
               for name, nodes in units.items()}
    return units, sources


def _place(name: str, nodes: Sequence[Node], sources: Sequence[str]) -> tuple[int, str]:
    """(the stage `name` goes to, a sentence if the plan cuts it): the stage that runs most of its FLOPs."""
    weight: dict[int, float] = {}
    for node in nodes:
        weight[node["stage"]] = weight.get(node["stage"], 0.0) + max(float(node.get("flops", 0) or 0), 1.0)
    stage = max(sorted(weight), key=lambda s: weight[s])
    if len(weight) == 1:
        return stage, ""
    total = sum(weight.values())
    shares = ", ".join(f"stage {s} {100 * w / total:.0f}%" for s, w in sorted(weight.items()))
    cut = next(n for a, n in zip(nodes, nodes[1:]) if a["stage"] != n["stage"])
    return stage, (f"{name} ({', '.join(sources)}): the plan cuts it before {cut['name']} ({cut['module']}; its "
                   f"FLOPs: {shares}); torchtitan keeps it whole: exported in stage {stage}")


def _check_order(order: Sequence[str], placed: Mapping[str, int], sources: Mapping[str, Sequence[str]]) -> None:
    """Raise PartitionError unless the names run in stage order (each stage one run of the model, as torch passes)."""
    for a, b in zip(order, order[1:]):
        if placed[b] < placed[a]:
            raise PartitionError(f"{b} ({', '.join(sources.get(b, [])) or 'no module'}) is in stage {placed[b]}, "
                                 f"before {a} in stage {placed[a]}: torchtitan runs stages in model order; plan "
                                 "with placement='pipeline' (stages one after another)")
