"""Pipeline schedules as tables of actions per rank, as include/tessera/parallel/pipeline_schedule.hpp
builds them (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V) and as torch.distributed.pipelining
writes them to CSV (one row per rank, cells "<stage><op><micro-batch>", blank cells skipped), and
a simulation of a table in time with per-stage costs.

Both implementations are pinned to the same golden tables (tests/parallel/pipeline_tables/*.csv):
the C++ test and tests/tools/test_simulate.py compare their tables with them cell by cell.

The simulation runs every rank's actions in order, each as soon as what it needs has ended: F of
stage s needs F of stage s-1 (the activations), I (or B) of stage s needs its own F and the input
gradient from I (or B) of stage s+1, W needs its own I. A dependency across ranks is a message on
a directed link (stage s -> s+1 forward, s+1 -> s backward) that carries one message at a time, in
the order its sender produced them; one within a rank is free.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from tessera_tools.simulate.inputs import InputError

COMPUTE = ("F", "B", "I", "W")
BUILT_IN = ("gpipe", "1f1b", "interleaved1f1b", "zbh1", "zbv")
_ACTION = re.compile(r"^\s*(\d+)([A-Z_]+)(\d+)\s*$")
_LONG_NAMES = {"FORWARD": "F", "FULL_BACKWARD": "B", "BW": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


@dataclass(frozen=True)
class Action:
    stage: int
    op: str  # F, B (input and weight gradients at once), I, W
    micro: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op}{self.micro}"


@dataclass
class Table:
    name: str
    ranks: int
    stages_per_rank: int
    micro_batches: int
    placement: str  # "loop": stage k on rank k mod P; "v": k < P ? k : 2P - 1 - k
    actions: list[list[Action]] = field(default_factory=list)

    @property
    def stages(self) -> int:
        return self.ranks * self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        if self.placement == "loop":
            return stage % self.ranks
        return stage if stage < self.ranks else 2 * self.ranks - 1 - stage

    def stages_of(self, rank: int) -> list[int]:
        return [k for k in range(self.stages) if self.rank_of(k) == rank]

    def to_csv(self) -> str:
        """torch's grid: each action in the step it would start if every action took one step (a whole
        B too), blank cells where a rank waits, as torch's own schedules dump theirs; the lock-step
        runtime (PipelineScheduleMulti) posts a rank's receives from its neighbours' cells of the same
        step, so a table it loads must be aligned so. A table that cannot run is written compact."""
        try:
            steps = simulate(self, StageCosts([], [], [], []), unit_steps=True).start
        except InputError:
            return "".join(",".join(str(a) for a in row) + "\n" for row in self.actions)
        lines = []
        for row, starts in zip(self.actions, steps):
            cells = [""] * (int(round(starts[-1])) + 1 if starts else 0)
            for a, step in zip(row, starts):
                cells[int(round(step))] = str(a)
            lines.append(",".join(cells) + "\n")
        return "".join(lines)


def _empty(name: str, ranks: int, v: int, m: int, placement: str) -> Table:
    if ranks < 1 or m < 1 or v < 1:
        raise InputError(f"pipeline schedule {name}: {ranks} ranks, {v} stages per rank, {m} micro-batches "
                         f"(each at least 1)")
    return Table(name, ranks, v, m, placement, [[] for _ in range(ranks)])


def gpipe(ranks: int, m: int) -> Table:
    t = _empty("GPipe", ranks, 1, m, "loop")
    for r in range(ranks):
        t.actions[r] = [Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)]
    return t


def one_f_one_b(ranks: int, m: int) -> Table:
    t = _empty("1F1B", ranks, 1, m, "loop")
    for r in range(ranks):
        warmup = min(ranks - 1 - r, m)
        row = [Action(r, "F", i) for i in range(warmup)]
        for i in range(m - warmup):
            row += [Action(r, "F", warmup + i), Action(r, "B", i)]
        row += [Action(r, "B", i) for i in range(m - warmup, m)]
        t.actions[r] = row
    return t


def interleaved_1f1b(ranks: int, v: int, m: int) -> Table:
    """Megatron-LM's order: rank r's k-th forward runs its stage (k / P) mod v on micro-batch
    (k / (P v)) P + k mod P; backwards the same with the stages reversed; warm-up 2(P-1-r) + (v-1)P."""
    t = _empty("Interleaved1F1B", ranks, v, m, "loop")
    if m % ranks:
        raise InputError(f"pipeline schedule Interleaved1F1B: {m} micro-batches is not a multiple of the {ranks} "
                         f"ranks (the micro-batches go through each rank's stages in rounds of one per rank)")
    p, total = ranks, m * v

    def chunk(k: int, forward: bool) -> int:
        c = (k // p) % v
        return c if forward else v - 1 - c

    def micro(k: int) -> int:
        return (k // (p * v)) * p + k % p

    for r in range(p):
        row: list[Action] = []
        warmup = min((p - 1 - r) * 2 + (v - 1) * p, total)
        f = b = 0
        while f < warmup:
            row.append(Action(chunk(f, True) * p + r, "F", micro(f)))
            f += 1
        while f < total:
            row.append(Action(chunk(f, True) * p + r, "F", micro(f)))
            f += 1
            row.append(Action(chunk(b, False) * p + r, "B", micro(b)))
            b += 1
        while b < total:
            row.append(Action(chunk(b, False) * p + r, "B", micro(b)))
            b += 1
        t.actions[r] = row
    return t


def zb_h1(ranks: int, m: int) -> Table:
    """1F1B with each B split into I and W, rank r's W_i placed after its I_{i+r} (the rest at the end)."""
    t = one_f_one_b(ranks, m)
    t.name = "ZBH1"
    for r in range(ranks):
        split: list[Action] = []
        weights = 0
        for a in t.actions[r]:
            if a.op != "B":
                split.append(a)
                continue
            split.append(Action(r, "I", a.micro))
            if a.micro >= r:
                split.append(Action(r, "W", weights))
                weights += 1
        split += [Action(r, "W", i) for i in range(weights, m)]
        t.actions[r] = split
    return t


def zb_v(ranks: int, m: int) -> Table:
    """ZB-V: two stages per rank in V placement, ordered by running the pipeline with F, I and W of
    one unit each: a free rank runs an I if it can, else an F while it holds fewer than 2P
    micro-batches, else a W; the oldest micro-batch first, the later stage between equals."""
    t = _empty("ZBV", ranks, 2, m, "v")
    cap = 2 * ranks
    stages, last = t.stages, t.stages - 1
    f_end: dict[tuple[int, int], float] = {}
    i_end: dict[tuple[int, int], float] = {}
    w_done: set[tuple[int, int]] = set()
    next_forward = [0] * stages
    held = [0] * ranks
    clock = [0.0] * ranks
    mine = [sorted(t.stages_of(r), reverse=True) for r in range(ranks)]
    remaining = [3 * m * len(mine[r]) for r in range(ranks)]

    def done(end: float | None, now: float) -> bool:
        return end is not None and end <= now

    while True:
        busy = [r for r in range(ranks) if remaining[r] > 0]
        if not busy:
            break
        r = min(busy, key=lambda q: (clock[q], q))
        now = clock[r]
        pick: Action | None = None
        for op in ("I", "F", "W"):
            for s in mine[r]:
                for i in range(m):
                    if op == "I":
                        ok = (done(f_end.get((s, i)), now) and (s, i) not in i_end
                              and (s == last or done(i_end.get((s + 1, i)), now)))
                    elif op == "F":
                        ok = (i == next_forward[s] and held[r] < cap
                              and (s == 0 or done(f_end.get((s - 1, i)), now)))
                    else:
                        ok = done(i_end.get((s, i)), now) and (s, i) not in w_done
                    if ok:
                        if pick is None or i < pick.micro:
                            pick = Action(s, op, i)
                        break
            if pick is not None:
                break
        if pick is not None:
            end = now + 1
            key = (pick.stage, pick.micro)
            if pick.op == "F":
                f_end[key] = end
                next_forward[pick.stage] += 1
                held[r] += 1
            elif pick.op == "I":
                i_end[key] = end
            else:
                w_done.add(key)
                held[r] -= 1
            t.actions[r].append(pick)
            clock[r] = end
            remaining[r] -= 1
            continue
        # Nothing runnable now: wait for the next end of an F or I, or for another rank to move.
        later = [e for e in list(f_end.values()) + list(i_end.values()) if e > now]
        others = [q for q in range(ranks) if q != r and remaining[q] > 0]
        later += [clock[q] for q in others if clock[q] > now]
        if not later and others:
            later = [now + 1]  # every action lasts one unit
        if not later or min(later) > 4.0 * (3 * m * stages + 1):
            raise InputError(f"pipeline schedule ZBV: no order of {m} micro-batches fits the memory limit of "
                             f"{cap} micro-batches on rank {r}")
        clock[r] = min(later)
    return t


def table(name: str, ranks: int, m: int, stages_per_rank: int = 2) -> Table:
    n = name.lower().replace("-", "").replace("_", "").replace(" ", "")
    if n == "gpipe":
        return gpipe(ranks, m)
    if n == "1f1b":
        return one_f_one_b(ranks, m)
    if n == "interleaved1f1b":
        return interleaved_1f1b(ranks, stages_per_rank, m)
    if n == "zbh1":
        return zb_h1(ranks, m)
    if n == "zbv":
        return zb_v(ranks, m)
    raise InputError(f"pipeline schedule '{name}': unknown (built in: GPipe, 1F1B, Interleaved1F1B, ZBH1, ZBV; "
                     f"or a table from a CSV file)")


def parse_csv(text: str, name: str = "csv") -> Table:
    """A compute-only table in torch.distributed.pipelining's CSV form (row k = rank k). torch 2.5
    wrote the input gradient as B when the table also had W's: such a table's B's are read as I."""
    rows: list[list[Action]] = []
    for n, line in enumerate(text.splitlines(), 1):
        row: list[Action] = []
        for c, cell in enumerate(line.split(","), 1):
            if not cell.strip():
                continue
            match = _ACTION.match(cell)
            op = _LONG_NAMES.get(match.group(2), match.group(2)) if match else ""
            if not match or op not in COMPUTE:
                raise InputError(f"{name}: row {n} (rank {n - 1}), cell {c}: '{cell}' is not a compute action "
                                 f"<stage><F|B|I|W><micro-batch> (transfers are derived, not simulated from the file)")
            row.append(Action(int(match.group(1)), op, int(match.group(3))))
        rows.append(row)
    while rows and not rows[-1]:
        rows.pop()
    if not rows:
        raise InputError(f"{name}: no actions")
    ops = {a.op for row in rows for a in row}
    if "W" in ops and "I" not in ops:
        rows = [[Action(a.stage, "I" if a.op == "B" else a.op, a.micro) for a in row] for row in rows]
    stages = 1 + max(a.stage for row in rows for a in row)
    m = 1 + max(a.micro for row in rows for a in row)
    if stages % len(rows):
        raise InputError(f"{name}: {stages} stages over {len(rows)} ranks (each rank must hold as many)")
    t = Table(name, len(rows), stages // len(rows), m, "loop", rows)
    for placement in ("loop", "v"):
        t.placement = placement
        if placement == "v" and t.stages_per_rank != 2:
            continue
        if all(t.rank_of(a.stage) == r for r, row in enumerate(rows) for a in row):
            return t
    raise InputError(f"{name}: a row runs a stage that belongs to another rank under loop and V placement")


@dataclass
class StageCosts:
    """Seconds per micro-batch: forward, input-gradient and weight-gradient halves of each stage's
    backward (a whole B costs both), and each stage's outgoing transfer (to stage s+1 forward and
    its gradient back, the same size) over a link."""
    forward: Sequence[float]
    backward_input: Sequence[float]
    backward_weight: Sequence[float]
    transfer: Sequence[float]  # [s]: between stage s and s+1 (len stages - 1)


@dataclass
class Simulation:
    makespan: float
    busy: list[float]  # per rank
    start: list[list[float]]
    end: list[list[float]]

    def bubble_fraction(self) -> float:
        """Mean over ranks of the idle share of the makespan."""
        if self.makespan <= 0:
            return 0.0
        return sum(1 - b / self.makespan for b in self.busy) / len(self.busy)


def simulate(t: Table, costs: StageCosts, unit_steps: bool = False) -> Simulation:
    """unit_steps: every action takes one step and messages none (torch's grid; costs unused)."""
    where: dict[tuple[int, str, int], tuple[int, int]] = {}
    for r, row in enumerate(t.actions):
        for k, a in enumerate(row):
            where[(a.stage, a.op, a.micro)] = (r, k)

    def backward_of(stage: int, micro: int) -> tuple[int, int] | None:  # B, or I when split
        return where.get((stage, "B", micro)) or where.get((stage, "I", micro))

    def cost(a: Action) -> float:
        if unit_steps:
            return 1.0
        s = a.stage
        return {"F": costs.forward[s], "I": costs.backward_input[s], "W": costs.backward_weight[s],
                "B": costs.backward_input[s] + costs.backward_weight[s]}[a.op]

    ranks, last = t.ranks, t.stages - 1
    start: list[list[float]] = [[] for _ in range(ranks)]
    end: list[list[float]] = [[] for _ in range(ranks)]
    arrival: dict[tuple[int, str, int], float] = {}  # a message's arrival, keyed by its sender action
    link_free: dict[tuple[int, str], float] = {}  # (sender stage, direction) -> when the link is free
    nxt = [0] * ranks
    clock = [0.0] * ranks
    progress = True
    while progress:
        progress = False
        for r in range(ranks):
            while nxt[r] < len(t.actions[r]):
                a = t.actions[r][nxt[r]]
                needs: list[tuple[tuple[int, int] | None, bool, tuple[int, str, int] | None]] = []
                if a.op == "F" and a.stage > 0:
                    prev = where.get((a.stage - 1, "F", a.micro))
                    needs.append((prev, t.rank_of(a.stage - 1) != r, (a.stage - 1, "F", a.micro)))
                if a.op in ("B", "I"):
                    needs.append((where.get((a.stage, "F", a.micro)), False, None))
                    if a.stage < last:
                        nb = backward_of(a.stage + 1, a.micro)
                        key = None if nb is None else (a.stage + 1, t.actions[nb[0]][nb[1]].op, a.micro)
                        needs.append((nb, t.rank_of(a.stage + 1) != r, key))
                if a.op == "W":
                    needs.append((where.get((a.stage, "I", a.micro)), False, None))
                ready = clock[r]
                blocked = False
                for loc, crosses, key in needs:
                    if loc is None:
                        raise InputError(f"pipeline schedule '{t.name}': {a} on rank {r} needs an action the table lacks")
                    nr, nk = loc
                    if nk >= nxt[nr]:
                        blocked = True
                        break
                    ready = max(ready, arrival[key] if crosses and key is not None else end[nr][nk])
                if blocked:
                    break
                start[r].append(ready)
                end[r].append(ready + cost(a))
                clock[r] = end[r][-1]
                nxt[r] += 1
                progress = True
                # Its result, if a stage on another rank needs it, goes out on the link now.
                target = a.stage + 1 if a.op == "F" else a.stage - 1 if a.op in ("B", "I") else -1
                if 0 <= target <= last and t.rank_of(target) != r:
                    link_key = (min(a.stage, target), "forward" if a.op == "F" else "backward")
                    sent = max(end[r][-1], link_free.get(link_key, 0.0))
                    arrival[(a.stage, a.op, a.micro)] = sent + (0.0 if unit_steps else costs.transfer[min(a.stage, target)])
                    link_free[link_key] = arrival[(a.stage, a.op, a.micro)]
    stuck = [f"rank {r} at {t.actions[r][nxt[r]]}" for r in range(ranks) if nxt[r] < len(t.actions[r])]
    if stuck:
        raise InputError(f"pipeline schedule '{t.name}' deadlocks: {'; '.join(stuck)}")
    first = min((s[0] for s in start if s), default=0.0)
    finish = max((e[-1] for e in end if e), default=0.0)
    busy = [sum(e - s for s, e in zip(start[r], end[r])) for r in range(ranks)]
    return Simulation(makespan=finish - first, busy=busy, start=start, end=end)


def unit_bubble(t: Table) -> float:
    """The schedule's own bubble: F, I and W one unit each (a whole B two), free transfers."""
    n = t.stages
    return simulate(t, StageCosts([1.0] * n, [1.0] * n, [1.0] * n, [0.0] * max(n - 1, 0))).bubble_fraction()
