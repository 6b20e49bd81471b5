#!/usr/bin/env python3
"""Long-document benchmark: see ``kvcache_core/bench/longdoc.py`` (``--help``)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvcache_core.bench.longdoc import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
