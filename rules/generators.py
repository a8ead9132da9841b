"""The built-in schedules' generators: micro-batch and stage (or rank) counts in, per-stage or per-rank action lists.

Each is a small pure function checked against a literal table (tests/test_schedule.py);
`rules.schedules` registers them with their layouts and closed forms.
"""

from __future__ import annotations

from typing import Iterator, Literal, Sequence

from rules.actions import Action, Kind, check_counts

__all__ = [
    "clock_cycles", "dag_gpipe", "dag_levels", "dualpipe_v", "dualpipe_v_micro_batches", "gpipe", "interleaved_fill",
    "interleaved_micro_batches", "interleaved_one_f_one_b", "interleaved_warmup", "one_f_one_b", "stream_one_f_one_b",
    "v_stage_ranks", "zero_bubble_h1", "zero_bubble_v",
]


def clock_cycles(micro_batches: int, stages: int) -> Iterator[list[tuple[int, int]]]:
    """GPipe forward staircase: at tick k, every (i, j) with i + j == k runs.

    m=3, n=2:   tick 0: (0,0)
                tick 1: (1,0) (0,1)
                tick 2: (2,0) (1,1)
                tick 3:       (2,1)
    """
    for k in range(micro_batches + stages - 1):
        yield [(k - j, j) for j in range(max(1 + k - micro_batches, 0), min(1 + k, stages))]


def gpipe(micro_batches: int, stages: int) -> list[list[Action]]:
    """Per-stage action lists for GPipe fill-drain: all forwards, then backwards in reverse."""
    return [
        [Action(s, "F", i) for i in range(micro_batches)]
        + [Action(s, "B", i) for i in reversed(range(micro_batches))]
        for s in range(stages)
    ]


def dag_levels(producers: Sequence[Sequence[int]]) -> list[int]:
    """Depth of each stage in the stage DAG: 0 without producers, else 1 + the deepest producer.

    `producers[s]` lists the stages whose values stage s reads; they must all be below s.
    A chain (each stage reading the one before) gives levels 0, 1, 2, ...
    """
    levels: list[int] = []
    for s, ps in enumerate(producers):
        if any(p >= s for p in ps):
            raise ValueError(f"stage {s} reads from stages {sorted(ps)}; stages must be numbered in topological order")
        levels.append(1 + max((levels[p] for p in ps), default=-1))
    return levels


def dag_gpipe(micro_batches: int, levels: Sequence[int], owner: Sequence[int]) -> list[list[Action]]:
    """GPipe for a DAG of stages: one list per owner (device or rank), in clock-tick order.

    Forward of stage s on micro-batch i runs at tick i + levels[s]; each owner runs its
    forwards by tick (then stage), then its backwards in exactly the reverse order. Every
    dependency has a smaller tick, so no owner waits on work queued behind its own. For a
    chain with one stage per owner this is `gpipe`. Branches at the same level on
    different owners run at the same tick:

        stages 0 -> {1, 2} -> 3, owners [0, 0, 1, 0], m = 2
        tick:     0   | 1       | 2       | 3   || backwards, reversed
        owner 0:  0F0 | 0F1 1F0 | 1F1 3F0 | 3F1 || 3B1 3B0 1B1 1B0 0B1 0B0
        owner 1:        2F0     | 2F1           || 2B1 2B0
    """
    if micro_batches < 1 or len(levels) != len(owner) or not levels:
        raise ValueError(
            f"need micro_batches >= 1 and one level and owner per stage, got {micro_batches}, {levels}, {owner}"
        )
    lists: list[list[Action]] = [[] for _ in range(max(owner) + 1)]
    forwards = sorted(
        ((i + levels[s], s, i) for s in range(len(levels)) for i in range(micro_batches)),
    )
    for _, s, i in forwards:
        lists[owner[s]].append(Action(s, "F", i))
    for actions in lists:
        actions += [Action(a.stage, "B", a.microbatch) for a in reversed(actions)]
    return lists


def interleaved_micro_batches(micro_batches: int, ranks: int, virtual_stages: int) -> str | None:
    """Why interleaved 1F1B cannot run `micro_batches` on `ranks`, or None: with 2 or more stages per
    rank it runs micro-batches in rounds of one per rank."""
    if virtual_stages > 1 and micro_batches % ranks:
        return (f"interleaved 1F1B runs micro-batches in rounds of {ranks} (one per device), but got {micro_batches}; "
                f"use a multiple of {ranks} such as {micro_batches + ranks - micro_batches % ranks}")
    return None


def dualpipe_v_micro_batches(micro_batches: int, ranks: int, _per_rank: int = 2) -> str | None:
    """Why DualPipeV cannot run `micro_batches` on `ranks`, or None: it needs one micro-batch per stage
    (torch's requirement), 2 x `ranks`."""
    if micro_batches < 2 * ranks:
        return (f"dualpipev needs at least one micro-batch per stage, 2 x {ranks} = {2 * ranks}, but got "
                f"{micro_batches}; pass micro_batches >= {2 * ranks}, or use 'zbv' (same layout, any count)")
    return None


def one_f_one_b(micro_batches: int, stages: int) -> list[list[Action]]:
    """Per-stage action lists for 1F1B (PipeDream-flush): at most p - s micro-batches in flight.

    Stage s runs w = min(p - s, m) warm-up forwards, then alternates one backward and one
    forward, then drains the remaining backwards:

        m=4, p=3   warm-up    steady: B then F     drain
        stage 0:   F0 F1 F2   B0 F3                B1 B2 B3
        stage 1:   F0 F1      B0 F2 B1 F3          B2 B3
        stage 2:   F0         B0 F1 B1 F2 B2 F3    B3

    Same bubble as GPipe, but stage s holds activations of only min(p - s, m) micro-batches.
    """
    check_counts(micro_batches, stages)
    lists = []
    for s in range(stages):
        warmup = min(stages - s, micro_batches)
        actions = [Action(s, "F", i) for i in range(warmup)]
        for i in range(micro_batches - warmup):
            actions += [Action(s, "B", i), Action(s, "F", warmup + i)]
        actions += [Action(s, "B", i) for i in range(micro_batches - warmup, micro_batches)]
        lists.append(actions)
    return lists


def stream_one_f_one_b(micro_batches: int, stages: int, steps: int) -> list[list[Action]]:
    """Per-stage 1F1B over a stream of `steps` batches of `micro_batches` each, with no flush between them.

    Batch t's micro-batches are numbered t*m .. t*m + m - 1; the stream is one 1F1B over all of
    them, so a stage starts the forwards of batch t + 1 before the backwards of batch t end
    (PipeDream-2BW and PipeDream's weight stashing; runtime/flushless.py cuts it into calls):

        m=2, p=2, steps=2   warm-up   steady: B then F            drain
        stage 0:            F0 F1     B0 F2 B1 F3                 B2 B3
        stage 1:            F0        B0 F1 B1 F2 B2 F3           B3
                                         batch 1 starts before batch 0 ends on stage 0
    """
    if steps < 1:
        raise ValueError(f"steps={steps}; a stream needs at least one batch")
    return one_f_one_b(micro_batches * steps, stages)


def interleaved_one_f_one_b(micro_batches: int, stages: int, virtual_stages: int) -> list[list[Action]]:
    """Per-device action lists for interleaved 1F1B (Megatron-LM's virtual pipeline).

    `stages` devices each hold `virtual_stages` model stages: device d runs stages
    d, d + p, ..., d + (v - 1) p, so the model has p * v stages and the bubble shrinks by v.
    Forwards go through a device's stages in rounds of p micro-batches, backwards in reverse:

        m=4, p=2, v=2 (stages 0 and 2 on device 0, stages 1 and 3 on device 1)
                   warm-up            steady: F then B                        drain
        device 0:  0F0 0F1 2F0 2F1    0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1         2B2 2B3 0B2 0B3
        device 1:  1F0 1F1            3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3

    Device d starts with min(2 (p - d - 1) + (v - 1) p, m v) warm-up forwards, then alternates
    one forward and one backward, then drains. With v = 1 this is `one_f_one_b`.

    Raises:
        ValueError: micro_batches is not a multiple of stages (rounds need p micro-batches).
    """
    check_counts(micro_batches, stages)
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages={virtual_stages}; pass 1 or more model stages per device")
    if virtual_stages == 1:
        return one_f_one_b(micro_batches, stages)
    problem = interleaved_micro_batches(micro_batches, stages, virtual_stages)
    if problem:
        raise ValueError(problem)
    p, v = stages, virtual_stages
    total = micro_batches * v

    def action(device: int, k: int, kind: Literal["F", "B"]) -> Action:
        group, rank = divmod(k, p * v)
        chunk = rank // p if kind == "F" else v - 1 - rank // p
        return Action(chunk * p + device, kind, group * p + rank % p)

    lists = []
    for d in range(p):
        warmup = interleaved_warmup(d, p, micro_batches, v)
        actions = [action(d, k, "F") for k in range(warmup)]
        for k in range(total - warmup):
            actions += [action(d, warmup + k, "F"), action(d, k, "B")]
        actions += [action(d, k, "B") for k in range(total - warmup, total)]
        lists.append(actions)
    return lists


def interleaved_warmup(device: int, stages: int, micro_batches: int, virtual_stages: int) -> int:
    """Forwards device `device` of `stages` runs before its first backward under interleaved 1F1B (Megatron-LM's
    num_warmup_microbatches): min(2 (p - d - 1) + (v - 1) p, m v). A device holds this many chunks' activations,
    and one more while the next forward runs (the searches' memory: partitioner/place/search/virtual_stages.py)."""
    p, v = stages, virtual_stages
    return min(2 * (p - device - 1) + (v - 1) * p, micro_batches * v)


def interleaved_fill(micro_batches: int, stages: int, virtual_stages: int) -> float:
    """Step over the slowest stage's work under interleaved 1F1B: (m + (p - 1) / v) / m, the bubble shrunk by v
    (Narayanan et al., SC'21, eq. 2, https://arxiv.org/abs/2104.04473)."""
    return (micro_batches + (stages - 1) / virtual_stages) / micro_batches


def zero_bubble_h1(micro_batches: int, stages: int) -> list[list[Action]]:
    """Per-stage action lists for ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2024).

    1F1B with each backward split into B (the inputs' gradients, which the stage before
    waits for) and W (the weights', which nobody waits for). Stage s runs 1F1B's warm-up
    and F/B order, and puts the W of micro-batch k - s after its k-th B: the first s W's
    wait, and the drain runs them where 1F1B idles. B alone is on the critical path, so the
    bubble shrinks from (p-1)(F+B+W) to about (p-1)(F+B-W): a third with equal F, B and W.

        m=4, p=2   warm-up   steady: B [W] F          drain: B [W], then the delayed W's
        stage 0:   F0 F1     B0 W0 F2 B1 W1 F3        B2 W2 B3 W3
        stage 1:   F0        B0 F1 B1 W0 F2 B2 W1 F3  B3 W2 W3

    A micro-batch's activations live from its F to its W: p - s + s = p at most on every
    stage, 1F1B's peak (stage 0's), where 1F1B holds p - s on stage s.
    """
    check_counts(micro_batches, stages)
    lists = []
    for s in range(stages):
        warmup = min(stages - s, micro_batches)
        actions = [Action(s, "F", i) for i in range(warmup)]
        for k in range(micro_batches):
            actions.append(Action(s, "B", k))
            if k >= s:
                actions.append(Action(s, "W", k - s))
            if warmup + k < micro_batches:
                actions.append(Action(s, "F", warmup + k))
        actions += [Action(s, "W", k) for k in range(max(0, micro_batches - s), micro_batches)]
        lists.append(actions)
    return lists


def v_stage_ranks(ranks: int) -> list[list[int]]:
    """The V layout of 2 x `ranks` stages (ZB-V): stage s on rank s going down, then back up.

        ranks=3:  stage 0 1 2 3 4 5
                  rank  0 1 2 2 1 0      rank r holds stages r and 2p - 1 - r
    """
    return [[s if s < ranks else 2 * ranks - 1 - s] for s in range(2 * ranks)]


def zero_bubble_v(micro_batches: int, ranks: int) -> list[list[Action]]:
    """Per-rank action lists for ZB-V (Qi et al., section 6): two stages per rank in a V.

    Rank r holds stages c0 = r and c1 = 2p - 1 - r (`v_stage_ranks`), so the first and the
    last stage (the loss) share rank 0 and a micro-batch turns around on rank p - 1 with no
    transfer. With n = max(m, 2p - 1), rank r runs

        warm-up    2(p - r) - 1 x F c0;   r x (F c1, F c0);   p - r x (F c1, B c1, W c1)
        steady     until n forwards of both:  [F c0] B c0 W c0  F c1 B c1 W c1
        drain      r x (B c0, B c1);   p - r x (B c0, W c0);   the remaining W's of c1, then c0

    then drops micro-batches m .. n - 1 (fewer than 2p - 1 micro-batches only leave gaps).
    The drain's W's fill the bubble: with F = B = W, the simulated bubble is p - 1 forwards
    of a half-size stage, half ZB-H1's. m=4, p=2 (stages 0 and 3 on rank 0, 1 and 2 on rank 1):

        rank 0:  0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 3B3 3W3
                 0B2 0W2 0B3 0W3
        rank 1:  1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 1B2 2B3
                 1B3 1W2 2W3 1W3
    """
    check_counts(micro_batches, ranks)
    return [[a for a in _v_rank(r, ranks, max(micro_batches, 2 * ranks - 1)) if a.microbatch < micro_batches]
            for r in range(ranks)]


def _v_rank(r: int, p: int, n: int) -> list[Action]:
    """Rank r's ZB-V list for n micro-batches (see `zero_bubble_v`)."""
    chunks = (r, 2 * p - 1 - r)
    done = {kind: [0, 0] for kind in ("F", "B", "W")}
    actions: list[Action] = []

    def run(*steps: tuple[Kind, int]) -> None:
        for kind, c in steps:
            actions.append(Action(chunks[c], kind, done[kind][c]))
            done[kind][c] += 1

    for _ in range(2 * (p - r) - 1):
        run(("F", 0))
    for _ in range(r):
        run(("F", 1), ("F", 0))
    for _ in range(p - r):
        run(("F", 1), ("B", 1), ("W", 1))
    while done["F"][1] < done["F"][0] or done["F"][0] < n:
        if done["F"][0] < n:
            run(("F", 0))
        run(("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))
    for _ in range(r):
        run(("B", 0), ("B", 1))
    for _ in range(p - r):
        run(("B", 0), ("W", 0))
    for c in (1, 0):
        while done["W"][c] < done["B"][c]:
            run(("W", c))
    return actions


def dualpipe_v(micro_batches: int, ranks: int) -> list[list[Action]]:
    """Per-rank action lists for DualPipeV (DeepSeek's DualPipe cut in half; torch's ScheduleDualPipeV).

    ZB-V's layout (`v_stage_ranks`: rank r holds c0 = r and c1 = 2p - 1 - r) and torch's order:

        1 warm-up   2(p - r - 1) x F c0;   r + 1 x (F c0, F c1);   p - r - 1 x (B c1, W c1, F c1)
        2 steady    m - 2p + r + 1 x (F c0, B c1, F c1, B c0)       two F&B chunks
        3 cool-down p - r - 1 x (B c1, F c1, B c0);   r + 1 x (B c1, B c0)
        4 drain     p - r - 1 x (W, B c0);   r + 1 x W              the W's owed, oldest first

    A B with a W is split (input gradients only): step 1's, and in step 3 those from the
    ((r + 1) // 2)-th pair on (from its B c0 when r is even) and step 4's; the others run whole.
    DualPipe overlaps each F&B chunk's forward with the other micro-batch's backward; our
    runtime has no compute overlap within a rank, so a chunk runs as its F, then its B.
    m=4, p=2 (stages 0 and 3 on rank 0, 1 and 2 on rank 1):

        rank 0:  0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0B2 0W2 0B3 0W3
        rank 1:  1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2B3 1B3 2W3 1W3

    Raises:
        ValueError: fewer than 2 x `ranks` micro-batches (torch's requirement: one per stage).
    """
    check_counts(micro_batches, ranks)
    problem = dualpipe_v_micro_batches(micro_batches, ranks)
    if problem:
        raise ValueError(problem)
    return [_dualpipe_v_rank(r, ranks, micro_batches) for r in range(ranks)]


def _dualpipe_v_rank(r: int, p: int, m: int) -> list[Action]:
    """Rank r's DualPipeV list (see `dualpipe_v`), step by step as torch's generator.

    Steps are 'F0' (forward of c0), 'B1' (whole backward of c1), 'I1' (its input-gradient part,
    which owes a W) and 'W' (the oldest W owed, if any), as torch's I and W.
    """
    chunks = (r, 2 * p - 1 - r)
    done = {"F": [0, 0], "B": [0, 0]}
    owed: list[Action] = []
    actions: list[Action] = []

    def run(*steps: str) -> None:
        for step in steps:
            if step == "W":
                actions.extend(owed[:1])
                del owed[:1]
                continue
            kind: Literal["F", "B"] = "F" if step[0] == "F" else "B"
            c = int(step[1])
            actions.append(Action(chunks[c], kind, done[kind][c]))
            done[kind][c] += 1
            if step[0] == "I":
                owed.append(Action(chunks[c], "W", actions[-1].microbatch))

    for _ in range(2 * (p - r - 1)):
        run("F0")
    for _ in range(r + 1):
        run("F0", "F1")
    for _ in range(p - r - 1):
        run("I1", "W", "F1")
    for _ in range(m - 2 * p + r + 1):
        run("F0", "B1", "F1", "B0")
    for _ in range(p - r - 1):
        run("B1", "F1", "B0")
    half = (r + 1) // 2
    for i in range(r + 1):  # the second half splits, from B c1 on odd ranks, from B c0 on even ones
        run("I1" if i > half or (i == half and r % 2) else "B1", "I0" if i >= half else "B0")
    for _ in range(p - r - 1):
        run("W", "I0")
    for _ in range(r + 1):
        run("W")
    return actions
