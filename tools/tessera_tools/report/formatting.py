"""Numbers, tables and JSON lines for the report: readable figures, GitHub-flavoured markdown
tables, and the JSON rows programs print."""
from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

JsonDict = dict[str, Any]


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return ""
    if s < 59.95:
        return f"{s:.1f} s"
    whole = round(s)
    return f"{whole // 60} min {whole % 60:02d} s"


def fmt_num(x: float | None) -> str:
    """A readable number: thousands separated above 1000, about three significant figures below."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    a = abs(x)
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def repeats_phrase(n: int, unit: str = "repeat") -> str:
    """How the figures of n repeats are summarised, for the sections' introductions."""
    if n <= 1:
        return f"1 {unit}, so no whiskers."
    return f"{n} {unit}s: medians, whiskers the range."


def geomean(values: Sequence[float]) -> float:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (q in [0, 1]) of a non-empty list."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def md_escape(cell: object) -> str:
    return str(cell).replace("|", "\\|").replace("\n", " ")


def md_table(headers: Sequence[object], rows: Sequence[Sequence[object]],
             align: Sequence[str] | None = None) -> str:
    """A GitHub-flavoured markdown table. align: one of 'l', 'r', 'c' per column (default: left for
    the first column, right for the others, as numbers are). Cells are str()-ed, '|' escaped."""
    align = align or ["l"] + ["r"] * (len(headers) - 1)
    marks = {"l": "---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(md_escape(h) for h in headers) + " |",
             "|" + "|".join(marks[a] for a in align) + "|"]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"md_table: row {row!r} has {len(row)} cells for {len(headers)} columns")
        lines.append("| " + " | ".join(md_escape(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def read_jsonl(path: str) -> list[JsonDict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
    return rows


def json_lines(text: str) -> list[JsonDict]:
    """The JSON objects among a program's output lines ('[rank R] ' prefixes removed)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[rank"):
            line = line.split("] ", 1)[-1]
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
