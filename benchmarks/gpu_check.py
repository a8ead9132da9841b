"""The GPU suite's figures on one GPU: runtime overhead, step-time and peak-memory prediction error,
equivalence on the tests' model zoo in fp32 (TF32 off) and under bf16 autocast.

Every stage runs on the same GPU in one process, so what is measured is what the runtime and
the plan add, not what a second GPU would give:
- overhead: a GPT training step (forward + backward), plain vs 2 stages on the device, with
  micro_batches 1 and 4 (4 against the plain model run over the same micro-batches), timed by
  CUDA events, interleaved so that clock drift hits both alike;
- step-time error: the plan's predicted step against CUDA-event-timed steps, fp32 and bf16;
- memory error: the plan's predicted peak of tensors (weights, gradients, activations in
  flight) against `torch.cuda.max_memory_allocated` during a step;
- equivalence: outputs and gradients of every zoo model against the plain model.
Last line: `gpu: overhead X%, step-time error Y%, memory error Z%`.
`--device cpu` runs the same code on the CPU (a dry run of the script, not a GPU figure).
Usage: python benchmarks/gpu_check.py [--device cuda:0] [--repeats 30]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
from models import GPT, GPTConfig  # noqa: E402

from partitioner import partition  # noqa: E402
from tests.zoo import ZOO, rel  # noqa: E402


def timed(device: torch.device, fn: Callable[[], Any]) -> float:
    """Milliseconds of `fn`: CUDA events on the current stream (the pipeline joins its workers'
    streams into it), wall clock on the CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return float(begin.elapsed_time(end))


@contextlib.contextmanager
def precision(device: torch.device, dtype: str) -> Iterator[None]:
    """fp32 with TF32 off (exact comparisons), or bf16 autocast."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16"):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def gpt(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=args.vocab, width=args.width, heads=8, layers=args.layers, seq=args.seq)
    x = torch.randint(0, cfg.vocab, (args.batch, cfg.seq), device=device)
    y = torch.randint(0, cfg.vocab, (args.batch, cfg.seq), device=device)
    return GPT(cfg).to(device), x, y


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def chunked_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int) -> None:
    """The plain model's step over `m` micro-batches one after another (m=1: the plain step)."""
    for part, target in zip(torch.tensor_split(x, m), torch.tensor_split(y, m)):
        (loss_fn(model(part), target) * part.shape[0] / x.shape[0]).backward()


def overhead(args: argparse.Namespace, device: torch.device) -> float:
    print(f"{'micro_batches':>13}  {'plain ms':>9}  {'plain, same micro-batches ms':>28}  {'2 stages ms':>11}  "
          f"{'overhead':>8}")
    at_one = 0.0
    for m in (1, 4):
        plain, x, y = gpt(args, device)
        pipe = partition(copy.deepcopy(plain), [device, device], example_inputs=(x,), micro_batches=m)

        runs: dict[str, list[float]] = {"plain": [], "chunked": [], "pipe": []}
        steps = {"plain": functools.partial(chunked_step, plain, x, y, 1),
                 "chunked": functools.partial(chunked_step, plain, x, y, m),
                 "pipe": functools.partial(pipe.train_step, x, y, loss_fn)}
        for r in range(args.warmup + args.repeats):
            order = ["plain", "chunked", "pipe"] if r % 2 else ["pipe", "chunked", "plain"]
            for name in order:
                ms = timed(device, steps[name])
                if r >= args.warmup:
                    runs[name].append(ms)
        a, c, b = (statistics.median(runs[k]) for k in ("plain", "chunked", "pipe"))
        base = a if m == 1 else c
        print(f"{m:>13}  {a:>9.3f}  {c:>28.3f}  {b:>11.3f}  {(b / base - 1) * 100:>7.1f}%")
        if m == 1:
            at_one = (b / a - 1) * 100
    return at_one


def fidelity(args: argparse.Namespace, device: torch.device) -> tuple[float, float]:
    """Worst step-time error over fp32 and bf16, and the peak-memory error (fp32), in %."""
    time_errors, memory_error = [], 0.0
    print(f"{'dtype':>5}  {'predicted ms':>12}  {'measured ms':>11}  {'error':>6}  {'predicted MiB':>13}  "
          f"{'measured MiB':>12}  {'error':>6}")
    for dtype in ("fp32", "bf16"):
        model, x, y = gpt(args, device)
        with precision(device, dtype):
            pipe = partition(model, [device, device], example_inputs=(x,), micro_batches=4, schedule="1f1b")
            plan = pipe.plan
            for _ in range(args.warmup):
                pipe.train_step(x, y, loss_fn)
            model.zero_grad(set_to_none=True)
            baseline = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            step = functools.partial(pipe.train_step, x, y, loss_fn)
            measured = statistics.median(timed(device, step) for _ in range(args.repeats))
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        predicted = plan.predicted_step_ms
        error = (predicted / measured - 1) * 100
        time_errors.append(abs(error))
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        # the plan's peak per stage counts the stage's weights, gradients and activations in flight
        predicted_bytes = sum(s.memory_bytes for s in plan.stages)
        measured_bytes = peak - baseline + weights  # weights were already allocated before the peak was reset
        mem_error = (predicted_bytes / measured_bytes - 1) * 100 if measured_bytes > 0 else float("nan")
        if dtype == "fp32":
            memory_error = abs(mem_error)
        print(f"{dtype:>5}  {predicted:>12.3f}  {measured:>11.3f}  {error:>5.1f}%  {predicted_bytes / 2**20:>13.1f}  "
              f"{measured_bytes / 2**20:>12.1f}  {mem_error:>5.1f}%")
    return max(time_errors), memory_error



def equivalence(device: torch.device) -> bool:
    """Every zoo model: outputs and gradients of 2 stages on `device` against the plain model."""
    ok = True
    for dtype, tolerance in (("fp32", 1e-5), ("bf16", 3e-2)):
        for name, factory in ZOO.items():
            if name == "hf_gpt2" and not _has_transformers():
                continue
            torch.manual_seed(0)
            model, args, kwargs = factory()
            model = model.to(device).eval()  # dropout off: the same function on both sides
            args = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, args)
            kwargs = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, kwargs)
            reference = copy.deepcopy(model)
            with precision(device, dtype):
                try:
                    copy.deepcopy(reference)(*args, **kwargs)
                except RuntimeError as exc:  # the plain model cannot run here (tensor_default: a CPU default on
                    refused = _refuses(model, device, args, kwargs)  # the GPU): equal means the pipeline refuses too
                    ok = ok and refused
                    print(f"  {dtype} {name:<16} the plain model raises here ({str(exc).splitlines()[0][:60]}); "
                          f"the pipeline {'refuses too: ok' if refused else 'does not: FAILED'}")
                    continue
                pipe = partition(model, [device, device], example_inputs=args, example_kwargs=kwargs,
                                 micro_batches=3)
                out, ref = pipe(*args, **kwargs), reference(*args, **kwargs)
                outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
                refs = [t for t in pytree.tree_leaves(ref) if isinstance(t, torch.Tensor) and t.is_floating_point()]
                sum(t.float().square().mean() for t in outs).backward()  # type: ignore[union-attr]
                sum(t.float().square().mean() for t in refs).backward()  # type: ignore[union-attr]
            pairs = zip(model.named_parameters(), reference.parameters())
            errors = [(rel(a, b), f"output {i}") for i, (a, b) in enumerate(zip(outs, refs))] + [
                (rel(p.grad, q.grad), f"grad {n}") for (n, p), q in pairs if p.grad is not None and q.grad is not None]
            worst, where = max(errors, default=(0.0, ""))
            good = len(outs) == len(refs) and worst <= tolerance
            ok = ok and good
            print(f"  {dtype} {name:<16} worst relative error {worst:.1e} {'ok' if good else 'FAILED'}", flush=True)
            if not good and where.startswith("grad "):
                print("      " + _against_fp32(where[5:], model, reference, factory, device, args, kwargs))
    return ok


def _against_fp32(param: str, model: nn.Module, reference: nn.Module, factory: Callable[[], Any],
                  device: torch.device, args: Any, kwargs: Any) -> str:
    """Where the pipeline and the plain model disagree on `param`'s gradient: each one's distance from the
    gradient of the plain model in fp32 (which side left the function, or both within bf16's reach of it)."""
    torch.manual_seed(0)
    exact = factory()[0].to(device).eval()
    exact.load_state_dict(reference.state_dict())
    with precision(device, "fp32"):
        out = exact(*args, **kwargs)
        sum(t.float().square().mean() for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.is_floating_point()).backward()  # type: ignore[union-attr]
    want = dict(exact.named_parameters())[param].grad
    got, plain = dict(model.named_parameters())[param].grad, dict(reference.named_parameters())[param].grad
    assert want is not None and got is not None and plain is not None
    return (f"{param}: pipeline vs fp32 {rel(got, want):.1e}, plain vs fp32 {rel(plain, want):.1e} "
            f"(largest |grad| {want.abs().max().item():.1e})")


def _refuses(model: nn.Module, device: torch.device, args: Any, kwargs: Any) -> bool:
    """Whether partitioning or running `model` raises, as the plain model does."""
    try:
        partition(model, [device, device], example_inputs=args, example_kwargs=kwargs, micro_batches=3)(*args, **kwargs)
    except (RuntimeError, ValueError):  # PartitionError is a ValueError
        return True
    return False


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: the GPU figures need one (run with --device cpu for a dry run of the script)")
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run, not a GPU figure)"
    print(f"device {device}: {name}; torch {torch.__version__}; GPT width {args.width}, {args.layers} layers, "
          f"batch {args.batch} x {args.seq}")
    over = overhead(args, device)
    step_error, memory_error = fidelity(args, device)
    print("equivalence on the test zoo (2 stages on the device, against the plain model):")
    same = equivalence(device)
    print(f"equivalence: {'all equal' if same else 'FAILED'}")
    print(f"gpu: overhead {over:.1f}%, step-time error {step_error:.1f}%, memory error {memory_error:.1f}%")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
