"""The ``kvcache`` command as a user runs it: a real process, ordinary mistakes give one
line naming the problem (no traceback) and exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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


def test_bench_storage_refuses_a_missing_parent_and_cleans_up_when_interrupted(tmp_path):
    import signal
    import time

    p = kvcache("bench", "storage", "--quick", "--no-metadata", "--create", "--root",
                str(tmp_path / "no" / "such"))
    assert p.returncode == 2 and "parent directory does not exist" in p.stderr
    assert not (tmp_path / "no").exists()  # nothing created
    root = tmp_path / "bench"
    # SIGINT back to its default in the child: a CI job started in the background by a
    # non-interactive shell inherits SIGINT ignored, and Python then never sees a Ctrl-C
    proc = subprocess.Popen([sys.executable, "-m", "kvcache_core.cli", "bench", "storage",
                             "--quick", "--no-metadata", "--create", "--root", str(root)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=REPO),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    def writing() -> bool:  # the benchmark has files in its scratch directory
        try:
            return any(any(True for _ in os.scandir(d.path))
                       for d in os.scandir(root) if d.is_dir())
        except FileNotFoundError:
            return False

    end = time.monotonic() + 180  # a loaded CI machine starts Python slowly
    while not writing() and time.monotonic() < end and proc.poll() is None:
        time.sleep(0.02)
    if not writing():
        proc.kill()
        _, err = proc.communicate(timeout=60)
        pytest.fail(f"the benchmark never wrote into its scratch directory (exit "
                    f"{proc.returncode}): {err[-2000:]}")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err.splitlines()[-1]
    assert not root.exists()  # scratch and the root it created are gone
