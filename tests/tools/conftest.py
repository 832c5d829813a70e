"""pytest setup for the tools' tests: tools/ on sys.path, so that `import tessera_tools` finds the
package of this checkout; ROOT and TOOLS for the tests that run the commands."""
from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
TOOLS = ROOT / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))
sys.dont_write_bytecode = True  # no __pycache__ in the source tree from a test run
