"""Packaging (issue 13 item 5): the wheel carries the vLLM patch series, so an installed
py-kvcache (not a source checkout) can patch and check vLLM; the declared dependencies are
pinned to what the supported vLLM releases (0.26.0, 0.32.0) run with."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCHES = os.path.join(REPO, "kvcache_core", "vllm_patches")


def _series_files() -> list[str]:
    """Every file of every series (v0.26.0, v0.32.0, ...), relative to vllm_patches/."""
    out = []
    for d in sorted(os.listdir(PATCHES)):
        if not os.path.isfile(os.path.join(PATCHES, d, "series")):
            continue
        with open(os.path.join(PATCHES, d, "series")) as f:
            names = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
        out += [f"{d}/{n}" for n in ["series", *names]]
    return out


def test_every_series_is_found():
    files = _series_files()
    assert {f.split("/")[0] for f in files} >= {"v0.26.0", "v0.32.0"}
    assert len(files) >= 8


def test_dependencies_are_pinned_and_complete():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        proj = tomllib.load(f)["project"]
    deps = {d.split("=")[0].split(">")[0].split("<")[0].strip(): d for d in proj["dependencies"]}
    # torch 2.11 (vLLM 0.26) or 2.13 (vLLM 0.32): never moves torch under either
    assert deps["torch"] == "torch>=2.11,!=2.12.*,<2.14"
    assert "<" in deps["liburing"] and "<" in deps["xxhash"]  # tested ranges, not floors
    assert "numpy" in deps  # imported by the vLLM glue and the benchmarks
    assert "cupy" not in proj.get("optional-dependencies", {})  # nothing uses it


@pytest.mark.timeout(300)
def test_wheel_ships_the_patch_series_and_patch_vllm_runs_from_it(tmp_path):
    pytest.importorskip("vllm")
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), REPO], check=True,
                   cwd=tmp_path, timeout=240)
    (whl,) = list(wheels.glob("py_kvcache-*.whl"))
    names = set(zipfile.ZipFile(whl).namelist())
    for f in _series_files():
        assert f"kvcache_core/vllm_patches/{f}" in names, f
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                    "--target", str(site), str(whl)], check=True, timeout=120)
    import vllm

    vsite = os.path.dirname(os.path.dirname(vllm.__file__))
    env = dict(os.environ, PYTHONPATH=str(site))
    code = ("import sys, kvcache_core, kvcache_core.cli as c; print(kvcache_core.__file__); "
            "sys.exit(c.main(['patch-vllm', '--check', '--target', sys.argv[1]]))")
    r = subprocess.run([sys.executable, "-c", code, vsite], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.splitlines()[0].startswith(str(site)), r.stdout  # the wheel, not the tree
    assert r.returncode == 0, r.stdout + r.stderr
