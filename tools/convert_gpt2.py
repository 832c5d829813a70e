#!/usr/bin/env python3
"""convert_gpt2: a Hugging Face GPT-2 checkpoint to Tessera's GPT state dict (tessera_tools.convert_gpt2; --help)."""
import os
import sys

# The package lies beside this script (tools/), or under <prefix>/share/tessera/python when installed.
HERE = os.path.dirname(os.path.realpath(__file__))
for path in (HERE, os.path.join(HERE, os.pardir, "share", "tessera", "python")):
    if os.path.isdir(os.path.join(path, "tessera_tools")):
        sys.path.insert(0, os.path.abspath(path))
        break
from tessera_tools.convert_gpt2 import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
