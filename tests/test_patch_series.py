"""Issue 15: several patch series (v0.26.0, v0.32.0). Which series `kvcache patch-vllm`
picks for a vLLM version (the exact one, else the newest older one; older than every series
is refused), the v0.32.0 series on a real vLLM 0.32.0 tree (from the sdist cache of
`make patch-rebase`; skipped when it is not cached: no network in tests), and the report
logic of scripts/patch_rebase.py (rewrite only when a result changes, regressions) on fake
result sets. Fast, no network, no vLLM import."""

from __future__ import annotations

import json
import os
import tarfile

import pytest
from helpers.patchutil import apply_exactly, cached_sdist, rebase

from kvcache_core import patching

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ series selection
def test_shipped_series():
    assert patching.supported_versions() == ["0.26.0", "0.32.0", "0.34.0"]
    for v in patching.supported_versions():
        patches = patching.read_series(v)
        assert [os.path.basename(p)[:4] for p in patches] == ["0001", "0002", "0003"]
        assert all(os.path.isfile(p) for p in patches)


@pytest.mark.parametrize("version, series", [
    ("0.26.0", "0.26.0"), ("0.26", "0.26.0"), ("0.26.0+cpu", "0.26.0"),
    ("0.26.1", "0.26.0"), ("0.27.1", "0.26.0"), ("0.31.0", "0.26.0"),
    ("0.32.0rc1", "0.26.0"),  # a pre-release sorts before its release
    ("0.32.0", "0.32.0"), ("v0.32.0", "0.32.0"), ("0.32.0+cu128", "0.32.0"),
    ("0.32.1.dev7+gabcdef", "0.32.0"), ("0.33.0", "0.32.0"), ("0.34.0rc1", "0.32.0"),
    ("0.34.0", "0.34.0"), ("0.34.2+cu130", "0.34.0"), ("1.0.0", "0.34.0"),
])
def test_select_series_is_exact_else_newest_older(version, series):
    assert patching.select_series(version) == series


@pytest.mark.parametrize("version", ["0.25.2", "0.25", "0.9.2", "0.26.0rc1"])
def test_older_than_every_series_is_refused_naming_them(version):
    with pytest.raises(patching.PatchError) as e:
        patching.select_series(version)
    assert f"vLLM {version} is not supported" in str(e.value)
    assert "0.26.0, 0.32.0, 0.34.0" in str(e.value)


def test_select_series_with_explicit_list_and_bad_version():
    assert patching.select_series("0.30.0", ["0.28.0", "0.26.0", "0.31.0"]) == "0.28.0"
    assert patching.select_series("0.10.0", ["0.9.0", "0.10.0"]) == "0.10.0"  # not lexical
    with pytest.raises(patching.PatchError):
        patching.select_series("main", ["0.26.0"])
    with pytest.raises(patching.PatchError, match="no version"):
        patching.select_series("0.26.0", [])


@pytest.mark.parametrize("version, line, runs", [
    ("0.26.0", "0.26", True), ("0.26.3+cpu", "0.26", True), ("v0.32.1", "0.32", True),
    ("0.32.0rc1", "0.32", True), ("0.27.1", "0.27", False), ("0.33.0", "0.33", False),
    ("0.34.0", "0.34", False), ("1", "1.0", False)])
def test_runtime_note_names_the_lines_the_connector_runs_on(version, line, runs):
    assert patching.release_line(version) == line
    note = patching.runtime_note(version)
    if runs:
        assert note is None
    else:
        assert f"does not run on vLLM {version} (it runs on 0.26.x and 0.32.x)" in note
        assert "refuses to start" in note


def test_version_key_orders_like_pep440():
    vs = ["0.32.0", "0.9.2", "0.32.0rc1", "0.32.0.post1", "0.32.0.dev1", "0.26.0", "0.10.0"]
    assert sorted(vs, key=patching.version_key) == [
        "0.9.2", "0.10.0", "0.26.0", "0.32.0.dev1", "0.32.0rc1", "0.32.0", "0.32.0.post1"]


# ------------------------------------------------------------------ v0.32.0 on vLLM 0.32.0
def _tree_032(tmp_path) -> tuple[str, list[str]]:
    files = sorted({f for p in patching.read_series("0.32.0") for f in rebase.touched(p)})
    root = str(tmp_path / "vllm-0.32.0")
    found = rebase.extract(cached_sdist("0.32.0"), {*files, "vllm/__init__.py"}, root)
    assert found == {*files, "vllm/__init__.py"}
    return root, files


def test_v032_series_applies_exactly_to_vllm_032(tmp_path):
    root, _ = _tree_032(tmp_path)
    apply_exactly(root, patching.read_series("0.32.0"))  # made on this very tree
    sched = open(os.path.join(root, "vllm/v1/core/sched/scheduler.py")).read()
    assert "def _offer_preload_candidates" in sched
    assert "self.skipped_waiting" not in sched  # gone in 0.31+: the patch must not use it
    for f in ("vllm/v1/worker/kv_connector_model_runner_mixin.py",  # V1 model runner
              "vllm/v1/worker/gpu/kv_connector.py"):                # V2, the 0.32 default
        assert 'getattr(' in open(os.path.join(root, f)).read()
        assert "start_preloads()" in open(os.path.join(root, f)).read()


def test_patch_vllm_on_vllm_032_tree_is_idempotent_and_reversible(tmp_path):
    root, files = _tree_032(tmp_path)
    pristine = {f: open(os.path.join(root, f)).read() for f in files}
    assert patching.chosen_series(root, "0.32.0") == ("0.32.0", "0.32.0")
    assert {s.state for s in patching.check_series(root, "0.32.0")} == {"not-applied"}
    assert {s.state for s in patching.apply_series(root, "0.32.0")} == {"applied"}
    once = {f: open(os.path.join(root, f)).read() for f in files}
    assert {s.state for s in patching.apply_series(root, "0.32.0")} == {"applied"}
    assert {f: open(os.path.join(root, f)).read() for f in files} == once
    assert {s.state for s in patching.reverse_series(root, "0.32.0")} == {"not-applied"}
    assert {f: open(os.path.join(root, f)).read() for f in files} == pristine
    # 0.33.0 is covered by the v0.32.0 series (floor selection)
    assert patching.chosen_series(root, "0.33.0") == ("0.33.0", "0.32.0")


def test_v026_series_on_vllm_032_is_refused_and_changes_nothing(tmp_path):
    root, files = _tree_032(tmp_path)
    files = sorted({*files, *(f for p in patching.read_series("0.26.0")
                              for f in rebase.touched(p))})
    pristine = {f: open(os.path.join(root, f)).read() for f in files}
    states = {s.name[:4]: s.state for s in patching.check_series(root, "0.31.0")}
    assert states["0003"] == "conflict"
    with pytest.raises(patching.PatchError, match="series v0.26.0 .*nothing changed"):
        patching.apply_series(root, "0.31.0")
    assert {f: open(os.path.join(root, f)).read() for f in files} == pristine


def test_rebase_run_on_cached_032(tmp_path):
    cached_sdist("0.32.0")
    report, notes = rebase.run(["0.26.0", "0.32.0"], ["0.32.0", "0.99.0"], {}, rebase.CACHE,
                               {"series": {}})
    assert report["series"]["0.32.0"]["releases"]["0.32.0"] and all(
        r["state"] == "clean" for r in report["series"]["0.32.0"]["releases"]["0.32.0"].values())
    assert report["series"]["0.26.0"]["releases"]["0.32.0"][
        "0003-worker-start-preloads-hook.patch"]["state"] == "conflict"
    assert notes and "0.99.0" in notes[0]  # not cached, no URL: skipped and said so
    assert "0.99.0" not in report["series"]["0.32.0"]["releases"]


# ------------------------------------------------------------------ report logic (fake)
P = ["0001-a.patch", "0002-b.patch", "0003-c.patch"]


def _rel(*states: str) -> dict:
    return {n: {"state": s, "detail": f"patching {n} (offset {i})"}
            for i, (n, s) in enumerate(zip(P, states, strict=True))}


def _report(generated: str, **series: dict) -> dict:
    return {"generated": generated,
            "series": {s.replace("_", "."): {"patches": P, "releases": rel}
                       for s, rel in series.items()}}


def _base(generated: str = "2026-01-01 00:00 UTC") -> dict:
    return _report(generated,
                   **{"0_26_0": {"0.26.0": _rel("clean", "clean", "clean"),
                                 "0.29.0": _rel("clean", "clean", "conflict")},
                      "0_32_0": {"0.32.0": _rel("clean", "clean", "clean")}})


def test_rewrite_only_when_a_result_changes(tmp_path):
    out = str(tmp_path / "compat.md")
    old = {"series": {}}
    assert rebase.write_if_changed(_base(), old, out)  # no file yet: written
    old = rebase.load_report(str(tmp_path / "compat.json"))
    assert old["generated"] == "2026-01-01 00:00 UTC"
    md = open(out).read()
    assert "| 0.29.0 | v0.26.0 | **no**" in md and "| 0.32.0 | v0.32.0 | yes |" in md
    before = (os.stat(out).st_mtime_ns, open(out).read(),
              open(str(tmp_path / "compat.json")).read())

    # only the timestamp and the patch output (offsets) differ: not written
    same = _base("2026-02-02 00:00 UTC")
    same["series"]["0.26.0"]["releases"]["0.26.0"][P[1]]["detail"] = "Hunk #1 at 9 (offset 3)"
    assert not rebase.write_if_changed(same, old, out)
    assert (os.stat(out).st_mtime_ns, open(out).read(),
            open(str(tmp_path / "compat.json")).read()) == before

    # a state changes: written, with the new timestamp
    changed = _base("2026-03-03 00:00 UTC")
    changed["series"]["0.32.0"]["releases"]["0.32.0"][P[2]]["state"] = "fuzz"
    assert rebase.write_if_changed(changed, old, out)
    assert json.load(open(str(tmp_path / "compat.json")))["generated"] == "2026-03-03 00:00 UTC"

    # a new release is a change too
    old = rebase.load_report(str(tmp_path / "compat.json"))
    more = json.loads(json.dumps(old))
    more["series"]["0.32.0"]["releases"]["0.33.0"] = _rel("clean", "clean", "clean")
    assert rebase.write_if_changed(more, old, out)
    assert "| 0.33.0 | v0.32.0 | yes |" in open(out).read()


def test_old_single_series_report_is_read(tmp_path):
    path = tmp_path / "compat.json"
    path.write_text(json.dumps({"pinned": "0.26.0", "generated": "x", "patches": P,
                                "releases": [{"version": "0.27.0", "patches": _rel(
                                    "clean", "clean", "clean")},
                                    {"version": "0.99.0", "error": "download failed"}]}))
    old = rebase.load_report(str(path))
    assert rebase.results(old) == {"0.26.0": {"patches": P, "releases": {
        "0.27.0": dict.fromkeys(P, "clean")}}}


def test_regressions():
    avail = ["0.26.0", "0.32.0"]
    old = _base()
    assert rebase.regressions(old, old, avail) == []  # 0.29.0 known and recorded
    # a newly published release that the picked series does not cover
    new = json.loads(json.dumps(old))
    new["series"]["0.32.0"]["releases"]["0.34.0"] = _rel("clean", "conflict", "clean")
    new["series"]["0.26.0"]["releases"]["0.34.0"] = _rel("clean", "clean", "conflict")
    (msg,) = rebase.regressions(new, old, avail)
    assert "0.34.0" in msg and "v0.32.0" in msg
    # committing that report acknowledges it
    assert rebase.regressions(new, new, avail) == []
    # a series that stops applying to its own release always counts
    broken = json.loads(json.dumps(old))
    broken["series"]["0.32.0"]["releases"]["0.32.0"][P[0]]["state"] = "conflict"
    assert any("own release 0.32.0" in m for m in rebase.regressions(broken, broken, avail))
    # a result that turned bad for a release the picked series covered
    turned = json.loads(json.dumps(old))
    turned["series"]["0.26.0"]["releases"]["0.27.0"] = _rel("clean", "clean", "conflict")
    old2 = json.loads(json.dumps(old))
    old2["series"]["0.26.0"]["releases"]["0.27.0"] = _rel("clean", "clean", "clean")
    assert any("vLLM 0.27.0" in m for m in rebase.regressions(turned, old2, avail))


def test_offline_run_does_not_fail_or_rewrite(tmp_path, monkeypatch):
    out = tmp_path / "compat.md"
    assert rebase.write_if_changed(_base(), {"series": {}}, str(out))
    before = out.read_text(), (tmp_path / "compat.json").read_text()
    monkeypatch.setattr(rebase, "list_releases",
                        lambda *a, **k: (_ for _ in ()).throw(OSError("offline")))
    rc = rebase.main(["--out", str(out), "--cache-dir", str(tmp_path / "empty"),
                      "--fail-on-regression"])
    assert rc == 0
    assert (out.read_text(), (tmp_path / "compat.json").read_text()) == before


def test_extract_reads_only_wanted_members(tmp_path):
    src = tmp_path / "vllm-9.9.9" / "vllm"
    src.mkdir(parents=True)
    (src / "a.py").write_text("a\n")
    (src / "b.py").write_text("b\n")
    tgz = tmp_path / "vllm-9.9.9.tar.gz"
    with tarfile.open(tgz, "w:gz") as tf:
        tf.add(tmp_path / "vllm-9.9.9", arcname="vllm-9.9.9")
    dest = tmp_path / "out"
    assert rebase.extract(str(tgz), {"vllm/a.py", "vllm/gone.py"}, str(dest)) == {"vllm/a.py"}
    assert (dest / "vllm" / "a.py").read_text() == "a\n" and not (dest / "vllm/b.py").exists()
    assert rebase.cached_releases(str(tmp_path)) == ["9.9.9"]
