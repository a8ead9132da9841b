"""A context rank's attention: each query chunk over the keys it reaches, against one masked product over every key.

runtime.context_parallel splits a sequence over c ranks in 2c chunks (rank r: chunks r and 2c - 1 - r) and
all-gathers keys and values. One masked scaled_dot_product_attention over every key computes all c S x S / c
scores of a rank's queries; the causal mask keeps about half. `causal_chunks` attends each query chunk over the
prefix its causal mask reaches (that block's causal mask): (2c + 1) / 4c of the scores, near the
causal half that cost_model/analytic.py prices for a causal attention. This times forward + backward of both
on this machine's CPU, one rank's share (rank 0 and rank c - 1, whose chunks reach least and most), checks they
agree, and prints chunked / masked per degree with the FLOP ratio it should approach.

Usage: python benchmarks/context_attention.py [--seq 4096] [--repeat 3]
Last line: `context attention, chunked over masked (forward + backward): x<R> at c <C>` (the largest degree).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.context_parallel import ContextGroup, causal_chunks, positions  # noqa: E402


def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cg: ContextGroup) -> torch.Tensor:
    """The former ContextAttention: one product over every gathered key, the causal mask from positions."""
    mine = positions(q.shape[-2], cg)
    every = torch.cat([positions(k.shape[-2] // cg.degree, ContextGroup(None, r, cg.degree)) for r in range(cg.degree)])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=every.unsqueeze(0) <= mine.unsqueeze(1))


def timed(run: Callable[[], torch.Tensor], repeat: int) -> float:
    """Median seconds of forward + backward."""
    out = []
    for _ in range(repeat + 1):
        start = time.perf_counter()
        run().sum().backward()
        out.append(time.perf_counter() - start)
    return statistics.median(out[1:])  # the first warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    heads, dim = 8, 64
    print(f"sequence {args.seq}, {heads} heads of {dim}, float32 on CPU (1 thread), forward + backward, median of "
          f"{args.repeat}")
    ratio, degree = 0.0, 0
    for degree in (2, 4, 8):
        local = args.seq // degree
        rows = []
        for index in (0, degree - 1):
            cg = ContextGroup(None, index, degree)
            q = torch.randn(1, heads, local, dim, requires_grad=True)
            k, v = (torch.randn(1, heads, args.seq, dim, requires_grad=True) for _ in range(2))
            diff = (causal_chunks(q, k, v, cg) - masked(q, k, v, cg)).abs().max().item()
            old = timed(functools.partial(masked, q, k, v, cg), args.repeat)
            new = timed(functools.partial(causal_chunks, q, k, v, cg), args.repeat)
            rows.append((old, new))
            print(f"  c {degree} rank {index}: masked {old * 1e3:8.1f} ms, chunked {new * 1e3:8.1f} ms, "
                  f"x{new / old:.2f} (largest difference {diff:.1e})")
        ratio = sum(n for _, n in rows) / sum(o for o, _ in rows)
        print(f"c {degree}: chunked / masked x{ratio:.2f} (scores computed: x{(2 * degree + 1) / (4 * degree):.2f})")
    print(f"context attention, chunked over masked (forward + backward): x{ratio:.2f} at c {degree}")


if __name__ == "__main__":
    main()
