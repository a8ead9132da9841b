"""A pipeline without flushes: one endless 1F1B stream (runtime.schedule.stream_one_f_one_b), cut into calls.

Asynchronous updates (PipeDream-2BW, PipeDream's weight stashing) never drain the pipeline
between batches. The stream is lowered to ticks once (runtime.program.lower, so every message
keeps [Note: one agreed order]); call t of `train_step` runs the ticks [T_t, T_t+1), where T_t
is the tick of the first forward of batch t (micro-batch t*m):

    m=2, p=2       call 0          | call 1              | call 2 ...     flush after call 1
    stage 0:       F0 F1 . B0      | F2 B1 F3 B2         | F4 ...         B3
    stage 1:       .  F0 B0 F1 B1  | .  F2 B2 F3 ...     |                B3 ...

- A message is sent and received at one tick, so never between two calls.
- No forward of batch t+1 runs in call t: it needs batch t+1's data.
- By the end of call t every stage has run every backward of batch t-1 (`Stream` checks it:
  1F1B needs m >= p - 1), so the last forwards of batch t, and their losses, may end in call t+1.
- `drain(t)` finishes a stream whose last batch is t (`pipe.flush()`).

Lock-step lowering is periodic once the pipeline is full: call t > t0 is call t0 shifted by
(t - t0) * m micro-batches and a fixed number of ticks, and so is the drain. `Stream` lowers
a few batches, finds t0, proves the shift, and from then on only renumbers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from runtime.program import Op, lower
from runtime.schedule import Action, stream_one_f_one_b

__all__ = ["Stream", "StreamError"]

Segment = list[list[Op]]  # per rank, its ops of one call (or of the drain)


class StreamError(ValueError):
    """A plan cannot run as a stream of calls (the message says what to change)."""


class Stream:
    """The per-rank ops of every call of an endless 1F1B stream, and of the drain after any call.

    Args:
        micro_batches: m, per batch (per call).
        stage_ranks: the rank of each stage (one replica each).
        producers: for each stage, the stages it reads.
        devices: each rank's device (for the programs; unused by the ops).
    """

    def __init__(self, micro_batches: int, stage_ranks: Sequence[int], producers: Sequence[Sequence[int]],
                 devices: Sequence[str]) -> None:
        self.m, self.p = micro_batches, len(stage_ranks)
        if len(set(stage_ranks)) != self.p:
            raise StreamError(f"asynchronous updates run one stage per rank; got stage ranks {list(stage_ranks)}")
        self._ranks = list(stage_ranks)
        self._producers = [list(p) for p in producers]
        self._devices = list(devices)
        self._world = len(self._devices)
        self._steps: list[Segment] = []
        self._drains: list[Segment] = []
        self.t0 = -1
        self.period = 0
        for t0 in range(1, self.p + 4):
            lowered = [self._lower(n) for n in range(1, t0 + 5)]  # lowered[n - 1]: a stream of n batches
            steps = [self._segment(lowered[-1], t) for t in range(t0 + 3)]
            drains = [self._drain(lowered[t], lowered[-1], t) for t in range(t0 + 2)]
            period = self._start(lowered[-1], t0 + 1) - self._start(lowered[-1], t0)
            if all(self._shift(steps[t0], k * self.m, k * period) == steps[t0 + k] for k in (1, 2)) and \
                    self._shift(drains[t0], self.m, period) == drains[t0 + 1]:
                self._steps, self._drains, self.t0, self.period = steps[: t0 + 1], drains[: t0 + 1], t0, period
                break
        if self.t0 < 0:
            raise StreamError(f"the 1F1B stream of {self.p} stages and {self.m} micro-batches never settles into "
                              "a periodic steady state; use more micro-batches per step")
        self._check()

    def step(self, t: int) -> Segment:
        """Each rank's ops of call t (micro-batches numbered across the stream, ticks too)."""
        if t <= self.t0:
            return self._steps[t]
        return self._shift(self._steps[self.t0], (t - self.t0) * self.m, (t - self.t0) * self.period)

    def drain(self, t: int) -> Segment:
        """Each rank's ops that finish every micro-batch in flight after call t (the stream's last)."""
        if t <= self.t0:
            return self._drains[t]
        return self._shift(self._drains[self.t0], (t - self.t0) * self.m, (t - self.t0) * self.period)

    def lowered(self, batches: int) -> list[list[Op]]:
        """Each rank's ops of a whole stream of `batches` batches, drain included (what the simulator prices)."""
        return self._lower(batches)

    # ---- lowering ----

    def _lower(self, batches: int) -> list[list[Op]]:
        per_stage = stream_one_f_one_b(self.m, self.p, batches)
        lists: list[list[Action]] = [[] for _ in range(self._world)]
        for s, actions in enumerate(per_stage):
            lists[self._ranks[s]] += actions
        programs = lower(lists, self._producers, [[r] for r in self._ranks], self._devices)
        return [[op for op in p.ops if op.kind != "STEP"] for p in programs]

    def _start(self, ops: list[list[Op]], t: int) -> int:
        """T_t: the first tick with a forward of batch t's first micro-batch."""
        if t == 0:
            return 0
        return min(op.tick for rank in ops for op in rank if op.kind == "F" and op.microbatch == t * self.m)

    def _segment(self, ops: list[list[Op]], t: int) -> Segment:
        lo, hi = self._start(ops, t), self._start(ops, t + 1)
        return [[op for op in rank if lo <= op.tick < hi] for rank in ops]

    def _drain(self, finite: list[list[Op]], longer: list[list[Op]], t: int) -> Segment:
        """The ops of a stream of t + 1 batches from T_t+1 on; before T_t+1 it must agree with a longer one."""
        cut = self._start(longer, t + 1)
        if [[op for op in rank if op.tick < cut] for rank in finite] != \
                [[op for op in rank if op.tick < cut] for rank in longer]:
            raise StreamError(f"internal error: the stream of {t + 1} batches and a longer one differ before "
                              f"tick {cut}; the stream cannot be cut into calls")
        return [[op for op in rank if op.tick >= cut] for rank in finite]

    @staticmethod
    def _shift(segment: Segment, mb: int, ticks: int) -> Segment:
        return [[replace(op, microbatch=op.microbatch + mb, tick=op.tick + ticks) for op in rank] for rank in segment]

    def _check(self) -> None:
        """Every backward of batch t-1 runs by the end of call t; no forward of batch t+1 runs in call t."""
        for t in range(self.t0 + 2):
            for rank in self.step(t):
                for op in rank:
                    if op.kind == "F" and op.microbatch >= (t + 1) * self.m:
                        raise StreamError(f"internal error: call {t} runs {op}, a forward of the next batch")
            for rank in self.step(t + 1):  # batch t-1's backwards may not spill past call t
                for op in rank:
                    if op.kind == "B" and op.microbatch < t * self.m:
                        raise StreamError(
                            f"with {self.m} micro-batches over {self.p} stages, {op} of batch {op.microbatch // self.m}"
                            f" runs in call {t + 1}; asynchronous updates need every backward of batch t - 1 done by "
                            f"the end of call t: use micro_batches >= {self.p - 1}"
                        )
