"""Trust model of the cache root (docs/security.md): private modes, no symlink is ever
followed, roots owned by another user refused. Real files, real processes."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
import subprocess
import sys

import pytest
from helpers.kvutil import (
    BLOCK,
    REPO,
    assert_config_error_names_key,
    finish,
    list_files,
    payload,
    tree_snapshot,
)

import kvcache_core.io as kio
from kvcache_core.config import ConfigError, StorageConfig, default_root_dir
from kvcache_core.io.base import DEFAULT_FILE_MODE
from kvcache_core.io.posix import PosixEngine
from kvcache_core.layout import DEFAULT_DIR_MODE, Layout, LayoutError, Namespace

OLD = 1_000_000_000  # mtime of every file outside the root: LRU-first if ever followed


def mode_of(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask():
    """Set the process umask for one test (``umask(m)``); restored afterwards."""
    old = os.umask(0)
    os.umask(old)

    def set_(m: int) -> None:
        os.umask(m)

    yield set_
    os.umask(old)


def tree_modes(top: str) -> tuple[dict[str, int], dict[str, int]]:
    """({dir: mode}, {file: mode}) of everything under ``top`` (``top`` included)."""
    dirs = {top: mode_of(top)}
    files: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            dirs[p] = mode_of(p)
        for f in filenames:
            p = os.path.join(dirpath, f)
            files[p] = mode_of(p)
    return dirs, files


def engine_create(path: str) -> None:
    """Create ``path`` exactly as the reactor creates a temp file (engine default mode)."""
    eng = PosixEngine(1)
    try:
        eng.open(7, path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        eng.submit()
        out: list[tuple[int, int]] = []
        while not out:
            eng.wait(1.0)
            eng.reap(out)
        assert out[0][0] == 7 and out[0][1] >= 0, out
        os.close(out[0][1])
    finally:
        eng.shutdown()


# --------------------------------------------------------------------------- modes


@pytest.mark.parametrize("mask", [0, 0o022, 0o277])
def test_default_modes_of_everything_the_layout_creates(tmp_path, ns, umask, mask):
    umask(mask)
    root = str(tmp_path / "a" / "b" / "root")  # two missing parents
    lay = Layout(root, ns)
    try:
        for i in range(6):
            k = f"k{i}".encode()
            assert lay.write_block(k, payload(k, BLOCK))
        tmp, final = lay.temp_path_for(b"via-engine")
        engine_create(tmp)  # how the reactor creates its temp files
        assert DEFAULT_FILE_MODE == 0o600
        assert mode_of(tmp) == 0o600 & ~mask  # never more open; exact once published
        assert lay.publish(tmp, final, 0)
        tmp, _ = lay.temp_path_for(b"still-a-temp")
        engine_create(tmp)
        dirs, files = tree_modes(str(tmp_path / "a"))
        names = {os.path.basename(p) for p in files}
        assert {"meta.json", ".usage"} <= names
        assert any(p.endswith(lay._tag) for p in files)  # the writer lock
        assert len(list_files(lay.base)[0]) == 7 and final in files
        assert set(dirs.values()) == {DEFAULT_DIR_MODE} == {0o700}, dirs
        assert files.pop(tmp) == 0o600 & ~mask
        assert set(files.values()) == {0o600}, files
        lay.discard(tmp)
    finally:
        lay.close()


def test_probe_file_is_private_and_never_followed(tmp_path, monkeypatch, umask):
    umask(0)
    seen: list[tuple[str, int, int]] = []
    real_open = os.open

    def spy(path, flags, mode=0o777, **kw):
        seen.append((path, flags, mode))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(kio.os, "open", spy)
    kio.probe_direct(str(tmp_path), "auto")
    monkeypatch.undo()
    probes = [s for s in seen if ".odirect-probe." in s[0]]
    assert probes, seen
    for _path, flags, mode in probes:
        assert mode == 0o600
        assert flags & os.O_NOFOLLOW and flags & os.O_EXCL and flags & os.O_CREAT
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".odirect-probe.")]


@pytest.mark.parametrize("mask", [0, 0o077])
def test_dir_mode_and_file_mode_are_honoured_exactly(tmp_path, ns, umask, mask):
    umask(mask)
    cfg = StorageConfig(root_dir=str(tmp_path / "shared" / "root"), dir_mode="0750",
                        file_mode="0640")
    assert (cfg.dir_mode, cfg.file_mode) == (0o750, 0o640)
    lay = Layout(cfg.root_dir, ns, dir_mode=cfg.dir_mode, file_mode=cfg.file_mode)
    try:
        for i in range(4):
            k = f"k{i}".encode()
            assert lay.write_block(k, payload(k, BLOCK))
        # a temp created by an engine (0600) is published with file_mode
        k = b"via-engine"
        tmp, final = lay.temp_path_for(k)
        engine_create(tmp)
        assert lay.publish(tmp, final, 0)
        dirs, files = tree_modes(str(tmp_path / "shared"))
        assert set(dirs.values()) == {0o750}, dirs
        assert set(files.values()) == {0o640}, files
        assert final in files
    finally:
        lay.close()


def test_reactor_publishes_with_file_mode(make_layout, make_reactor, umask):
    umask(0o022)
    lay = make_layout(dir_mode=0o770, file_mode=0o660)
    r = make_reactor(lay)
    keys = [f"r{i}".encode() for i in range(8)]
    r.store("s", [(k, payload(k, BLOCK), BLOCK) for k in keys])
    assert finish(r)["s"].ok == [True] * 8
    finals, temps = list_files(lay.base)
    assert len(finals) == 8 and not temps
    assert {mode_of(p) for p in finals} == {0o660}
    assert {mode_of(os.path.dirname(p)) for p in finals} == {0o770}


def test_existing_directories_and_files_keep_their_mode(tmp_path, ns, umask):
    umask(0)
    root = tmp_path / "root"
    root.mkdir(mode=0o755)
    Layout(str(root), ns).close()
    assert mode_of(str(root)) == 0o755  # the user's directory: not ours to change
    base = os.path.join(str(root), ns.dirname())
    os.chmod(os.path.join(base, ".usage"), 0o660)  # e.g. made by a group-shared config
    Layout(str(root), ns).close()
    assert mode_of(os.path.join(base, ".usage")) == 0o660
    assert mode_of(base) == 0o700


@pytest.mark.parametrize("key,value", [
    ("dir_mode", 0o600),        # owner lost x
    ("dir_mode", "0500"),       # owner lost w
    ("dir_mode", 0o1777),       # sticky bit
    ("dir_mode", "02770"),      # setgid
    ("dir_mode", "rwx"),
    ("dir_mode", "0789"),
    ("dir_mode", ""),
    ("dir_mode", -1),
    ("dir_mode", True),
    ("dir_mode", 7.0),
    ("file_mode", 0o400),
    ("file_mode", "0200"),
    ("file_mode", 0o4600),      # setuid
    ("file_mode", None),
    ("file_mode", 0o1000),
    ("allow_foreign_root", "yes"),
    ("allow_foreign_root", 1),
])
def test_bad_modes_name_the_key(key, value):
    assert_config_error_names_key(key, value)


@pytest.mark.parametrize("value,expect", [
    (0o750, 0o750), ("0750", 0o750), ("750", 0o750), ("0o750", 0o750), (" 0700 ", 0o700),
    (0o777, 0o777),
])
def test_good_dir_modes(value, expect):
    assert StorageConfig(dir_mode=value).dir_mode == expect
    cfg = StorageConfig.from_json(json.dumps({"dir_mode": value, "file_mode": "0660"}))
    assert (cfg.dir_mode, cfg.file_mode) == (expect, 0o660)


def test_layout_validates_modes_too(tmp_path, ns):
    with pytest.raises(ConfigError, match="'dir_mode'"):
        Layout(str(tmp_path / "r"), ns, dir_mode=0o600)
    with pytest.raises(ConfigError, match="'file_mode'"):
        Layout(str(tmp_path / "r"), ns, file_mode=0o7600)
    assert not (tmp_path / "r").exists()


def test_config_defaults_are_private():
    cfg = StorageConfig()
    assert (cfg.dir_mode, cfg.file_mode, cfg.allow_foreign_root) == (0o700, 0o600, False)
    from kvcache_core.cli import _config_epilog

    text = _config_epilog()
    assert "dir_mode (default 0o700)" in text and "file_mode (default 0o600)" in text
    assert "allow_foreign_root" in text


# --------------------------------------------------------------------------- default root


def test_default_root_is_private_per_user(tmp_path, monkeypatch, ns, umask):
    umask(0)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_root_dir() == str(home / ".cache" / "py-kvcache")
    assert StorageConfig().root_dir == str(home / ".cache" / "py-kvcache")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the spec: absolute only
    assert StorageConfig().root_dir == str(home / ".cache" / "py-kvcache")
    xdg = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    assert StorageConfig().root_dir == str(xdg / "py-kvcache")
    assert StorageConfig(root_dir="/explicit/root").root_dir == "/explicit/root"
    lay = Layout(StorageConfig().root_dir, ns)
    lay.close()
    assert mode_of(str(xdg)) == 0o700 and mode_of(str(xdg / "py-kvcache")) == 0o700


# --------------------------------------------------------------------------- symlinks




def make_outside(tmp_path, ns: Namespace) -> str:
    """A directory outside the root full of things a followed link would damage: files
    named like blocks and temp files, a fake ledger, meta.json and namespace."""
    out = tmp_path / "outside"
    (out / "ee" / "ff").mkdir(parents=True)
    for i in range(4):
        (out / "ee" / "ff" / (f"{i:02d}" * 16)).write_bytes(b"precious shard file %d" % i)
    (out / "ee" / "ff" / ".tmp.deadhost.1.0.0").write_bytes(b"looks like a dead temp")
    (out / "usage").write_bytes((123456).to_bytes(8, "little"))
    (out / "meta").write_text('{"precious": true}')
    (out / "block").write_bytes(b"precious block-named file")
    (out / "lock").write_bytes(b"precious lock")
    evil = out / ns.dirname()  # a namespace directory another user prepared
    (evil / ".writers").mkdir(parents=True)
    meta = {"format_version": 1, **dataclasses.asdict(ns)}
    (evil / "meta.json").write_text(json.dumps(meta))
    (evil / ".usage").write_bytes((0).to_bytes(8, "little"))
    for dirpath, dirnames, filenames in os.walk(out):
        for n in [*dirnames, *filenames]:
            os.utime(os.path.join(dirpath, n), (OLD, OLD))
    return str(out)


def plant_links(base: str, out: str) -> list[str]:
    """Symbolic links where cache directories and files belong; returns their paths."""
    real_top = next(e.path for e in os.scandir(base)
                    if e.is_dir() and not e.name.startswith("."))
    real_leaf = next(e.path for e in os.scandir(real_top) if e.is_dir())
    links = {
        os.path.join(base, "ee"): os.path.join(out, "ee"),  # a shard top directory
        os.path.join(real_top, "ff"): os.path.join(out, "ee", "ff"),  # a leaf directory
        os.path.join(real_leaf, "ab" * 16): os.path.join(out, "block"),  # a block
        os.path.join(real_leaf, ".tmp.deadhost.1.0.0"): os.path.join(out, "block"),
        os.path.join(base, ".writers", "deadhost.1.0"): os.path.join(out, "lock"),
    }
    for name, target in (("meta.json", "meta"), (".usage", "usage")):
        p = os.path.join(base, name)
        os.unlink(p)
        links[p] = os.path.join(out, target)
    for link, target in links.items():
        os.symlink(target, link)
    return list(links)


def kvcache(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvcache_core.cli", *args],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))


def test_eviction_and_gc_never_follow_symlinks(tmp_path, ns, root, make_layout, caplog):
    out = make_outside(tmp_path, ns)
    first = make_layout()
    for i in range(6):
        k = f"old{i}".encode()
        assert first.write_block(k, payload(k, BLOCK))
    first.close()
    links = plant_links(first.base, out)
    os.symlink(os.path.join(out, ns.dirname()), os.path.join(root, "v1-0123456789abcdef"))
    before = tree_snapshot(out)

    # eviction: a tiny bound so that every write evicts (and rescans the namespace)
    lay = make_layout(max_disk_bytes=3 * ns.file_bytes)
    for i in range(12):
        k = f"new{i}".encode()
        assert lay.write_block(k, payload(k, BLOCK))
        assert lay.read_block(k) == payload(k, BLOCK)  # touch: never through a link
    assert lay.stats.evicted_files >= 9
    assert lay.stats.symlinks_skipped >= 4, lay.stats  # shard dirs, block, temp, lock
    assert lay.collect_stale_temps(0) == 0
    assert lay.scan()[0] <= 3
    warned = [r.getMessage() for r in caplog.records if "symbolic link" in r.getMessage()]
    assert len(warned) == len(set(warned)), warned  # one warning per link
    # the ledger and meta.json links were replaced by regular files, never written through
    for name in (".usage", "meta.json"):
        assert stat.S_ISREG(os.lstat(os.path.join(lay.base, name)).st_mode)
    assert tree_snapshot(out) == before
    lay.close()

    # kvcache gc / inspect, real processes: links planted again, old temps collected
    for name in (".usage", "meta.json"):
        p = os.path.join(lay.base, name)
        os.unlink(p)
        os.symlink(os.path.join(out, "usage" if name == ".usage" else "meta"), p)
    p = kvcache("gc", "--max-age", "0", root)
    assert p.returncode == 0, p.stderr
    assert "removed 0 temp files" in p.stdout, p.stdout
    assert "symbolic link" in p.stderr, p.stderr  # warned about (meta.json: ns skipped)
    assert tree_snapshot(out) == before
    # meta.json is a link: the namespace was skipped as a whole, nothing replaced
    assert os.path.islink(os.path.join(lay.base, "meta.json"))
    os.unlink(os.path.join(lay.base, "meta.json"))
    with open(os.path.join(lay.base, "meta.json"), "w") as f:
        json.dump({"format_version": 1, **dataclasses.asdict(ns)}, f)
    p = kvcache("gc", "--max-age", "0", root)
    assert p.returncode == 0, p.stderr
    assert f"{ns.dirname()}: " in p.stdout and "symbolic links skipped" in p.stdout, p.stdout
    p = kvcache("inspect", root)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert [r["namespace"] for r in report] == [ns.dirname()]  # not the linked namespace
    assert report[0]["symlinks_skipped"] >= 4 and report[0]["files"] <= 3
    assert tree_snapshot(out) == before
    for link in links:  # skipped links stay where they were (only ours were replaced)
        if not link.endswith((".usage", "meta.json")):
            assert os.path.islink(link), link


def test_store_into_a_symlinked_shard_directory_fails(tmp_path, ns, make_layout):
    out = make_outside(tmp_path, ns)
    lay = make_layout()
    key = b"victim"
    h = lay.name_of(key)
    os.symlink(os.path.join(out, "ee"), os.path.join(lay.base, h[:2]))
    before = tree_snapshot(out)
    with pytest.raises(OSError) as ei:
        lay.write_block(key, payload(key, BLOCK))
    assert ei.value.errno == errno.ELOOP
    assert lay.stats.symlinks_skipped == 1
    assert tree_snapshot(out) == before


def test_reactor_never_serves_a_block_through_a_symlink(tmp_path, ns, make_layout,
                                                        make_reactor):
    """A valid block of the key, outside the root, linked in: a miss/error, not a hit."""
    donor = make_layout(r=str(tmp_path / "donor"))
    key = b"forged"
    assert donor.write_block(key, payload(key, BLOCK))
    target = tmp_path / "outside-block"
    with open(donor.path_for(key), "rb") as f:
        target.write_bytes(f.read())
    os.utime(target, (OLD, OLD))
    lay = make_layout(max_disk_bytes=64 * ns.file_bytes)
    os.makedirs(os.path.dirname(lay.path_for(key)))
    os.symlink(str(target), lay.path_for(key))
    assert lay.read_block(key) is None
    r = make_reactor(lay)
    dest = bytearray(BLOCK)
    r.load("l", [(key, memoryview(dest), BLOCK)])
    assert finish(r)["l"].ok == [False]
    assert os.stat(target).st_mtime == OLD
    assert os.path.islink(lay.path_for(key))


# --------------------------------------------------------------------------- ownership


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@needs_root
def test_foreign_root_refused_unless_allowed(tmp_path, ns):
    root = tmp_path / "theirs"
    root.mkdir()
    os.chown(root, 12345, 12345)
    with pytest.raises(LayoutError) as ei:
        Layout(str(root), ns)
    msg = str(ei.value)
    assert ei.value.errno == errno.EPERM
    assert "root_dir" in msg and str(root) in msg and "allow_foreign_root" in msg, msg
    assert "12345" in msg
    assert os.listdir(root) == []  # nothing created
    lay = Layout(str(root), ns, allow_foreign_root=True)
    try:
        assert lay.write_block(b"k", payload(b"k", BLOCK))
    finally:
        lay.close()
    cfg = StorageConfig.from_dict({"root_dir": str(root), "allow_foreign_root": True})
    assert cfg.allow_foreign_root is True


@needs_root
def test_cli_refuses_a_foreign_root(tmp_path, ns):
    root = tmp_path / "theirs"
    Layout(str(root), ns).close()
    os.chown(root, 12345, 12345)
    for cmd in ("gc", "inspect"):
        p = kvcache(cmd, str(root))
        assert p.returncode == 2, (cmd, p.stdout, p.stderr)
        assert "Traceback" not in p.stderr
        assert "root_dir" in p.stderr and "allow_foreign_root" in p.stderr, p.stderr
        p = kvcache(cmd, "--allow-foreign-root", str(root))
        assert p.returncode == 0, (cmd, p.stderr)


def test_own_root_owned_by_this_user_is_accepted(tmp_path, ns, make_layout):
    lay = make_layout()
    assert os.stat(lay.root).st_uid == os.geteuid()
    assert lay.write_block(b"mine", payload(b"mine", BLOCK))


# ------------------------------------------------------------------ keyed integrity
def _forge(lay_nokey: Layout, key: bytes, data: bytes) -> None:
    """What a writer WITHOUT the integrity key can do: a well-formed block (valid header
    hash and xxh3 payload checksum) under the right name."""
    assert lay_nokey.write_block(key, data)


def test_keyed_integrity_refuses_forged_and_unkeyed_blocks(tmp_path, ns):
    """With integrity_key_file set, a block verifies only if it was written with the key:
    one forged by a writer who knows the format (and the xxh3) but not the key is a
    corrupt block (a miss, removed), never served; the key's own blocks are hits."""
    secret = b"0123456789abcdef-shared-secret"
    keyed = Layout(str(tmp_path / "root"), ns, integrity_key=secret)
    forger = Layout(str(tmp_path / "root"), ns)  # same files, no key
    other = Layout(str(tmp_path / "root"), ns, integrity_key=b"another-secret-of-16+")
    try:
        good = payload(b"good", BLOCK)
        assert keyed.write_block(b"good", good)
        assert keyed.read_block(b"good") == good
        assert keyed.read_block(b"good", verify=False) == good  # the MAC is checked anyway
        assert forger.read_block(b"good") == good  # unkeyed readers are not protected
        assert other.read_block(b"good") is None  # a different key does not verify it
        assert keyed.write_block(b"good2", good)
        # a forged block of a known prefix (say a system prompt) under its right name
        _forge(forger, b"prompt", payload(b"attacker", BLOCK))
        assert forger.read_block(b"prompt") is not None
        assert keyed.read_block(b"prompt") is None
        assert not keyed.exists(b"prompt")  # the corrupt file was removed
        # a genuine block whose payload was changed and whose xxh3 / header hash were
        # recomputed by the attacker (the xxh3 is no defence: it has no key)
        path = keyed.path_for(b"good2")
        with open(path, "rb") as f:
            raw = bytearray(f.read())
        mv = memoryview(raw)
        n = len(good)
        mv[4096: 4096 + 8] = b"EVILEVIL"
        forger.seal_header(mv, n)  # valid header hash + checksum, old MAC left as it was
        with open(path, "wb") as f:
            f.write(raw)
        assert forger.read_block(b"good2") is not None  # passes the unkeyed checks
        assert keyed.read_block(b"good2") is None
    finally:
        for lay in (keyed, forger, other):
            lay.close()


def test_keyed_integrity_through_the_reactor(make_layout, make_reactor, ns):
    """The reactor's stores seal the MAC in the background write-back, its loads verify
    it: keyed blocks round-trip, a forged one is counted corrupt (a miss)."""
    from helpers.kvutil import sentinel_buf

    secret = b"reactor-secret-0123456789"
    lay = make_layout(integrity_key=secret)
    r = make_reactor(lay)
    keys = [b"k0", b"k1"]
    r.store("s", [(k, payload(k, BLOCK), BLOCK) for k in keys])
    assert finish(r)["s"].ok == [True, True]
    forger = make_layout()
    _forge(forger, b"k2", payload(b"evil", BLOCK))
    dests = [sentinel_buf(BLOCK) for _ in range(3)]
    r.load("l", [(k, d, BLOCK) for k, d in zip([*keys, b"k2"], dests, strict=True)])
    assert finish(r)["l"].ok == [True, True, False]
    assert bytes(dests[0][:BLOCK]) == payload(b"k0", BLOCK)
    assert r.stats.loads_corrupt == 1


@pytest.mark.parametrize("content,mode,why", [
    (b"short", 0o600, "at least 16"),
    (b"x" * 32, 0o644, "readable by every user"),
    (None, 0o600, "cannot be opened"),
])
def test_integrity_key_file_checks_name_the_key(tmp_path, content, mode, why):
    from kvcache_core.layout import load_integrity_key

    path = tmp_path / "key"
    if content is not None:
        path.write_bytes(content)
        path.chmod(mode)
    with pytest.raises(ConfigError, match=f"integrity_key_file.*{why}"):
        load_integrity_key(str(path))
    link = tmp_path / "link"
    good = tmp_path / "good"
    good.write_bytes(b"y" * 32)
    good.chmod(0o600)
    link.symlink_to(good)
    assert load_integrity_key(str(good)) == b"y" * 32
    with pytest.raises(ConfigError, match="cannot be opened"):
        load_integrity_key(str(link))  # never through a symbolic link
    with pytest.raises(ConfigError, match="integrity_key_file"):
        StorageConfig(integrity_key_file="")


def test_keyed_instances_get_their_own_namespace():
    from kvcache_core.layout import integrity_key_id

    a, b = integrity_key_id(b"k" * 20), integrity_key_id(b"j" * 20)
    assert a != b and len(a) == 16 and a == integrity_key_id(b"k" * 20)
    assert b"k" * 4 not in bytes.fromhex(a)  # an id, not the key
