"""`kvcache patch-vllm`: the series applies to the pinned release, idempotently,
all-or-nothing, reversibly; another version is refused. Real GNU patch on real trees built
from the installed vLLM 0.26.0 (a site-packages layout and a git checkout layout)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from helpers.patchutil import patch_vllm_cli

from kvcache_core import patching

pytest.importorskip("vllm")


def _installed_root() -> str:
    import vllm

    return os.path.dirname(os.path.dirname(vllm.__file__))


def _touched() -> list[str]:
    out = []
    for p in patching.read_series("0.26.0"):
        with open(p) as f:
            out += [ln[6:].strip() for ln in f if ln.startswith("+++ b/")]
    return out


def _tree(tmp_path, checkout: bool = False) -> str:
    """A minimal vLLM tree with the files the series touches, in their PRISTINE state."""
    src = _installed_root()
    root = str(tmp_path / ("vllm-checkout" if checkout else "site-packages"))
    for rel in [*_touched(), "vllm/__init__.py"] + ([] if checkout else ["vllm/_version.py"]):
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        shutil.copy(os.path.join(src, rel), os.path.join(root, rel))
    # the installed vLLM may carry the series (make dev applies it): start pristine
    patching.reverse_series(root, "0.26.0")
    if checkout:
        git = ["git", "-C", root, "-c", "user.email=t@t", "-c", "user.name=t"]
        subprocess.run([*git, "init", "-q"], check=True)
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", "v0.26.0"], check=True)
        subprocess.run([*git, "tag", "v0.26.0"], check=True)
    return root


@pytest.mark.parametrize("checkout", [False, True], ids=["site-packages", "git-checkout"])
def test_apply_is_idempotent_and_reversible(tmp_path, checkout):
    root = _tree(tmp_path, checkout)
    pristine = {p: open(os.path.join(root, p)).read() for p in _touched()}
    assert patch_vllm_cli("--target", root, "--check").returncode == 1  # not applied
    r = patch_vllm_cli("--target", root)
    assert r.returncode == 0, r.stderr
    once = {p: open(os.path.join(root, p)).read() for p in _touched()}
    assert once != pristine
    assert "_offer_preload_candidates" in once["vllm/v1/core/sched/scheduler.py"]
    assert patch_vllm_cli("--target", root).returncode == 0  # again: no change
    assert {p: open(os.path.join(root, p)).read() for p in _touched()} == once
    assert patch_vllm_cli("--target", root, "--check").returncode == 0
    assert patch_vllm_cli("--target", root, "--reverse").returncode == 0
    assert {p: open(os.path.join(root, p)).read() for p in _touched()} == pristine


def _set_version(root: str, version: str) -> None:
    vf = os.path.join(root, "vllm", "_version.py")
    with open(vf) as f:
        text = f.read()
    with open(vf, "w") as f:
        f.write(text.replace("0.26.0", version))


def test_older_version_is_refused_clearly(tmp_path):
    root = _tree(tmp_path)
    _set_version(root, "0.25.2")
    r = patch_vllm_cli("--target", root)
    assert r.returncode == 2
    assert "vLLM 0.25.2" in r.stderr and "0.26.0, 0.32.0, 0.34.0 only" in r.stderr
    assert patch_vllm_cli("--target", root, "--vllm-version", "0.26.0", "--check").returncode == 1


def test_newer_version_uses_the_newest_older_series(tmp_path):
    """Issue 15: 0.27.1 has no series of its own; v0.26.0 applies exactly (the same files
    as 0.26.0 here), with a note naming the series; exact matches print no note."""
    root = _tree(tmp_path)
    r = patch_vllm_cli("--target", root, "--check")
    assert "using series" not in r.stderr and "does not run" not in r.stderr
    _set_version(root, "0.27.1")
    r = patch_vllm_cli("--target", root)
    assert r.returncode == 0, r.stderr
    assert "vLLM 0.27.1: using series v0.26.0" in r.stderr
    assert "does not run on vLLM 0.27.1" in r.stderr  # the series applies, the adapter not
    assert patch_vllm_cli("--target", root, "--check").returncode == 0
    assert patching.chosen_series(root) == ("0.27.1", "0.26.0")


def test_conflict_changes_nothing(tmp_path):
    root = _tree(tmp_path)
    mixin = os.path.join(root, "vllm/v1/worker/kv_connector_model_runner_mixin.py")
    with open(mixin) as f:
        text = f.read()
    anchor = "kv_connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)"
    assert anchor in text
    with open(mixin, "w") as f:
        f.write(text.replace(anchor, "kv_connector.bind(scheduler_output)  # upstream change"))
    before = {p: open(os.path.join(root, p)).read() for p in _touched()}
    r = patch_vllm_cli("--target", root)
    assert r.returncode == 2 and "nothing changed" in r.stderr
    assert {p: open(os.path.join(root, p)).read() for p in _touched()} == before


def test_not_a_vllm_tree(tmp_path):
    r = patch_vllm_cli("--target", str(tmp_path))
    assert r.returncode == 2 and "no vllm package here" in r.stderr
