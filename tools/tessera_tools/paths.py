"""Where the tools find the source tree and the system interpreter."""
from __future__ import annotations

import pathlib

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
# The directory holding tessera_tools/: tools/ in the source tree, <datadir>/tessera/python when
# installed. The source tree is its parent (bench/, build/) and only exists in a checkout.
TOOLS_DIR = PACKAGE_DIR.parent
SOURCE_ROOT = TOOLS_DIR.parent
# Debian's interpreter: python3-torch and python3-matplotlib live there, and a pyenv python3 first
# on PATH may lack both.
SYSTEM_PYTHON = "/usr/bin/python3"
