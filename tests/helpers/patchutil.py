"""Helpers of the patch-series and vLLM-API tests (pytest-dependent, unlike kvutil): the
vLLM sdists cached by `make patch-rebase`, applying a series exactly, `kvcache patch-vllm`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from .kvutil import load_script

#: scripts/patch_rebase.py (its sdist cache, extract and touched helpers)
rebase = load_script("patch_rebase")


def cached_sdist(version: str, need_patch: bool = True) -> str:
    """Path of the cached vLLM ``version`` sdist; skips the test when it is not cached (no
    network in tests) or, with ``need_patch``, when GNU patch is missing."""
    path = os.path.join(rebase.CACHE, f"vllm-{version}.tar.gz")
    if not os.path.isfile(path):
        pytest.skip(f"{path} not cached (`make patch-rebase` downloads it)")
    if need_patch and shutil.which("patch") is None:
        pytest.skip("GNU patch not installed")
    return path


def apply_exactly(root: str, patches: list[str]) -> None:
    """Apply ``patches`` in order to the tree at ``root`` with GNU patch, asserting each
    applies with no fuzz and no offset (a series made on that very tree)."""
    for p in patches:
        r = subprocess.run(["patch", "-p1", "-d", root, "-i", p, "--batch", "-F0"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        assert not re.search(r"offset|fuzz", r.stdout + r.stderr), r.stdout


def patch_vllm_cli(*args: str) -> subprocess.CompletedProcess:
    """``kvcache patch-vllm ARGS`` in a child process (stdout and stderr captured)."""
    return subprocess.run([sys.executable, "-m", "kvcache_core.cli", "patch-vllm", *args],
                          capture_output=True, text=True)
