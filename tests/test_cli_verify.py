"""`kvcache verify / purge / inspect / bench storage` as an operator runs them: real
processes on real cache roots written by the Layout."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from helpers.kvutil import BLOCK, REPO, payload, tree_snapshot

from kvcache_core.layout import HEADER_BYTES, Layout, Namespace


def kvcache(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcache_core.cli", *args],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))




def fill(lay: Layout, prefix: str, n: int) -> list[bytes]:
    keys = [f"{prefix}{i}".encode() for i in range(n)]
    for k in keys:
        assert lay.write_block(k, payload(k, BLOCK if len(k) % 2 else BLOCK // 3))
    return keys


def test_verify_reports_exactly_the_corrupt_and_truncated_blocks(root, ns, make_layout,
                                                                 tmp_path):
    lay = make_layout()
    keys = fill(lay, "good", 6)
    other = make_layout(n=dataclasses.replace(ns, model="other/model"))
    fill(other, "o", 3)
    flipped, cut = lay.path_for(keys[1]), lay.path_for(keys[4])
    with open(flipped, "r+b") as f:  # one payload byte flipped
        f.seek(HEADER_BYTES + 100)
        b = f.read(1)
        f.seek(HEADER_BYTES + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    os.truncate(cut, HEADER_BYTES + 1000)  # truncated inside the payload
    lay.close()
    other.close()
    before = tree_snapshot(root)

    out = str(tmp_path / "verify.json")
    p = kvcache("verify", root, "--json", out)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    rep = json.load(open(out))
    assert rep["ok"] is False
    by = {r["namespace"]: r for r in rep["namespaces"]}
    mine = by[ns.dirname()]
    assert mine["model"] == ns.model and mine["files"] == 6 and mine["ok"] == 4
    corrupt = {c["path"]: c["reason"] for c in mine["corrupt"]}
    assert set(corrupt) == {flipped, cut}, corrupt
    assert "payload checksum" in corrupt[flipped] and "truncated" in corrupt[cut]
    assert mine["unreadable"] == [] and mine["temp_files"] == []
    theirs = by[other.ns.dirname()]
    assert (theirs["files"], theirs["ok"], theirs["corrupt"]) == (3, 3, [])
    assert rep["totals"]["corrupt"] == 2 and rep["totals"]["ok"] == 7
    assert f"corrupt: {flipped}" in p.stdout and f"corrupt: {cut}" in p.stdout
    # read-only: same files, sizes, modes, mtimes and contents (no lock, ledger, meta)
    assert tree_snapshot(root) == before

    # one namespace only: the clean one exits 0
    p = kvcache("verify", "--quiet", "--namespace", other.ns.dirname(), root)
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert "3 ok, 0 corrupt" in p.stdout and p.stderr == ""
    assert tree_snapshot(root) == before


def test_verify_flags_a_misplaced_file_and_reports_temps_and_links(root, ns, make_layout,
                                                                   tmp_path):
    lay = make_layout()
    a, b = fill(lay, "k", 2)
    # a valid block under another key's name: the key does not hash to the file name
    os.unlink(lay.path_for(b))
    os.link(lay.path_for(a), lay.path_for(b))
    tmp, _ = lay.temp_path_for(b"left-behind")
    open(tmp, "wb").close()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x").write_bytes(b"precious")
    os.symlink(outside, os.path.join(lay.base, "zz"))
    lay.close()
    before, before_out = tree_snapshot(root), tree_snapshot(str(outside))
    p = kvcache("verify", root)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "does not hash to the file name" in p.stdout, p.stdout
    assert f"temp file: {tmp}" in p.stdout and "1 symlinks skipped" in p.stdout
    assert tree_snapshot(root) == before and tree_snapshot(str(outside)) == before_out


def test_verify_usage_errors_and_progress(root, tmp_path):
    (tmp_path / "notes.txt").write_text("not a cache")
    for args, what in (((str(tmp_path / "missing"),), "does not exist"),
                       ((str(tmp_path),), "not a cache root")):
        p = kvcache("verify", *args)
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvcache verify: ") and what in lines[0]
    small = Namespace(model="tiny", dtype="u8", block_size=1, block_bytes=64)
    lay = Layout(root, small)
    for i in range(1001):
        lay.write_block(i.to_bytes(4, "little"), b"x" * 64)
    lay.close()
    p = kvcache("verify", root, "--namespace", "v1-0000000000000000")
    assert p.returncode == 2 and "no namespace" in p.stderr
    p = kvcache("verify", os.path.join(root, small.dirname()))
    assert p.returncode == 2 and "namespace directory" in p.stderr, p.stderr
    p = kvcache("verify", root)
    assert p.returncode == 0, p.stdout
    assert "kvcache verify: 1001 files" in p.stderr, p.stderr  # progress on stderr
    p = kvcache("verify", "--quiet", root)
    assert p.returncode == 0 and p.stderr == ""


def test_purge(root, ns, tmp_path):
    models = {"a": dataclasses.replace(ns, model="org/llama-3b"),
              "b": dataclasses.replace(ns, model="org/llama-3b", tp_rank=1, tp_size=2),
              "c": dataclasses.replace(ns, model="org/qwen-7b")}
    for name, n in models.items():
        lay = Layout(root, n)
        fill(lay, name, 2)
        lay.close()
    # a namespace-named link to a namespace outside the root: never followed
    outside = tmp_path / "outside"
    ext = Layout(str(outside), dataclasses.replace(ns, model="org/llama-3b-ext"))
    fill(ext, "e", 2)
    ext.close()
    link = os.path.join(root, "v1-00000000000000ff")
    os.symlink(ext.base, link)
    before, before_out = tree_snapshot(root), tree_snapshot(str(outside))

    p = kvcache("purge", root, "--model", "llama", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("would remove") == 2 and "nothing deleted" in p.stdout
    assert models["a"].dirname() in p.stdout and models["c"].dirname() not in p.stdout
    assert "symbolic link" in p.stdout
    assert tree_snapshot(root) == before

    p = kvcache("purge", root, "--model", "llama")  # no --yes
    assert p.returncode == 2 and "--yes" in p.stderr.strip().splitlines()[-1]
    assert tree_snapshot(root) == before

    p = kvcache("purge", root, "--model", "llama", "--yes")
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(root)) == sorted([models["c"].dirname(), "v1-00000000000000ff"])
    assert os.path.islink(link) and tree_snapshot(str(outside)) == before_out
    assert "removed 2 namespaces" in p.stdout

    p = kvcache("purge", root, "--namespace", "v1-00000000000000ff", "--yes")
    assert p.returncode == 2 and "symbolic link" in p.stderr
    p = kvcache("purge", root, "--all", "--yes")
    assert p.returncode == 0, p.stderr
    assert os.listdir(root) == ["v1-00000000000000ff"] and os.path.islink(link)
    assert tree_snapshot(str(outside)) == before_out


def test_purge_refuses_a_namespace_with_a_live_writer(root, ns, make_layout):
    live = make_layout()  # holds its writer lock, like a running vLLM
    fill(live, "w", 1)
    p = kvcache("purge", root, "--namespace", ns.dirname(), "--yes")
    assert p.returncode == 2 and "live writer" in p.stderr, p.stderr
    assert os.path.isdir(live.base)
    p = kvcache("purge", root, "--namespace", ns.dirname(), "--yes", "--force")
    assert p.returncode == 0, p.stderr
    assert os.listdir(root) == []
    for args in (("--namespace", "../etc"), ("--namespace", "v1-0123456789abcdef")):
        p = kvcache("purge", root, *args, "--yes")
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_inspect_leaves_the_root_unchanged(root, ns, tmp_path):
    lay = Layout(root, ns)
    fill(lay, "i", 3)
    tmp, _ = lay.temp_path_for(b"dead")  # a dead writer's temp file and lock entry
    open(tmp, "wb").close()
    open(os.path.join(lay.base, ".writers", "deadhost.1.0"), "wb").close()
    lay.close()
    os.unlink(os.path.join(lay.base, ".usage"))  # inspect must not recreate it
    before = tree_snapshot(root)
    p = kvcache("inspect", root)
    assert p.returncode == 0, p.stderr
    (rep,) = json.loads(p.stdout)
    assert rep["files"] == 3 and rep["temp_files"] == 1 and rep["ledger_bytes"] is None
    assert tree_snapshot(root) == before


def test_bench_storage_refuses_a_missing_root_without_create(tmp_path):
    missing = tmp_path / "bench"
    p = kvcache("bench", "storage", "--quick", "--no-metadata", "--root", str(missing))
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--create" in lines[0] and str(missing) in lines[0], p.stderr
    assert not missing.exists()
