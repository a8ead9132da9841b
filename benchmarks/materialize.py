"""A 1B-parameter GPT built on meta, planned, and materialized stage by stage from safetensors on 2 torchrun ranks.

Usage:
    python benchmarks/materialize.py                        # 1.6B parameters (6.4 GB fp32), a few minutes
    python benchmarks/materialize.py --layers 6 --width 1024  # a small run (what tests/test_materialize.py does)

The parent writes random weights to a sharded safetensors folder in a temp dir, one block at a
time (it never holds the whole model), then runs `torchrun --standalone --nproc_per_node=2` on
this file. Each rank builds the model on meta, calls `partition(model, ["cpu", "cpu"],
weights=folder, ...)`, runs one train_step (block weights frozen, so no full-size gradients)
and reports its peak host RSS (VmHWM) beside the full model's bytes. The parent then loads the
whole model itself, computes the same loss, and checks the ranks' loss against it.
Prints per rank `rank r: peak RSS A GB = B% of the model's C GB`, then
`peak host RSS per rank: max B% of the full model (limit 60%)`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.models import GPT, Block, GPTConfig  # noqa: E402

LIMIT = 0.60


@dataclass
class Config:
    layers: int = 32
    width: int = 2048
    heads: int = 16
    vocab: int = 1024  # small: the two stages are near equal in bytes
    seq: int = 64
    batch: int = 2  # the proof step: 2 micro-batches of one sample, 16 tokens (activations stay small)
    tokens: int = 16

    def gpt(self) -> GPTConfig:
        return GPTConfig(vocab=self.vocab, width=self.width, heads=self.heads, layers=self.layers, seq=self.seq)


def status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024  # type: ignore[union-attr]


def model_bytes(cfg: Config) -> int:
    with torch.device("meta"):
        model = GPT(cfg.gpt())
    return sum(p.numel() * p.element_size() for p in model.parameters())


def write_weights(cfg: Config, folder: Path) -> None:
    """Random weights as a sharded safetensors folder with an index, one block in memory at a time."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    gcfg = cfg.gpt()
    weight_map: dict[str, str] = {}
    with torch.device("meta"):
        skeleton = GPT(gcfg)
    rest = {}
    for name, p in skeleton.named_parameters():  # embeddings, final norm (the head is tied to tok)
        if not name.startswith("blocks."):
            rest[name] = (torch.randn(p.shape) * 0.02) if p.dim() > 1 else torch.ones(p.shape)
    shards = [("model-rest.safetensors", rest)]
    save_file(rest, str(folder / shards[0][0]))
    weight_map.update(dict.fromkeys(rest, shards[0][0]))
    for i in range(cfg.layers):
        block = Block(gcfg)
        state = {f"blocks.{i}.{k}": v.contiguous() for k, v in block.state_dict().items()}
        name = f"model-block{i:03d}.safetensors"
        save_file(state, str(folder / name))
        weight_map.update(dict.fromkeys(state, name))
        del block, state
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def fill_masks(module: torch.nn.Module) -> None:
    """init=: the causal masks, non-persistent buffers no checkpoint holds (everything else comes from weights)."""
    if isinstance(module, Block):
        module.mask.copy_(torch.tril(torch.ones_like(module.mask)))


def batch(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, cfg.vocab, (cfg.batch, cfg.tokens), generator=g),
            torch.randint(0, cfg.vocab, (cfg.batch, cfg.tokens), generator=g))


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def rank_main(cfg: Config, folder: str) -> None:
    import torch.distributed as dist

    from partitioner import partition

    rank = int(os.environ["RANK"])
    before = status("VmRSS")
    with torch.device("meta"):
        model = GPT(cfg.gpt())
    for name, p in model.named_parameters():  # train the position embedding and final norm only: small gradients
        p.requires_grad_(name.startswith(("pos.", "ln.")))
    x, y = batch(cfg)
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2, weights=folder, init=fill_masks)
    after_partition = status("VmHWM")
    held = pipe.held_tensor_ids()
    stray = [n for n, p in model.named_parameters() if id(p) not in held and p.numel() and not p.is_meta]
    missing = [n for n, p in model.named_parameters() if id(p) in held and p.is_meta]
    local = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    loss = pipe.train_step(x, y, loss_fn)
    peak = status("VmHWM")
    print(f"RANK rank={rank} before={before} partition_peak={after_partition} peak={peak} local_bytes={local} "
          f"stray={len(stray)} missing={len(missing)} loss={float(loss) if loss is not None else 'none'}", flush=True)
    dist.barrier()


def reference_loss(cfg: Config, folder: Path) -> float:
    """The whole model in this process, loaded with load_state_dict from the same files."""
    from safetensors.torch import load_file

    with torch.device("meta"):
        model = GPT(cfg.gpt())
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    state["head.weight"] = state["tok.weight"]
    model.load_state_dict(state, assign=True)
    model.head.weight = model.tok.weight
    for block in model.blocks:  # non-persistent: not in any state dict
        block.mask = torch.tril(torch.ones(cfg.seq, cfg.seq, dtype=torch.bool))
    x, y = batch(cfg)
    with torch.no_grad():
        return float(loss_fn(model(x), y))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field, default in vars(Config()).items():
        parser.add_argument(f"--{field}", type=int, default=default)
    parser.add_argument("--rank-folder", default=None, help=argparse.SUPPRESS)  # set for the torchrun children
    args = parser.parse_args()
    cfg = Config(**{k: getattr(args, k) for k in vars(Config())})
    if args.rank_folder is not None:
        rank_main(cfg, args.rank_folder)
        return
    total = model_bytes(cfg)
    folder = Path(tempfile.mkdtemp(prefix="materialize-bench-"))
    try:
        write_weights(cfg, folder)
        print(f"model: {total / 4:.3g} parameters, {total / 1e9:.2f} GB fp32 ({total} bytes), written to {folder}",
              flush=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               "--rank-folder", str(folder), *[f"--{k}={v}" for k, v in vars(cfg).items()]]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        ranks = sorted(re.findall(r"RANK rank=(\d+) before=(\d+) partition_peak=(\d+) peak=(\d+) local_bytes=(\d+) "
                                  r"stray=(\d+) missing=(\d+) loss=(\S+)", run.stdout))
        if run.returncode != 0 or len(ranks) != 2:
            print(run.stdout[-4000:], run.stderr[-4000:], sep="\n")
            raise SystemExit(f"torchrun failed (exit {run.returncode})")
        ref = reference_loss(cfg, folder)
        worst = 0.0
        for rank, before, partition_peak, peak, local, stray, missing, loss in ranks:
            share = int(peak) / total
            worst = max(worst, share)
            print(f"rank {rank}: peak RSS {int(peak) / 1e9:.2f} GB = {100 * share:.1f}% of the model's "
                  f"{total / 1e9:.2f} GB (RSS before partition {int(before) / 1e9:.2f} GB, peak after partition "
                  f"{int(partition_peak) / 1e9:.2f} GB; holds {int(local) / 1e9:.2f} GB of weights; "
                  f"other stages' weights materialized: {stray}, own still on meta: {missing}; loss {loss})")
        losses = [float(r[7]) for r in ranks if r[7] != "none"]
        print(f"loss on the last stage {losses} vs the whole model loaded in one process {ref:.6f}")
        if not losses or any(abs(v - ref) > 1e-4 * max(1.0, abs(ref)) for v in losses):
            raise SystemExit("the pipelined loss differs from the whole model's")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"peak host RSS per rank: max {100 * worst:.1f}% of the full model (limit {100 * LIMIT:.0f}%)")


if __name__ == "__main__":
    main()
