#!/usr/bin/env python3
"""Rewrite the configuration table of README.md from the code (``KEY_HELP``,
``GLUE_KEY_HELP``, the defaults): the one source of every key's documentation.
``tests/test_config_table.py`` fails when README.md is not this script's output.

    python3 scripts/gen_config_table.py [--check]
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from kvcache_core.config import readme_with_table  # noqa: E402


def main(argv: list[str]) -> int:
    path = os.path.join(REPO, "README.md")
    with open(path) as f:
        text = f.read()
    new = readme_with_table(text)
    if "--check" in argv:
        if new != text:
            print("README.md's configuration table is stale: run scripts/gen_config_table.py")
            return 1
        return 0
    with open(path, "w") as f:
        f.write(new)
    print(f"rewrote the configuration table of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
