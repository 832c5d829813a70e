"""tessera-report plot-metrics: an example's metrics JSON lines (05_large_batch --out, the
Trainer's metrics_path / the examples' --metrics, 09 --out, 10 --out) drawn with labelled axes, a
legend and a title."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tessera_tools.report.formatting import JsonDict, read_jsonl
from tessera_tools.report.plotting import pyplot, save


@dataclass
class MetricsPlan:
    """What to draw: the x column, the y columns of each panel, the column naming each line."""
    x: str
    panels: list[list[str]]
    series: str | None


X_CANDIDATES = ("epoch", "step", "global_step", "generation", "trial", "seconds")
SERIES_CANDIDATES = ("run", "mode", "name", "optimizer", "framework", "comm")
UNITS = {"seconds": "wall time (s)", "epoch": "epoch", "step": "step", "global_step": "step",
         "images_per_second": "throughput (images/s)", "lr": "learning rate", "generation": "generation",
         "train_loss": "training loss", "test_loss": "test loss", "straggler_ms": "straggler delay (ms)"}


def name_of(key: str) -> str:
    """A column's name in words, for titles and legends: 'test_accuracy' -> 'test accuracy'."""
    return {"train_loss": "training loss", "seconds": "wall time", "images_per_second": "throughput"}.get(
        key, key.replace("_", " "))


def label_of(key: str) -> str:
    """A column's axis label with its unit: 'test_accuracy' -> 'test accuracy (%)'."""
    if key in UNITS:
        return UNITS[key]
    return name_of(key) + (" (%)" if "accuracy" in key else "")


def is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def metrics_plan(rows: Sequence[JsonDict], x: str | None = None, y: Sequence[str] | None = None,
                 series: str | None = None) -> MetricsPlan:
    """What to draw from metrics rows: the x key, [[y keys of panel 1], ...], the series key or None.
    Defaults: x the first of X_CANDIDATES present; y every accuracy and loss column, accuracies in
    one panel and losses in another (else 'score', else every varying numeric column); series the
    first string column of SERIES_CANDIDATES (else any string column) taking two or more values."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    numeric = [k for k in keys if all(is_number(r.get(k)) for r in rows if k in r) and any(k in r for r in rows)]
    if x is None:
        x = next((k for k in X_CANDIDATES if k in numeric), None)
        if x is None:
            raise ValueError(f"no x column among {', '.join(X_CANDIDATES)}; name one with --x (columns: {', '.join(keys)})")
    elif x not in numeric:
        raise ValueError(f"--x {x}: not a numeric column (numeric: {', '.join(numeric)})")
    if y:
        for k in y:
            if k not in numeric:
                raise ValueError(f"--y {k}: not a numeric column (numeric: {', '.join(numeric)})")
        panels = [list(y)]
    else:
        acc = [k for k in numeric if "accuracy" in k and k != x]
        loss = [k for k in numeric if "loss" in k and k != x]
        panels = [p for p in (acc, loss) if p]
        if not panels:
            if "score" in numeric:
                panels = [["score"]]
            else:
                varying = [k for k in numeric if k != x and len({r.get(k) for r in rows}) > 1]
                panels = [[k] for k in varying[:3]]
        if not panels:
            raise ValueError("no numeric column to plot against " + x)
    if series is not None and series != "none" and series not in keys:
        raise ValueError(f"--series {series}: no such column (columns: {', '.join(keys)})")
    if series is None:
        strings = [k for k in keys if all(isinstance(r.get(k), str) for r in rows if k in r)
                   and len({r.get(k) for r in rows}) > 1]
        series = next((k for k in SERIES_CANDIDATES if k in strings), strings[0] if strings else None)
    return MetricsPlan(x, panels, series)


def metrics_series(rows: Sequence[JsonDict], x: str, y: str,
                   series: str | None) -> dict[str, list[tuple[Any, float, float, float, int]]]:
    """{series name: [(x, median y, min y, max y, count)]} sorted by x: several rows at one x (a
    generation's trials, repeated runs) become their median and range."""
    out: dict[str, dict[Any, list[float]]] = {}
    for r in rows:
        if x not in r or y not in r or not is_number(r[y]):
            continue
        name = str(r.get(series, "")) if series else ""
        out.setdefault(name, {}).setdefault(r[x], []).append(r[y])
    return {name: [(xv, statistics.median(v), min(v), max(v), len(v)) for xv, v in sorted(pts.items())]
            for name, pts in out.items()}


def plot_metrics(paths: Sequence[str], out: str, x: str | None = None, y: Sequence[str] | None = None,
                 series: str | None = None, title: str | None = None) -> str:
    plt = pyplot()
    if not plt:
        raise SystemExit("tessera-report plot-metrics: matplotlib is not installed for this Python "
                         "(`apt-get install python3-matplotlib`)")
    from matplotlib.ticker import MaxNLocator, PercentFormatter
    data = {p: read_jsonl(p) for p in paths}
    rows_all = [r for rows in data.values() for r in rows]
    if not rows_all:
        raise SystemExit(f"tessera-report plot-metrics: no rows in {', '.join(paths)}")
    plan = metrics_plan(rows_all, x, y, series)
    x, panels, series = plan.x, plan.panels, plan.series
    if series == "none":  # --series none: one line per column, rows not grouped
        series = None
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels) if len(panels) > 1 else 8, 4.8), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for ax, keys in zip(axes[0], panels):
        aggregated = False
        colour_index = 0
        for pi, (path, rows) in enumerate(data.items()):
            prefix = os.path.splitext(os.path.basename(path))[0] + ": " if len(data) > 1 else ""
            for ki, key in enumerate(keys):
                for name, pts in metrics_series(rows, x, key, series).items():
                    xs = [p[0] for p in pts]
                    ys = [p[1] for p in pts]
                    # 'run' and 'name' values describe themselves; others read better as 'mode: sync'.
                    shown = name if series in ("run", "name") or not name else f"{series}: {name}"
                    label = prefix + (shown or os.path.splitext(os.path.basename(path))[0])
                    if len(keys) > 1:
                        label = f"{label}, {name_of(key)}" if name else prefix + name_of(key)
                    colour = f"C{colour_index % 10}"
                    colour_index += 1
                    scale = 100.0 if "accuracy" in key and all(0 <= v <= 1 for v in ys) else 1.0
                    ax.plot(xs, [v * scale for v in ys], linestyle=styles[(ki + pi) % len(styles)], color=colour,
                            marker="o" if len(xs) <= 40 else None, markersize=3,
                            label=label + (" (median)" if any(p[4] > 1 for p in pts) else ""))
                    if any(p[4] > 1 for p in pts):
                        aggregated = True
                        ax.fill_between(xs, [p[2] * scale for p in pts], [p[3] * scale for p in pts], color=colour,
                                        alpha=0.18, label=f"{label}: min–max of rows at one {name_of(x)}")
        ax.set_xlabel(label_of(x))
        if len(keys) == 1:
            ax.set_ylabel(label_of(keys[0]))
        elif all("accuracy" in k for k in keys):
            ax.set_ylabel("accuracy (%)")
        elif all("loss" in k for k in keys):
            ax.set_ylabel("loss (cross-entropy)")
        else:
            ax.set_ylabel(", ".join(label_of(k) for k in keys))
        if all("accuracy" in k for k in keys):
            ax.yaxis.set_major_formatter(PercentFormatter(100, decimals=0))
        if all(float(r.get(x, 0)).is_integer() for r in rows_all if x in r):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{', '.join(name_of(k) for k in keys)} per {name_of(x)}"
                     + (" (line: median; band: range)" if aggregated else ""))
        ax.legend(fontsize="small")
    fig.suptitle(title or ", ".join(os.path.basename(p) for p in paths))
    save(fig, out)
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("jsonl", nargs="+", help="metrics JSON lines file(s); several are drawn together")
    ap.add_argument("--out", help="PNG to write (default: the first file with .png)")
    ap.add_argument("--x", help=f"x column (default: the first of {', '.join(X_CANDIDATES)} present)")
    ap.add_argument("--y", help="y column(s), comma-separated, in one panel (default: accuracies, then losses in "
                                "a second panel)")
    ap.add_argument("--series", help="column naming each line (default: the first of "
                                     f"{', '.join(SERIES_CANDIDATES)} with several values; 'none': one line)")
    ap.add_argument("--title")


DESCRIPTION = ("Plot an example's metrics JSON lines (05_large_batch --out, the Trainer's metrics_path / the "
               "examples' --metrics, 09 --out, 10 --out) with labelled axes, a legend and a title.")


def run(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    for p in args.jsonl:
        if not os.path.exists(p):
            ap.error(f"{p}: no such file")
    out = args.out or os.path.splitext(args.jsonl[0])[0] + ".png"
    try:
        plot_metrics(args.jsonl, out, args.x, args.y.split(",") if args.y else None, args.series, args.title)
    except ValueError as e:
        sys.exit(f"tessera-report plot-metrics: {e}")
    print(f"wrote {out}")
    return 0
