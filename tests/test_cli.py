"""The ``kvcache`` command as a user runs it: a real process, ordinary mistakes give one
line naming the problem (no traceback) and exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kvcache(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcache_core.cli", *args],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))


def test_version():
    from kvcache_core import __version__

    p = kvcache("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"kvcache {__version__}"


def test_missing_paths_are_one_line_errors(tmp_path):
    missing = str(tmp_path / "missing")
    for args, cmd in ((("gc", missing), "gc"),
                      (("calibrate", "--from-longdoc", missing + ".json", "--out",
                        str(tmp_path / "t.json")), "calibrate")):
        p = kvcache(*args)
        assert p.returncode == 2, (args, p.stderr)
        assert "Traceback" not in p.stderr, p.stderr
        lines = p.stderr.strip().splitlines()
        assert lines[-1].startswith(f"kvcache {cmd}: ") and missing in lines[-1], p.stderr
