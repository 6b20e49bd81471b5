#!/usr/bin/env python3
"""`make patch-rebase`: does the pinned patch series still apply to newer vLLM releases?

For every vLLM release on PyPI newer than the pinned one (0.27.0 .. newest), downloads
its sdist, extracts only the files the series touches, applies the series in order with
GNU patch and classifies each patch: ``clean`` (applies exactly or at an offset),
``fuzz`` (applies only with fuzz: review), ``conflict`` (a hunk fails or the file is
gone). Writes docs/patch-compat.md and docs/patch-compat.json. It reports; it never fails
(exit 0 even when PyPI is unreachable, which is reported).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PINNED = "0.26.0"
PYPI = os.environ.get("PYPI_JSON", "https://pypi.org/pypi/vllm/json")


def log(msg: str) -> None:
    print(f"[patch-rebase] {msg}", file=sys.stderr, flush=True)


def vkey(v: str) -> tuple:
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"[.]", v))


def releases() -> tuple[list[str], dict]:
    with urllib.request.urlopen(PYPI, timeout=60) as r:
        data = json.load(r)
    out = []
    for v, files in data["releases"].items():
        if not re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", v) or vkey(v) <= vkey(PINNED):
            continue
        if any(f["packagetype"] == "sdist" for f in files):
            out.append(v)
    return sorted(out, key=vkey), data


def series() -> list[str]:
    d = os.path.join(REPO, "kvcache_core", "vllm_patches", f"v{PINNED}")
    with open(os.path.join(d, "series")) as f:
        names = [ln.split("#", 1)[0].strip() for ln in f]
    return [os.path.join(d, n) for n in names if n]


def touched(patch: str) -> list[str]:
    with open(patch) as f:
        return [ln[6:].strip() for ln in f if ln.startswith("+++ b/")]


def fetch_files(version: str, data: dict, wanted: set[str], dest: str) -> list[str]:
    url = next(f["url"] for f in data["releases"][version] if f["packagetype"] == "sdist")
    url = urllib.parse.urljoin(PYPI, url)
    with urllib.request.urlopen(url, timeout=300) as r:
        blob = r.read()
    found = []
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tf:
        for m in tf:
            parts = m.name.split("/", 1)
            if len(parts) == 2 and parts[1] in wanted and m.isfile():
                target = os.path.join(dest, parts[1])
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(tf.extractfile(m).read())
                found.append(parts[1])
    return found


def classify(root: str, patch: str) -> tuple[str, str]:
    r = subprocess.run(["patch", "-p1", "-d", root, "-i", patch, "--batch", "-N",
                        "--no-backup-if-mismatch", "-r", "-"], capture_output=True, text=True)
    text = (r.stdout + r.stderr).strip()
    if r.returncode != 0:
        return "conflict", text
    if "fuzz" in text:
        return "fuzz", text
    return "clean", text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "patch-compat.md"))
    ap.add_argument("--versions", help="comma-separated list instead of all newer releases")
    args = ap.parse_args()
    patches = series()
    wanted = {p for s in patches for p in touched(s)}
    report: dict = {"pinned": PINNED, "generated": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                 time.gmtime()),
                    "patches": [os.path.basename(p) for p in patches], "releases": []}
    try:
        versions, data = releases()
    except Exception as e:  # network, mirror, JSON shape
        log(f"cannot list vLLM releases: {e}")
        report["error"] = f"cannot list releases: {e}"
        versions, data = [], {}
    if args.versions:
        versions = [v for v in args.versions.split(",") if v in versions]
    for i, v in enumerate(versions, 1):
        log(f"[{i}/{len(versions)}] vLLM {v}: downloading sdist")
        row: dict = {"version": v, "patches": {}}
        with tempfile.TemporaryDirectory() as tmp:
            try:
                found = fetch_files(v, data, wanted, tmp)
            except Exception as e:
                row["error"] = f"download failed: {e}"
                report["releases"].append(row)
                continue
            missing = wanted - set(found)
            for p in patches:
                name = os.path.basename(p)
                gone = [f for f in touched(p) if f in missing]
                if gone:
                    row["patches"][name] = {"state": "conflict",
                                            "detail": f"file missing: {', '.join(gone)}"}
                    continue
                state, detail = classify(tmp, p)
                row["patches"][name] = {"state": state, "detail": detail[-400:]}
        log(f"vLLM {v}: " + ", ".join(f"{k}={d['state']}" for k, d in row["patches"].items()))
        report["releases"].append(row)
    write(report, args.out)
    return 0


def write(report: dict, out: str) -> None:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump(report, f, indent=1)
    names = report["patches"]
    lines = ["# vLLM patch compatibility", "",
             f"Series `kvcache_core/vllm_patches/v{report['pinned']}/` tried on every newer "
             "vLLM release "
             f"(PyPI sdist), generated {report['generated']} by `make patch-rebase`. "
             "clean = applies (exactly or at an offset); fuzz = applies only with fuzz, review "
             "it; conflict = a hunk fails or the file is gone.", ""]
    if report.get("error"):
        lines += [f"**Not checked:** {report['error']}", ""]
    lines += ["| vLLM | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in report["releases"]:
        if "error" in r:
            lines.append(f"| {r['version']} | " + " | ".join(["?"] * len(names))
                         + f" |  <!-- {r['error']} -->")
            continue
        lines.append(f"| {r['version']} | " + " | ".join(
            r["patches"].get(n, {}).get("state", "?") for n in names) + " |")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    log(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
