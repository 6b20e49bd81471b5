#!/usr/bin/env python3
"""`make patch-rebase`: does each shipped patch series apply to newer vLLM releases?

For EVERY series under kvcache_core/vllm_patches/v<X>/ and every vLLM release on PyPI
that is not older than X, takes the release's sdist (from the cache directory, else
downloaded into it), extracts only the files the series touch, applies the series in order
with GNU patch and classifies each patch: ``clean`` (applies exactly or at an offset),
``fuzz`` (applies only with fuzz: review), ``conflict`` (a hunk fails or the file is gone).
It also records which series ``kvcache patch-vllm`` picks for each release (the newest
series not newer than the release, kvcache_core.patching.select_series).

Writes docs/patch-compat.md and docs/patch-compat.json, but ONLY when a result (a state,
a release, a series) differs from the existing report; a run that would change nothing but
the timestamp leaves both files alone. Releases that cannot be listed or downloaded are
skipped with a message and keep their previous results, so an offline run never rewrites
the report and never fails (exit 0).

``--fail-on-regression`` (the weekly CI job): exit 1 when
  * a series does not apply cleanly to its own release (v0.32.0 on 0.32.0), or
  * the series that ``kvcache patch-vllm`` picks for a release does not apply cleanly to it
    and the existing report did not already record that (a newly published release the
    shipped series do not cover, or a result that turned bad).
Recording a known failure in the committed report (run this script, commit the docs)
acknowledges it; adding a series for the release fixes it. Exit 0 otherwise, including
when nothing could be checked for lack of network.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_patching():
    """kvcache_core/patching.py by path: it needs only the standard library, the package's
    __init__ does not (CI runs this script without installing anything)."""
    spec = importlib.util.spec_from_file_location(
        "_kvcache_patching", os.path.join(REPO, "kvcache_core", "patching.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


_patching = _load_patching()
PatchError = _patching.PatchError
read_series = _patching.read_series
select_series = _patching.select_series
supported_versions = _patching.supported_versions
version_key = _patching.version_key

PYPI = os.environ.get("PYPI_JSON", "https://pypi.org/pypi/vllm/json")
#: sdists are kept here between runs (`--cache-dir`, env VLLM_SDIST_CACHE)
CACHE = os.environ.get("VLLM_SDIST_CACHE",
                       os.path.join(tempfile.gettempdir(), "py-kvcache-vllm-sdists"))
OUT = os.path.join(REPO, "docs", "patch-compat.md")
GOOD = "clean"


def log(msg: str) -> None:
    print(f"[patch-rebase] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ inputs
def list_releases(url: str = PYPI) -> tuple[list[str], dict[str, str]]:
    """Final vLLM releases on PyPI that have an sdist, oldest first, and their sdist URLs.

    Raises on any network / JSON problem (the caller reports and goes on offline)."""
    with urllib.request.urlopen(url, timeout=60) as r:
        data = json.load(r)
    urls = {}
    for v, files in data["releases"].items():
        if not re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", v):
            continue
        for f in files:
            if f.get("packagetype") == "sdist" and not f.get("yanked"):
                urls[v] = urllib.parse.urljoin(url, f["url"])
    return sorted(urls, key=version_key), urls


def cached_releases(cache: str) -> list[str]:
    """Versions whose sdist is in ``cache`` (``vllm-<version>.tar.gz``)."""
    if not os.path.isdir(cache):
        return []
    out = [m.group(1) for n in os.listdir(cache)
           if (m := re.fullmatch(r"vllm-(\d+\.\d+\.\d+(?:\.post\d+)?)\.tar\.gz", n))]
    return sorted(out, key=version_key)


def sdist(version: str, urls: dict[str, str], cache: str) -> str:
    """Path of the cached sdist of ``version``, downloading it first if needed."""
    path = os.path.join(cache, f"vllm-{version}.tar.gz")
    if os.path.isfile(path):
        return path
    if version not in urls:
        raise FileNotFoundError(f"vllm-{version}.tar.gz not cached and no URL (offline?)")
    os.makedirs(cache, exist_ok=True)
    tmp = f"{path}.part{os.getpid()}"
    with urllib.request.urlopen(urls[version], timeout=300) as r, open(tmp, "wb") as f:
        shutil.copyfileobj(r, f)
    os.replace(tmp, path)
    return path


def touched(patch: str) -> list[str]:
    """Files (``vllm/...``) a unified diff changes."""
    with open(patch) as f:
        return [ln[6:].strip() for ln in f if ln.startswith("+++ b/")]


def extract(tarball: str, wanted: set[str], dest: str) -> set[str]:
    """Extract the members ``<top>/<path>`` with ``path`` in ``wanted``; returns the found."""
    found = set()
    with tarfile.open(tarball, mode="r:gz") as tf:
        for m in tf:
            parts = m.name.split("/", 1)
            if len(parts) == 2 and parts[1] in wanted and m.isfile():
                target = os.path.join(dest, parts[1])
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(tf.extractfile(m).read())
                found.add(parts[1])
    return found


def classify(root: str, patch: str) -> tuple[str, str]:
    """Apply ``patch`` to ``root`` (for real: later patches of the series build on it)."""
    r = subprocess.run(["patch", "-p1", "-d", root, "-i", patch, "--batch", "-N",
                        "--no-backup-if-mismatch", "-r", "-"], capture_output=True, text=True)
    text = (r.stdout + r.stderr).strip()
    if r.returncode != 0:
        return "conflict", text
    if "fuzz" in text:
        return "fuzz", text
    return GOOD, text


def try_series(base: str, found: set[str], patches: list[str], work: str) -> dict:
    """Results of applying ``patches`` in order to a copy of the files under ``base``."""
    shutil.copytree(base, work)
    out = {}
    for p in patches:
        name = os.path.basename(p)
        gone = [f for f in touched(p) if f not in found]
        if gone:
            out[name] = {"state": "conflict", "detail": f"file missing: {', '.join(gone)}"}
            continue
        state, detail = classify(work, p)
        out[name] = {"state": state, "detail": detail[-400:]}
    return out


# ------------------------------------------------------------------ report model
def load_report(path_json: str) -> dict:
    """The existing report (current or the old single-series schema), or an empty one."""
    try:
        with open(path_json) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return {"series": {}}
    if "pinned" in old:  # before issue 15: one series, "releases" list
        old = {"generated": old.get("generated"), "series": {old["pinned"]: {
            "patches": old.get("patches", []),
            "releases": {r["version"]: r["patches"] for r in old.get("releases", [])
                         if "error" not in r}}}}
    old.setdefault("series", {})
    return old


def results(report: dict) -> dict:
    """What decides whether the report changed: every state, nothing else.

    ``{series: {"patches": [...], "releases": {release: {patch: state}}}}``; the
    timestamp, patch output details and error notes are left out."""
    return {s: {"patches": list(d.get("patches", [])),
                "releases": {v: {p: r.get("state") for p, r in pr.items()}
                             for v, pr in d.get("releases", {}).items()}}
            for s, d in report.get("series", {}).items()}


def selection(report: dict, available: list[str]) -> dict[str, dict]:
    """For each release in the report: the series patch-vllm picks and whether it applies."""
    out = {}
    releases = {v for d in report["series"].values() for v in d.get("releases", {})}
    for v in sorted(releases, key=version_key):
        try:
            s = select_series(v, available)
        except PatchError:
            continue
        states = report["series"].get(s, {}).get("releases", {}).get(v)
        ok = None if states is None else all(r.get("state") == GOOD for r in states.values())
        out[v] = {"series": s, "applies": ok}
    return out


def regressions(new: dict, old: dict, available: list[str]) -> list[str]:
    """Failures ``--fail-on-regression`` exits 1 for (see the module docstring)."""
    out = []
    for s in available:
        states = new["series"].get(s, {}).get("releases", {}).get(s)
        if states is not None and any(r.get("state") != GOOD for r in states.values()):
            out.append(f"series v{s} does not apply cleanly to its own release {s}")
    old_sel = selection(old, available) if old.get("series") else {}
    for v, sel in selection(new, available).items():
        if sel["applies"] is False and v != sel["series"]:
            before = old_sel.get(v)
            if before and before["series"] == sel["series"] and before["applies"] is False:
                continue  # known and recorded in the committed report
            out.append(f"vLLM {v}: series v{sel['series']} (what `kvcache patch-vllm` picks) "
                       "does not apply cleanly")
    return out


def write_if_changed(report: dict, old: dict, out: str) -> bool:
    """Write ``out`` (.md) and its .json when ``results`` differ from ``old``'s.

    Returns whether the files were written. The ``generated`` timestamp is only renewed
    when something else changed; a missing file counts as a change."""
    path_json = os.path.splitext(out)[0] + ".json"
    if (results(report) == results(old) and os.path.isfile(out)
            and os.path.isfile(path_json)):
        return False
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(path_json, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    with open(out, "w") as f:
        f.write(render_md(report))
    return True


def render_md(report: dict) -> str:
    """docs/patch-compat.md from a report."""
    available = sorted(report["series"], key=version_key)
    lines = ["# vLLM patch compatibility", "",
             f"Generated {report.get('generated')} by `make patch-rebase` "
             "(`scripts/patch_rebase.py`): every series under `kvcache_core/vllm_patches/` "
             "tried on every vLLM release not older than it (PyPI sdist). clean = applies "
             "(exactly or at an offset); fuzz = applies only with fuzz, review it (`kvcache "
             "patch-vllm` never uses fuzz and refuses it); conflict = a hunk fails or the file "
             "is gone. A clean result is textual only: it says nothing about whether the "
             "patched code still runs (the v0.26.0 scheduler patch applies to 0.31.0+, whose "
             "scheduler no longer has `skipped_waiting`; there 0003 conflicts, so it is never "
             "applied).", "",
             "This file and its .json are rewritten only when a result changes. `--fail-on-"
             "regression` (weekly CI, `.github/workflows/patch-rebase.yml`) exits 1 when a "
             "series stops applying to its own release, or when the series `kvcache "
             "patch-vllm` picks for a release does not apply and this report did not say so "
             "yet (commit the report to acknowledge, add a series to fix). Releases that "
             "cannot be downloaded are skipped and keep their results; offline runs exit 0.",
             "",
             "## Which series `kvcache patch-vllm` uses", "",
             "The series of the target's own version, else the newest series older than it. "
             "A version older than every series is refused. \"connector runs\": whether "
             "py-kvcache's connector runs on that release line (`RUNTIME_LINES` in "
             "`kvcache_core/patching.py`, the lines `kvcache_core/vllm/compat.py` has adapters "
             "for); on the others a server configured with it refuses to start, saying so, "
             "and `kvcache patch-vllm` prints a note.", "",
             "| vLLM | series | applies | connector runs |", "|---|---|---|---|"]
    for v, sel in selection(report, available).items():
        ok = {True: "yes", False: "**no** (refused, nothing changed)", None: "?"}[sel["applies"]]
        runs = "yes" if _patching.runtime_note(v) is None else "no"
        lines.append(f"| {v} | v{sel['series']} | {ok} | {runs} |")
    for s in available:
        d = report["series"][s]
        names = d.get("patches", [])
        lines += ["", f"## Series v{s}", "",
                  "| vLLM | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for v in sorted(d.get("releases", {}), key=version_key):
            pr = d["releases"][v]
            lines.append(f"| {v} | " + " | ".join(pr.get(n, {}).get("state", "?")
                                                  for n in names) + " |")
    if report.get("notes"):
        lines += ["", "Not checked in the last run that changed this file:", ""]
        lines += [f"* {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ main
def run(available: list[str], versions: list[str], urls: dict[str, str], cache: str,
        old: dict) -> tuple[dict, list[str]]:
    """Try every series on every release of ``versions`` not older than the series.

    Releases whose sdist cannot be had are skipped (noted) and keep ``old``'s results."""
    report: dict = {"series": {}}
    series_patches = {s: read_series(s) for s in available}
    for s, patches in series_patches.items():
        prev = old["series"].get(s, {})
        report["series"][s] = {"patches": [os.path.basename(p) for p in patches],
                               "releases": dict(prev.get("releases", {}))}
    wanted = {f for ps in series_patches.values() for p in ps for f in touched(p)}
    notes = []
    for i, v in enumerate(versions, 1):
        targets = [s for s in available if version_key(s) <= version_key(v)]
        if not targets:
            continue
        try:
            tarball = sdist(v, urls, cache)
        except Exception as e:  # offline, 404, disk
            log(f"[{i}/{len(versions)}] vLLM {v}: skipped, no sdist ({e})")
            notes.append(f"vLLM {v}: no sdist ({e})")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            base = os.path.join(tmp, "base")
            os.makedirs(base)
            try:
                found = extract(tarball, wanted, base)
            except (OSError, tarfile.TarError) as e:
                log(f"vLLM {v}: skipped, unreadable sdist {tarball} ({e})")
                notes.append(f"vLLM {v}: unreadable sdist ({e})")
                continue
            for s in targets:
                res = try_series(base, found, series_patches[s], os.path.join(tmp, f"v{s}"))
                report["series"][s]["releases"][v] = res
                log(f"[{i}/{len(versions)}] vLLM {v} / series v{s}: "
                    + ", ".join(f"{k[:4]}={d['state']}" for k, d in res.items()))
    return report, notes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=OUT, help="markdown report (the .json sits beside it)")
    ap.add_argument("--versions", help="comma-separated releases instead of all of them")
    ap.add_argument("--new-only", action="store_true",
                    help="only releases missing from the existing report (plus each series' "
                    "own release); the other results are kept")
    ap.add_argument("--cache-dir", default=CACHE, help=f"sdist cache (default {CACHE})")
    ap.add_argument("--offline", action="store_true", help="use cached sdists only")
    ap.add_argument("--fail-on-regression", action="store_true",
                    help="exit 1 when a series stops applying to a release it targets")
    args = ap.parse_args(argv)
    if shutil.which("patch") is None:
        log("GNU patch not found: nothing checked")
        return 0
    available = supported_versions()
    path_json = os.path.splitext(args.out)[0] + ".json"
    old = load_report(path_json)
    urls: dict[str, str] = {}
    versions = cached_releases(args.cache_dir)
    if not args.offline:
        try:
            listed, urls = list_releases()
            versions = sorted(set(versions) | set(listed), key=version_key)
        except Exception as e:  # network, mirror, JSON shape
            log(f"cannot list vLLM releases ({e}); using the {len(versions)} cached sdists")
    oldest = min(available, key=version_key)
    versions = [v for v in versions if version_key(v) >= version_key(oldest)]
    if args.versions:
        want = [v.strip() for v in args.versions.split(",") if v.strip()]
        versions = sorted(set(want), key=version_key)
    if args.new_only:
        known = {v for d in old["series"].values() for v in d.get("releases", {})}
        versions = [v for v in versions if v not in known or v in available]
    if not versions:
        log("no release to check (offline and nothing cached?): report unchanged")
        return 0
    report, notes = run(available, versions, urls, args.cache_dir, old)
    report["generated"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if notes:
        report["notes"] = notes
    if write_if_changed(report, old, args.out):
        log(f"results changed: wrote {args.out} and {path_json}")
    else:
        log(f"no result changed: {args.out} left as it is")
    if args.fail_on_regression:
        bad = regressions(report, old, available)
        for b in bad:
            log(f"REGRESSION: {b}")
        if bad:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
