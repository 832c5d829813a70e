"""What an elastic job under tessera-sbatch --elastic --replace left in its rank logs, judged as
bench/elastic_campaign.py judges a tessera-run job: the group shrank at the failure and grew back
when the replacements joined, lost no step, and every member's parameters agreed at each change
(the replacements' at the step they joined). Shared by test_slurm.py (a rank killed) and
test_slurm_two_nodes.py (a node taken down)."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent.parent / "bench"))
from elastic_campaign import FAIL_RE, FINAL_RE, GEN_RE, MEMBER_RE  # noqa: E402
from test_sbatch import CheckFailed, expect  # noqa: E402  (tests/tools is on the path of both tests)


class TooLate(CheckFailed):
    """The group finished training before a replacement could be admitted (the fault came too
    close to the end): the campaign draws the trial again, a test fails."""


def check_not_too_late(logs: pathlib.Path, slots: list[int]) -> None:
    for slot in slots:
        text = (logs / f"rank-{slot}.log").read_text(errors="replace")
        if "before it could admit this replacement" in text:
            raise TooLate(f"rank {slot}'s replacement came too late: "
                          f"{next(line for line in text.splitlines() if 'before it could admit' in line)}")


def slot_pid(program: str, job: str, slot: int) -> int:
    """The process id of slot `slot`'s program in Slurm job `job` (found in /proc by the name of
    its executable and its SLURM_JOB_ID and SLURM_PROCID; the wrapping shell is bash)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.path.basename(os.readlink(f"/proc/{entry}/exe")) != os.path.basename(program):
                continue
            environ = pathlib.Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue  # ended, or not ours to read
        env = dict(item.split(b"=", 1) for item in environ if b"=" in item)
        if env.get(b"SLURM_JOB_ID") == job.encode() and env.get(b"SLURM_PROCID") == str(slot).encode():
            return int(entry)
    raise CheckFailed(f"no process of {program} for rank {slot} of job {job}")


def watch_changes(job: subprocess.Popen[str], logs: pathlib.Path, fault_at: float, seconds: float,
                  tasks: int) -> dict[str, float]:
    """Polls the ranks' logs in LOGS until the job ends (at most SECONDS): the seconds from the
    fault to the group's first change ("recovery_s": the survivors go on) and to the change that
    brings it back to TASKS ranks ("rejoined_s": the replacements are in). The group's rank 0
    reports each change: slot 0's process, or after its death the lowest surviving slot's."""
    times: dict[str, float] = {}
    deadline = time.monotonic() + seconds
    while job.poll() is None and time.monotonic() < deadline:
        text = "\n".join(path.read_text(errors="replace") for path in sorted(logs.glob("rank-*.log")))
        now = time.monotonic()
        if "recovery_s" not in times and "elastic: generation 1:" in text:
            times["recovery_s"] = round(now - fault_at, 2)
        if "rejoined_s" not in times and re.search(rf"elastic: generation \d+: \d+ -> {tasks} ranks", text):
            times["rejoined_s"] = round(now - fault_at, 2)
        time.sleep(0.05)
    return times


def check_regrouped(logs: pathlib.Path, tasks: int, lost: list[int]) -> dict[str, object]:
    """The ranks `lost` left at one step and their replacements joined later; returns what was
    measured (steps, membership and heal seconds, accuracy) and a line that says it ("line")."""
    text = "\n".join((logs / f"rank-{r}.log").read_text(errors="replace") for r in range(tasks))
    gens = [m.groups() for m in GEN_RE.finditer(text)]
    expect(len(gens) >= 2, f"the group did not change twice (a failure, then the joins):\n{text[-3000:]}")
    shrink, grow = gens[0], gens[-1]
    expect(shrink[1:3] == (str(tasks), str(tasks - len(lost))),
           f"the first change is {shrink[1]} -> {shrink[2]} ranks, not {tasks} -> {tasks - len(lost)}:\n{text[-3000:]}")
    expect(grow[2] == str(tasks), f"the group did not grow back to {tasks} ranks:\n{text[-3000:]}")
    for slot in lost:
        expect(re.search(rf"left: [^)]*\b{slot}\.0\b", text) and re.search(rf"joined: [^)]*\b{slot}\.\d+", text),
               f"rank {slot}'s first process did not leave, or no replacement of it joined:\n{text[-3000:]}")
    # Each survivor's first failure ("after step N"): the group goes on from the most steps any
    # member completed, so the largest N must be the step of the first change.
    firsts = [FAIL_RE.search((logs / f"rank-{r}.log").read_text(errors="replace")) for r in range(tasks)]
    failures = [int(m.group(2)) for m in firsts if m]
    expect(failures and max(failures) == int(shrink[3]),
           f"steps lost: the survivors failed after steps {sorted(failures)} and went on from step "
           f"{shrink[3]}:\n{text[-3000:]}")
    final = FINAL_RE.search(text)
    expect(final and final.group(1) == str(tasks), f"no final line with {tasks} ranks:\n{text[-3000:]}")
    assert final is not None
    # Every member prints its checksum after each change: at the step the replacements joined,
    # all of them (the replacements' first) must agree.
    at_join = {m.group(5) for m in MEMBER_RE.finditer(text) if m.group(3) == str(tasks) and m.group(4) == grow[3]}
    joined = [m.group(1) for m in MEMBER_RE.finditer(text) if m.group(4) == grow[3] and not m.group(1).endswith(".0")]
    expect(len(at_join) == 1 and len(joined) == len(lost),
           f"at step {grow[3]}, where the replacements joined, the checksums are {sorted(at_join)} (members "
           f"{joined} new):\n{text[-3000:]}")
    checksum = at_join.pop()
    return {
        "left_at_step": int(shrink[3]), "membership_s": float(shrink[5]), "heal_s": float(shrink[6]),
        "joined_at_step": int(grow[3]), "join_heal_s": float(grow[6]), "accuracy": float(final.group(4)),
        "line": (f"{tasks} -> {shrink[2]} ranks at step {shrink[3]} (membership {shrink[5]} s), back to {tasks} at step "
                 f"{grow[3]} ({', '.join(joined)} joined with parameters {checksum}, equal to the others'); final "
                 f"test accuracy {final.group(4)}%"),
    }
