"""Fast unit tests of the vLLM glue (:mod:`kvcache_core.vllm`), one file per module, no
engine. Marked ``vllm`` (they need the installed vLLM) like ``tests/e2e``.

No ``__init__.py`` here, as in ``tests/`` itself: a package named ``vllm`` under
``tests/`` (which is on ``sys.path``) would shadow the real vLLM. So the test files are
imported by basename and must not share one with a file directly in ``tests/``.
"""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(items):
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here + os.sep):
            item.add_marker(pytest.mark.vllm)
