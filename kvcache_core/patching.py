"""Apply, check and reverse py-kvcache's patch series on a vLLM tree.

A target is a vLLM checkout (its root holds ``vllm/``), an installed package's
site-packages directory, or the ``vllm`` package directory itself. The series for vLLM
``X`` lives in ``kvcache_core/vllm_patches/vX/series`` (one patch file name per line,
``#`` comments).
Patches are unified diffs with ``a/``/``b/`` prefixes applied with GNU ``patch -p1 -F0``
(no fuzz: a context line that changed is a conflict, never a silent guess).

Contract: :func:`apply_series` is idempotent (already applied patches are skipped) and
all-or-nothing (every patch is dry-run first; on any conflict nothing is changed); a
vLLM version without a series is refused with a clear message.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

#: the series ship as package data (kvcache_core/vllm_patches/v<X>/), so an installed wheel
#: patches vLLM as a source checkout does
PATCH_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_patches")


class PatchError(RuntimeError):
    """The target cannot be patched (wrong version, conflict, missing tool)."""


@dataclass
class PatchState:
    name: str
    state: str  # "applied", "not-applied", "conflict"
    detail: str = ""


def series_dir(version: str) -> str:
    return os.path.join(PATCH_ROOT, f"v{version}")


def supported_versions() -> list[str]:
    if not os.path.isdir(PATCH_ROOT):
        return []
    return sorted(d[1:] for d in os.listdir(PATCH_ROOT)
                  if d.startswith("v") and os.path.isfile(os.path.join(PATCH_ROOT, d, "series")))


def read_series(version: str) -> list[str]:
    path = os.path.join(series_dir(version), "series")
    with open(path) as f:
        names = [ln.split("#", 1)[0].strip() for ln in f]
    return [os.path.join(series_dir(version), n) for n in names if n]


def resolve_target(target: str) -> str:
    """Directory that contains the ``vllm`` package directory."""
    t = os.path.abspath(target)
    if os.path.basename(t) == "vllm" and os.path.isfile(os.path.join(t, "__init__.py")):
        return os.path.dirname(t)
    if os.path.isfile(os.path.join(t, "vllm", "__init__.py")):
        return t
    raise PatchError(f"{target}: no vllm package here (expected {t}/vllm/__init__.py); pass a "
                     "vLLM checkout, a site-packages directory or the vllm package directory")


def detect_version(root: str) -> str:
    """vLLM version of the tree at ``root`` (installed ``_version.py`` or git tag)."""
    vf = os.path.join(root, "vllm", "_version.py")
    if os.path.isfile(vf):
        with open(vf) as f:
            m = re.search(r"^__version__\s*=\s*version\s*=\s*['\"]([^'\"]+)", f.read(), re.M)
        if m:
            return m.group(1)
    if os.path.isdir(os.path.join(root, ".git")):
        r = subprocess.run(["git", "-C", root, "describe", "--tags", "--exact-match"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            return r.stdout.strip().lstrip("v")
    raise PatchError(f"{root}: cannot tell the vLLM version (no vllm/_version.py, no release "
                     "tag); pass --vllm-version")


def _patch(root: str, patch: str, *args: str) -> subprocess.CompletedProcess:
    if shutil.which("patch") is None:
        raise PatchError("GNU patch is required (apt-get install patch)")
    return subprocess.run(["patch", "-p1", "-d", root, "-i", patch, "--batch", "-s", "-F0",
                           "--no-backup-if-mismatch", "-r", "-", *args],
                          capture_output=True, text=True)


def patch_state(root: str, patch: str) -> PatchState:
    name = os.path.basename(patch)
    if _patch(root, patch, "--dry-run", "-R", "-f").returncode == 0:
        return PatchState(name, "applied")
    fwd = _patch(root, patch, "--dry-run", "-N", "-f")
    if fwd.returncode == 0:
        return PatchState(name, "not-applied")
    return PatchState(name, "conflict", (fwd.stdout + fwd.stderr).strip())


def _check_version(root: str, version: str | None) -> str:
    v = version or detect_version(root)
    if v not in supported_versions():
        raise PatchError(
            f"vLLM {v} at {root} is not supported: py-kvcache ships patches for "
            f"{', '.join(supported_versions()) or 'no version'} only. See docs/patch-compat.md "
            "(`make patch-rebase`) for how the series fares on newer releases.")
    return v


def check_series(target: str, version: str | None = None) -> list[PatchState]:
    root = resolve_target(target)
    v = _check_version(root, version)
    return [patch_state(root, p) for p in read_series(v)]


def apply_series(target: str, version: str | None = None) -> list[PatchState]:
    """Apply every patch not yet applied; all-or-nothing. Returns the final states."""
    root = resolve_target(target)
    v = _check_version(root, version)
    patches = read_series(v)
    states = [patch_state(root, p) for p in patches]
    bad = [s for s in states if s.state == "conflict"]
    if bad:
        raise PatchError("patch does not apply cleanly, nothing changed: " + "; ".join(
            f"{s.name}: {s.detail}" for s in bad))
    for p, s in zip(patches, states, strict=False):
        if s.state == "not-applied":
            r = _patch(root, p, "-N")
            if r.returncode != 0:  # pragma: no cover - dry run passed
                raise PatchError(f"{s.name}: {r.stdout}{r.stderr}")
    return [patch_state(root, p) for p in patches]


def reverse_series(target: str, version: str | None = None) -> list[PatchState]:
    """Reverse every applied patch (in reverse order); idempotent."""
    root = resolve_target(target)
    v = _check_version(root, version)
    patches = read_series(v)
    for p in reversed(patches):
        if patch_state(root, p).state == "applied":
            r = _patch(root, p, "-R")
            if r.returncode != 0:
                raise PatchError(f"{os.path.basename(p)}: {r.stdout}{r.stderr}")
    return [patch_state(root, p) for p in patches]


def is_patched() -> bool:
    """Whether the importable vLLM carries the preload patches (checked by attribute)."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except Exception:
        return False
    return hasattr(Scheduler, "_offer_preload_candidates")
