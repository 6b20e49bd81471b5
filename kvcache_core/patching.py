"""Apply, check and reverse py-kvcache's patch series on a vLLM tree.

A target is a vLLM checkout (its root holds ``vllm/``), an installed package's
site-packages directory, or the ``vllm`` package directory itself. The series for vLLM
``X`` lives in ``kvcache_core/vllm_patches/vX/series`` (one patch file name per line,
``#`` comments).
Patches are unified diffs with ``a/``/``b/`` prefixes applied with GNU ``patch -p1 -F0``
(no fuzz: a context line that changed is a conflict, never a silent guess).

Series selection (:func:`select_series`): the series whose version equals the target
vLLM version, else the highest series below it ("floor"): vLLM 0.27.1 gets the v0.26.0
series, 0.32.0 and 0.33.0 get v0.32.0. A release between two series gets the older one
and is only ever patched if every patch applies exactly (``-F0``); docs/patch-compat.md
(``make patch-rebase``) records which releases each series really applies to. A version
below the oldest series is refused with a message naming the shipped series.

Contract: :func:`apply_series` is idempotent (already applied patches are skipped) and
all-or-nothing (every patch is dry-run first; on any conflict nothing is changed); a
vLLM version older than every series is refused with a clear message.
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


#: release lines (major.minor) whose vLLM py-kvcache's connector RUNS on, oldest first: the
#: lines :mod:`kvcache_core.vllm.compat` has adapters for (it imports this tuple). A patch
#: series that applies to a release is not runtime support: vLLM 0.27.x, 0.28.x and 0.33.x
#: take an older line's series, and the v0.34.0 series exists before the 0.34 adapter does
#: (docs/vllm-0.34-api.md); :func:`runtime_note` says so to whoever patches such a release.
RUNTIME_LINES: tuple[str, ...] = ("0.26", "0.32")


class PatchError(RuntimeError):
    """The target cannot be patched (wrong version, conflict, missing tool)."""


@dataclass
class PatchState:
    name: str
    state: str  # "applied", "not-applied", "conflict"
    detail: str = ""


def series_dir(version: str) -> str:
    """Directory of the series for vLLM ``version`` (``vllm_patches/v<version>``)."""
    return os.path.join(PATCH_ROOT, f"v{version}")


def version_key(version: str) -> tuple[tuple[int, ...], int, str]:
    """Sort key of a vLLM version string (PEP 440 subset, no dependency on ``packaging``).

    ``0.27.1`` -> ``((0, 27, 1), 1, "")``. Trailing zero components are dropped
    (``0.26`` == ``0.26.0``); a local part (``+cpu``, ``+cu128``) is ignored; a pre-release
    or dev build (``0.32.0rc1``, ``0.32.0.dev3``) sorts before its final release, a
    ``.postN`` after it. Raises :class:`PatchError` for a string that does not start with
    a number.
    """
    v = version.strip().lower().lstrip("v").split("+", 1)[0]
    m = re.match(r"(\d+(?:\.\d+)*)(.*)$", v)
    if not m:
        raise PatchError(f"{version!r} is not a vLLM version")
    rel = [int(x) for x in m.group(1).split(".")]
    while len(rel) > 1 and rel[-1] == 0:
        rel.pop()
    rest = m.group(2).lstrip(".-_")
    phase = 0 if re.match(r"(a|b|c|rc|alpha|beta|pre|preview|dev)", rest) else 1
    return tuple(rel), phase, rest


def supported_versions() -> list[str]:
    """Versions that have a series directory, oldest first."""
    if not os.path.isdir(PATCH_ROOT):
        return []
    return sorted((d[1:] for d in os.listdir(PATCH_ROOT)
                   if d.startswith("v") and os.path.isfile(os.path.join(PATCH_ROOT, d, "series"))),
                  key=version_key)


def release_line(version: str) -> str:
    """``"0.34"`` for ``0.34.0``, ``v0.34.1+cu128``, ``0.34.0rc1`` (major.minor, local part
    ignored). Raises :class:`PatchError` for a string that is not a version."""
    rel = version_key(version)[0]
    return f"{rel[0]}.{rel[1] if len(rel) > 1 else 0}"


def runtime_note(version: str) -> str | None:
    """None when py-kvcache's connector runs on vLLM ``version`` (:data:`RUNTIME_LINES`),
    else one sentence for the operator who patches it: the patches may apply, but a server
    configured with ``kvcache_core.vllm`` refuses to start on that release."""
    line = release_line(version)
    if line in RUNTIME_LINES:
        return None
    runs = " and ".join(f"{x}.x" for x in RUNTIME_LINES)
    return (f"py-kvcache's connector does not run on vLLM {version} (it runs on {runs}): a "
            "server whose --kv-transfer-config names kvcache_core.vllm refuses to start "
            "there with a message saying so; the patches only add the preload hooks "
            "(inert without py-kvcache). See docs/patch-compat.md.")


def select_series(version: str, available: list[str] | None = None) -> str:
    """The series version to use for vLLM ``version``.

    The exact match if there is one, else the highest series older than ``version``.
    ``available`` defaults to :func:`supported_versions`. Raises :class:`PatchError`
    naming the shipped series when ``version`` is older than all of them.
    """
    series = supported_versions() if available is None else list(available)
    key = version_key(version)
    below = [s for s in series if version_key(s) <= key]
    if not below:
        raise PatchError(
            f"vLLM {version} is not supported: py-kvcache ships patch series for "
            f"{', '.join(series) or 'no version'} only (a series covers its own release "
            "and newer ones). See docs/patch-compat.md.")
    return max(below, key=version_key)


def read_series(version: str) -> list[str]:
    """Absolute paths of the patches of series ``version``, in application order."""
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
    """Series version for the tree at ``root`` (see :func:`select_series`)."""
    v = version or detect_version(root)
    try:
        return select_series(v)
    except PatchError:
        raise PatchError(
            f"vLLM {v} at {root} is not supported: py-kvcache ships patches for "
            f"{', '.join(supported_versions()) or 'no version'} only (a series covers its "
            "own release and newer ones). See docs/patch-compat.md (`make patch-rebase`) "
            "for how each series fares on newer releases.") from None


def chosen_series(target: str, version: str | None = None) -> tuple[str, str]:
    """``(vllm_version, series_version)`` that patching ``target`` would use.

    ``version`` overrides the detected vLLM version. Raises :class:`PatchError` like
    :func:`apply_series` (no vLLM tree, unknown version, version older than every series).
    """
    root = resolve_target(target)
    v = version or detect_version(root)
    return v, _check_version(root, v)


def check_series(target: str, version: str | None = None) -> list[PatchState]:
    """State of every patch of the selected series on ``target``; changes nothing."""
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
        tv = version or detect_version(root)
        where = "" if version_key(tv) == version_key(v) else (
            f"series v{v} (the newest one not newer than vLLM {tv}; see "
            "docs/patch-compat.md): ")
        raise PatchError(where + "patch does not apply cleanly, nothing changed: " + "; ".join(
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
