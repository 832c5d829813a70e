"""matplotlib for the report's plots: imported on first use only (the tables and JSON never need
it), on the Agg backend (files, no display); and the re-execution under /usr/bin/python3 where
the running interpreter lacks it."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from tessera_tools.paths import SYSTEM_PYTHON, TOOLS_DIR

NO_REEXEC = "TESSERA_REPORT_NO_REEXEC"
_PYPLOT: Any = None


def disable_plots() -> None:
    """--no-plots: pyplot() answers None from now on."""
    global _PYPLOT
    _PYPLOT = False


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display), or None where matplotlib is
    not installed. Imported here, on first use, so that the report and its tables never need it."""
    global _PYPLOT
    if _PYPLOT is None:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            plt.rcParams.update({"figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.35, "axes.axisbelow": True,
                                 "legend.fontsize": "small", "axes.titlesize": "medium"})
            _PYPLOT = plt
        except ImportError:
            _PYPLOT = False
    return _PYPLOT or None


PLOTS_SKIPPED = ("*Plot skipped: matplotlib is not installed for this Python (`apt-get install python3-matplotlib`; "
                 "then `tools/tessera-report --render-only --out DIR` draws it from the raw JSON).*\n")


def save(fig: Any, path: str, rect: Sequence[float] | None = None) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.tight_layout(rect=rect)
    fig.savefig(path)
    pyplot().close(fig)


def errorbar_from(center: float, low: float, high: float) -> list[float]:
    """yerr for matplotlib from a centre and a [low, high] range; the range is widened to contain the
    centre (a ratio of medians can lie just outside the range of the paired ratios)."""
    return [max(0.0, center - min(low, center)), max(0.0, max(high, center) - center)]


def maybe_reexec_for_matplotlib(argv: Sequence[str]) -> None:
    """Re-executes this script under /usr/bin/python3 when the running interpreter has no
    matplotlib and that one does (a pyenv python3 first on PATH shadows Debian's python3 and its
    python3-matplotlib). Only checks for the module (find_spec), so nothing is imported here. The
    new process imports this package from where this one did and runs tessera-report's main."""
    if os.environ.get(NO_REEXEC) or importlib.util.find_spec("matplotlib") is not None:
        return
    if not os.path.exists(SYSTEM_PYTHON) or os.path.realpath(sys.executable) == os.path.realpath(SYSTEM_PYTHON):
        return
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('matplotlib') is None)"], capture_output=True)
    if probe.returncode == 0:
        print(f"tessera-report: {sys.executable} has no matplotlib; re-running under {SYSTEM_PYTHON}", file=sys.stderr)
        os.environ[NO_REEXEC] = "1"
        os.execv(SYSTEM_PYTHON, [SYSTEM_PYTHON, "-c", REEXEC, str(TOOLS_DIR), *argv])


# What the re-executed interpreter runs: the package from TOOLS_DIR (its first argument), then
# tessera-report's main with the original arguments.
REEXEC = ("import sys; sys.path.insert(0, sys.argv.pop(1)); "
          "from tessera_tools.report import main; sys.exit(main(sys.argv[1:]))")
