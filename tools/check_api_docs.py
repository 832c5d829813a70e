#!/usr/bin/env python3
"""check_api_docs: check that docs/api.md documents every public type (tessera_tools.checks.api_docs; --help)."""
import os
import sys

# The package lies beside this script (tools/), or under <prefix>/share/tessera/python when installed.
HERE = os.path.dirname(os.path.realpath(__file__))
for path in (HERE, os.path.join(HERE, os.pardir, "share", "tessera", "python")):
    if os.path.isdir(os.path.join(path, "tessera_tools")):
        sys.path.insert(0, os.path.abspath(path))
        break
from tessera_tools.checks.api_docs import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
