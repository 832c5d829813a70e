#!/usr/bin/env python3
"""precompile_header: precompile a header with the flags of a reference unit of the build (tessera_tools.precompile; --help)."""
import os
import sys

# The package lies beside this script (tools/), or under <prefix>/share/tessera/python when installed.
HERE = os.path.dirname(os.path.realpath(__file__))
for path in (HERE, os.path.join(HERE, os.pardir, "share", "tessera", "python")):
    if os.path.isdir(os.path.join(path, "tessera_tools")):
        sys.path.insert(0, os.path.abspath(path))
        break
from tessera_tools.precompile import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
