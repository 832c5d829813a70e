"""The simulator's output: a table or JSON of the rows, measured points beside the predictions,
and a plot of efficiency against workers (matplotlib, imported only for --plot)."""
from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from tessera_tools.simulate.inputs import InputError, MeasuredPoint, load_measured


class Row(Protocol):
    workers: int
    step_s: float
    efficiency: float | None

    def to_json(self) -> dict[str, Any]: ...


# (title, width, cell of a row or None for an empty cell)
Column = tuple[str, int, Callable[[Any], "str | None"]]
# (label, workers, efficiencies) of one line of the plot
Series = tuple[str, list[int], list[float]]


@dataclass
class OutputOptions:
    json: bool = False
    plot: str | None = None
    measured: str | None = None


def print_table(columns: Sequence[Column], rows: Sequence[object]) -> None:
    head = " ".join(f"{c:>{w}}" for c, w, _ in columns)
    print(head)
    print("-" * len(head))
    for r in rows:
        print(" ".join(f"{fmt(r) if fmt(r) is not None else '':>{w}}" for _, w, fmt in columns))


def ms(key: str) -> Callable[[Any], str | None]:
    """A column of milliseconds from a field in seconds."""
    def cell(r: Any) -> str | None:
        value = getattr(r, key, None)
        return f"{value * 1e3:.3f}" if value is not None else None
    return cell


def plot(path: str, series: Sequence[Series], measured: Sequence[MeasuredPoint], title: str, xlabel: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError(f"--plot needs matplotlib, which {sys.executable} cannot import (Debian's "
                         f"python3-matplotlib serves /usr/bin/python3: run /usr/bin/python3 tools/tessera-simulate ...)"
                         ) from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, xs, ys in series:
        ax.plot(xs, [100 * y for y in ys], marker=".", label=f"predicted, {label}")
    markers = "osD^v<>"
    for i, label in enumerate(sorted({q.label for q in measured})):
        pts = sorted((q.workers, q.efficiency or 0.0) for q in measured if q.label == label)
        ax.plot([x for x, _ in pts], [100 * y for _, y in pts], linestyle="none", marker=markers[i % len(markers)],
                markersize=8, label=f"measured, {label}")
    ax.set_xscale("log", base=2)
    ticks = sorted({x for _, xs, _ in series for x in xs} | {q.workers for q in measured})
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("scaling efficiency (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def emit(options: OutputOptions, header: Mapping[str, str], columns: Sequence[Column], rows: Sequence[Row],
         series: Sequence[Series], xlabel: str, algorithms: Sequence[str | None] | None = None) -> None:
    """Prints the rows as a table (or JSON) with the header's facts, measured points against the
    predictions of the first algorithm, and draws the plot when asked. `algorithms`: each row's
    algorithm (data parallelism), else None."""
    measured = load_measured(options.measured) if options.measured else []
    if options.json:
        print(json.dumps({**header, "rows": [r.to_json() for r in rows], "measured": [asdict(q) for q in measured]},
                         indent=1))
    else:
        for k, v in header.items():
            if k != "title":  # the plot's; the table has the same facts on the other lines
                print(f"{k}: {v}")
        print()
        print_table(columns, rows)
        if measured:
            print("\nmeasured vs predicted (first algorithm):")
            algs = list(algorithms) if algorithms is not None else [None] * len(rows)
            by_p = {r.workers: r for r, a in zip(rows, algs) if a == algs[0]}
            for q in measured:
                r = by_p.get(q.workers)
                if r is None:
                    print(f"  {q.label:>12} P={q.workers}: not in --workers")
                    continue
                step = (f"step {q.step_s * 1e3:.3f} ms measured, {r.step_s * 1e3:.3f} predicted "
                        f"({r.step_s / q.step_s - 1:+.1%}); ") if q.step_s else ""
                print(f"  {q.label:>12} P={q.workers}: {step}efficiency {q.efficiency or 0.0:.1%} measured, "
                      f"{r.efficiency or 0.0:.1%} predicted")
    if options.plot:
        plot(options.plot, series, measured, header.get("title", ""), xlabel)
