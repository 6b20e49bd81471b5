"""Layout units: naming, header, publish, lookup, capacity, errors."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
from helpers.kvutil import (
    BLOCK,
    REPO,
    header_key,
    list_files,
    payload,
    published_bytes,
    read_ledger,
)

from kvcache_core.layout import (
    HEADER_BYTES,
    MAX_KEY_BYTES,
    TMP_PREFIX,
    CorruptBlock,
    Layout,
    LayoutError,
    Namespace,
    round_up,
)

# --------------------------------------------------------------------------- naming


def test_namespace_dirname_changes_with_every_field(ns, make_layout, root):
    variants = {
        "base": ns,
        "model": dataclasses.replace(ns, model="other/model"),
        "dtype": dataclasses.replace(ns, dtype="float16"),
        "block_size": dataclasses.replace(ns, block_size=32),
        "block_bytes": dataclasses.replace(ns, block_bytes=2 * BLOCK),
        "tp_rank": dataclasses.replace(ns, tp_rank=1, tp_size=2),
        "tp_size": dataclasses.replace(ns, tp_size=2),
        "kv_layout": dataclasses.replace(ns, kv_layout="HND"),
    }
    dirs = {name: v.dirname() for name, v in variants.items()}
    assert len(set(dirs.values())) == len(dirs), dirs
    for d in dirs.values():
        assert re.fullmatch(r"v1-[0-9a-f]{16}", d), d
    # equal namespaces -> equal directory (pure function of the fields)
    assert Namespace(**dataclasses.asdict(ns)).dirname() == ns.dirname()

    # a block published in one namespace is invisible in every other one
    layouts = {name: make_layout(n=v) for name, v in variants.items()}
    assert len({lay.base for lay in layouts.values()}) == len(layouts)
    key = b"shared-key"
    assert layouts["base"].write_block(key, payload(key, 100))
    for name, lay in layouts.items():
        assert lay.exists(key) == (name == "base"), name
        assert lay.base == os.path.join(os.path.abspath(root), variants[name].dirname())
        with open(os.path.join(lay.base, "meta.json")) as f:
            meta = json.load(f)
        assert meta["format_version"] == 1
        assert meta["dtype"] == variants[name].dtype
        assert meta["block_bytes"] == variants[name].block_bytes
        assert meta["tp_rank"] == variants[name].tp_rank


def test_names_stable_across_processes_and_hash_seeds(ns, make_layout):
    """R2: keys must map to the same file in every process (PYTHONHASHSEED varies)."""
    lay = make_layout()
    keys = [b"k0", b"\x00\xff" * 20, os.urandom(MAX_KEY_BYTES)]
    script = (
        "import sys, json\n"
        "from kvcache_core.layout import Namespace\n"
        f"ns = Namespace(**{dataclasses.asdict(ns)!r})\n"
        f"keys = {keys!r}\n"
        "import xxhash\n"
        "print(json.dumps([ns.dirname()] + [xxhash.xxh3_128_hexdigest(k) for k in keys]))\n"
    )
    expect = [ns.dirname()] + [lay.name_of(k) for k in keys]
    for seed in ("0", "1", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=REPO)
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, check=True, timeout=60).stdout
        assert json.loads(out) == expect
    for k in keys:
        h = lay.name_of(k)
        assert lay.path_for(k) == f"{lay.base}/{h[:2]}/{h[2:4]}/{h}"


def test_path_lookup_and_file_size(make_layout, ns):
    lay = make_layout()
    key = b"block-0001"
    path = lay.path_for(key)
    assert not lay.exists(key)
    assert not os.path.exists(path)
    assert lay.read_block(key) is None
    assert lay.write_block(key, payload(key, BLOCK))
    assert lay.exists(key)
    assert os.path.isfile(path)
    assert os.path.getsize(path) == ns.file_bytes == HEADER_BYTES + BLOCK
    assert not lay.exists(b"block-0002")
    lay.remove(key)
    assert not lay.exists(key)
    assert read_ledger(lay.base) == 0


# --------------------------------------------------------------------------- header


@pytest.mark.parametrize("n", [1, 1000, 4096, 4097, BLOCK - 1, BLOCK])
def test_header_round_trip(make_layout, ns, n):
    lay = make_layout()
    key = f"rt-{n}".encode()
    data = payload(key, n)
    assert lay.write_block(key, data)
    path = lay.path_for(key)
    assert os.path.getsize(path) == HEADER_BYTES + round_up(n)
    assert header_key(path) == key
    assert lay.read_block(key) == data
    # the raw file validates with check_block, and only for its own key
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    raw += bytes(ns.file_bytes - len(raw))
    mv = memoryview(raw)
    assert lay.check_block(mv, os.path.getsize(path), key) == n
    with pytest.raises(CorruptBlock, match="key mismatch"):
        lay.check_block(mv, os.path.getsize(path), b"another key")
    # padding after the payload is zero
    assert raw[HEADER_BYTES + n: HEADER_BYTES + round_up(n)] == bytes(round_up(n) - n)


def test_fill_header_and_check_block_in_memory(make_layout, ns):
    lay = make_layout()
    slot = memoryview(bytearray(ns.file_bytes))
    key = b"mem"
    data = payload(key, 5000)
    slot[HEADER_BYTES: HEADER_BYTES + 5000] = data
    total = lay.fill_header(slot, key, 5000)
    assert total == HEADER_BYTES + 8192
    assert lay.check_block(slot, total, key) == 5000
    slot[HEADER_BYTES + 10] ^= 0x01
    with pytest.raises(CorruptBlock, match="payload checksum"):
        lay.check_block(slot, total, key)
    assert lay.check_block(slot, total, key, verify=False) == 5000  # verify off: no hash
    with pytest.raises(CorruptBlock, match="truncated payload"):
        lay.check_block(slot, HEADER_BYTES + 100, key, verify=False)
    with pytest.raises(CorruptBlock, match="truncated header"):
        lay.check_block(slot, 100, key)
    with pytest.raises(ValueError):
        lay.fill_header(slot, key, ns.file_bytes)  # does not fit the slot


def test_key_length_limit(make_layout):
    lay = make_layout()
    ok = b"k" * MAX_KEY_BYTES
    assert lay.write_block(ok, b"x")
    assert lay.read_block(ok) == b"x"
    with pytest.raises(ValueError, match="key longer"):
        lay.write_block(b"k" * (MAX_KEY_BYTES + 1), b"x")
    assert list_files(lay.base)[1] == []


def test_block_bytes_must_be_positive(root):
    with pytest.raises(ValueError):
        Layout(root, Namespace("m", "bf16", 16, 0))


# --------------------------------------------------------------------------- publish


def test_publish_same_key_twice_counts_once(make_layout, ns):
    lay = make_layout()
    key = b"twice"
    assert lay.write_block(key, payload(key, BLOCK)) is True
    assert lay.write_block(key, payload(key, BLOCK)) is False
    assert read_ledger(lay.base) == ns.file_bytes
    assert lay.stats.published == 1

    # two writers racing on one key: both have a temp file, the second publish loses
    key2 = b"race"
    lay.reserve(ns.file_bytes)
    tmps = []
    for _ in range(2):
        tmp, final = lay.temp_path_for(key2)
        slot = memoryview(bytearray(ns.file_bytes))
        slot[HEADER_BYTES:] = payload(key2, BLOCK)
        n = lay.fill_header(slot, key2, BLOCK)
        with open(tmp, "wb") as f:
            f.write(slot[:n])
        tmps.append((tmp, final, n))
    assert tmps[0][0] != tmps[1][0]
    assert lay.publish(*tmps[0]) is True
    assert lay.publish(*tmps[1]) is False
    assert lay.stats.publish_existing == 1
    assert lay.read_block(key2) == payload(key2, BLOCK)
    assert read_ledger(lay.base) == 2 * ns.file_bytes == published_bytes(lay.base)
    finals, temps = list_files(lay.base)
    assert temps == [] and len(finals) == 2


def test_discard_removes_temp(make_layout):
    lay = make_layout()
    tmp, final = lay.temp_path_for(b"d")
    open(tmp, "wb").close()
    lay.discard(tmp)
    lay.discard(tmp)  # idempotent
    assert not os.path.exists(tmp) and not os.path.exists(final)


# --------------------------------------------------------------------------- capacity


@pytest.mark.parametrize("refresh", ["none", "touch", "read_block"])
def test_eviction_is_least_recently_used(make_layout, ns, refresh):
    fb = ns.file_bytes
    lay = make_layout(max_disk_bytes=4 * fb + 100)
    keys = [b"a", b"b", b"c", b"d"]
    for k in keys:
        assert lay.write_block(k, payload(k, BLOCK))
    assert read_ledger(lay.base) == 4 * fb
    if refresh == "touch":
        lay.touch(b"a")
    elif refresh == "read_block":
        assert lay.read_block(b"a") == payload(b"a", BLOCK)
    # the 5th block does not fit: evict to 90% of the bound minus the new block
    assert lay.write_block(b"e", payload(b"e", BLOCK))
    present = {k.decode() for k in keys + [b"e"] if lay.exists(k)}
    if refresh == "none":
        assert present == {"c", "d", "e"}
    else:
        assert present == {"a", "d", "e"}
    assert lay.stats.evicted_files == 2
    assert read_ledger(lay.base) == published_bytes(lay.base) == 3 * fb
    for k in present:
        assert lay.read_block(k.encode()) == payload(k.encode(), BLOCK)


def test_block_larger_than_bound_is_dropped(make_layout, ns):
    lay = make_layout(max_disk_bytes=ns.file_bytes - 1)
    assert lay.write_block(b"big", payload(b"big", BLOCK)) is False
    assert lay.stats.dropped_over_capacity == 1
    assert not lay.exists(b"big")
    assert list_files(lay.base) == ([], [])
    assert read_ledger(lay.base) == 0


def test_eviction_scans_files_of_a_previous_process(make_layout, ns, root):
    """A new process (empty LRU heap) still evicts the oldest files found on disk."""
    fb = ns.file_bytes
    lay = make_layout()
    for i in range(6):
        k = f"old{i}".encode()
        lay.write_block(k, payload(k, BLOCK))
        t = time.time() - 1000 + i
        os.utime(lay.path_for(k), (t, t))
    lay.close()
    lay2 = make_layout(max_disk_bytes=6 * fb)
    assert lay2.write_block(b"new", payload(b"new", BLOCK))
    assert lay2.exists(b"new")
    # 90% of 6 files minus the new one -> at most 4 old files stay; the oldest went
    assert not lay2.exists(b"old0") and not lay2.exists(b"old1")
    assert lay2.exists(b"old5")
    with lay2.ledger.locked():  # the evictor thread may be evicting in the background
        assert read_ledger(lay2.base) == published_bytes(lay2.base) <= 6 * fb


def test_ledger_equals_file_sizes_after_churn(make_layout, ns):
    rng = random.Random(1234)
    fb = ns.file_bytes
    bound = 12 * fb
    lay = make_layout(max_disk_bytes=bound)
    universe = [f"churn-{i}".encode() for i in range(40)]
    for step in range(400):
        k = rng.choice(universe)
        op = rng.random()
        if op < 0.55:
            lay.write_block(k, payload(k, rng.randint(1, BLOCK)))
        elif op < 0.7:
            lay.remove(k)
        elif op < 0.85:
            got = lay.read_block(k)
            # the evictor thread may rename the file away right after the read; what the
            # read returned must still be k's bytes (payload() is deterministic per key)
            assert got is None or bytes(got) == payload(k, len(got)), f"step {step}"
        else:  # corrupt a payload byte in place (same size): the next read removes it
            p = lay.path_for(k)
            with lay.ledger.locked():  # so that the evictor cannot rename p meanwhile
                corrupted = os.path.exists(p)
                if corrupted:
                    with open(p, "r+b") as f:
                        f.seek(HEADER_BYTES)
                        b = f.read(1)
                        f.seek(HEADER_BYTES)
                        f.write(bytes([b[0] ^ 0xFF]))
            if corrupted:
                assert lay.read_block(k) is None
                assert not lay.exists(k)
        with lay.ledger.locked():  # the evictor thread renames and counts under it
            ledger = read_ledger(lay.base)
            published = published_bytes(lay.base)
        assert ledger == published, f"step {step}"
        assert ledger <= bound, f"step {step}"
    assert lay.stats.evicted_files > 0
    lay.close()  # the evictor unlinks what eviction renamed away (temp names) first
    assert list_files(lay.base)[1] == []


def test_collect_stale_temps(make_layout):
    lay = make_layout()
    mine, _ = lay.temp_path_for(b"x")
    d = os.path.dirname(mine)
    foreign_old = os.path.join(d, f"{TMP_PREFIX}otherhost.1.0")
    foreign_new = os.path.join(d, f"{TMP_PREFIX}otherhost.1.1")
    for p in (mine, foreign_old, foreign_new):
        open(p, "wb").close()
    old = time.time() - 3600
    os.utime(foreign_old, (old, old))
    os.utime(mine, (old, old))
    assert lay.collect_stale_temps(max_age_s=600) == 1
    assert not os.path.exists(foreign_old)
    assert os.path.exists(foreign_new) and os.path.exists(mine)  # young / own: kept
    for p in (mine, foreign_new):
        os.unlink(p)


def test_two_layouts_of_one_namespace_in_one_process(root, ns, tmp_path):
    """Two Layout objects of the same namespace in ONE process (e.g. vLLM's scheduler-side
    manager and worker in a single process) must both open. The writer liveness lock
    must not make the second constructor block on the first one's flock."""
    script = (
        "import sys\n"
        "from kvcache_core.layout import Layout, Namespace\n"
        f"ns = Namespace(**{dataclasses.asdict(ns)!r})\n"
        f"a = Layout({root!r}, ns)\n"
        f"b = Layout({root!r}, ns)\n"
        "assert a.write_block(b'k', b'v')\n"
        "assert b.exists(b'k') and b.read_block(b'k') == b'v'\n"
        "b.close(); a.close()\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=REPO)
    try:
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail("the second Layout(root, ns) in the same process blocked forever "
                    "(flock on .writers/<host>.<pid> already held by the first one)")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# --------------------------------------------------------------------------- bad roots

_NOBODY_SCRIPT = """
import json, sys
from kvcache_core.layout import Layout, LayoutError, Namespace
try:
    Layout(sys.argv[1], Namespace("m", "bf16", 16, 4096))
except LayoutError as e:
    print(json.dumps({"cls": "LayoutError", "errno": e.errno, "msg": str(e)}))
except Exception as e:
    print(json.dumps({"cls": type(e).__name__, "errno": None, "msg": str(e)}))
else:
    print(json.dumps({"cls": None, "errno": None, "msg": ""}))
"""


def _layout_error_as_nobody(path: str) -> dict:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root and setpriv is unavailable: cannot drop privileges")
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONDONTWRITEBYTECODE="1")
    cmd = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
           "-c", _NOBODY_SCRIPT, path]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    if out.returncode != 0 or not out.stdout.strip():
        pytest.skip(f"cannot run python as uid 65534 here: {out.stderr.strip()[-300:]}")
    return json.loads(out.stdout)


@pytest.fixture
def public_dir():
    """A directory that uid 65534 can traverse (pytest's tmp_path is 0700 root-only)."""
    d = tempfile.mkdtemp(prefix="kvcache-perm-")
    os.chmod(d, 0o755)
    yield d
    for dirpath, dirnames, _ in os.walk(d):
        for n in dirnames:
            os.chmod(os.path.join(dirpath, n), 0o755)
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("which", ["root_itself", "child_of_root"])
def test_unwritable_root(public_dir, which):
    ro = os.path.join(public_dir, "readonly")
    os.mkdir(ro)
    target = ro if which == "root_itself" else os.path.join(ro, "cache")
    if os.geteuid() == 0:
        os.chown(ro, 65534, 65534)
        os.chmod(ro, 0o500)
        res = _layout_error_as_nobody(target)
    else:
        os.chmod(ro, 0o500)
        try:
            Layout(target, Namespace("m", "bf16", 16, 4096))
        except LayoutError as e:
            res = {"cls": "LayoutError", "errno": e.errno, "msg": str(e)}
        else:
            res = {"cls": None, "errno": None, "msg": ""}
    assert res["cls"] == "LayoutError", res
    assert res["errno"] == errno.EACCES, res
    assert target in res["msg"] and "root_dir" in res["msg"], res
    expect = "not writable" if which == "root_itself" else "cannot be created"
    assert expect in res["msg"], res
    assert os.listdir(ro) == []  # nothing was created


def test_root_below_a_regular_file(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    target = str(f / "cache")
    with pytest.raises(LayoutError) as ei:
        Layout(target, Namespace("m", "bf16", 16, 4096))
    assert ei.value.errno == errno.ENOTDIR
    assert target in str(ei.value)


def test_root_that_is_a_regular_file(tmp_path):
    """A root that exists as a regular file must say so ('is not a directory', ENOTDIR),
    not report a failed creation ('cannot be created: File exists')."""
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(LayoutError) as ei:
        Layout(str(f), Namespace("m", "bf16", 16, 4096))
    msg = str(ei.value)
    assert str(f) in msg
    assert ei.value.errno == errno.ENOTDIR, msg
    assert "not a directory" in msg, msg
    assert f.read_bytes() == b"x"


# --------------------------------------------------------------------------- the ledger file
_LEDGER_RACER = r"""
import os, sys, time
from kvcache_core.layout import Ledger
path, go, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
while not os.path.exists(go):
    time.sleep(0.0005)
led = Ledger(path, coherent=True)
for _ in range(n):
    led.add(1)
st = os.fstat(led._fd)
print(st.st_ino, led.coherent)
led.close()
"""


def test_ledger_created_by_many_processes_at_once_is_one_file(tmp_path):
    """Eight processes open a coherent ledger that does not exist yet, at the same
    moment (created by hard-linking a private file: no concurrent create of one name,
    the GlusterFS race in ``_open_or_link``'s docstring), each adds 1 a hundred times:
    all count in one file, the total is exact, no private file is left behind."""
    path = str(tmp_path / ".usage")
    go = str(tmp_path / "go")
    env = dict(os.environ, PYTHONPATH=REPO)
    procs = [subprocess.Popen([sys.executable, "-c", _LEDGER_RACER, path, go, "100"],
                              env=env, stdout=subprocess.PIPE, text=True) for _ in range(8)]
    time.sleep(0.5)
    open(go, "w").close()
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0] * 8
    inos = {o[0] for o in outs}
    assert inos == {str(os.stat(path).st_ino)}, outs  # one file, the one at the path
    from kvcache_core.layout import Ledger
    led = Ledger(path, coherent=True)
    try:
        assert led.get() == 800
    finally:
        led.close()
    assert sorted(os.listdir(tmp_path)) == [".usage", "go"]


def test_coherent_ledger_replaces_a_symlink_and_never_follows_it(tmp_path):
    from kvcache_core.layout import Ledger
    target = tmp_path / "elsewhere"
    target.write_bytes(b"precious")
    path = tmp_path / ".usage"
    os.symlink(target, path)
    led = Ledger(str(path), coherent=True)
    try:
        assert led.replaced and not os.path.islink(path)
        led.add(5)
        assert led.get() == 5
    finally:
        led.close()
    assert target.read_bytes() == b"precious"


@pytest.mark.parametrize("coherent", [False, True])
def test_removed_ledger_is_reattached_and_recounted(make_layout, ns, coherent):
    """``.usage`` removed while a bounded Layout runs (an operator's ``rm``, or a
    distributed filesystem losing a concurrent create): a second Layout opened after it
    counts in a fresh ledger. The first one's evictor notices (one lstat per pass),
    reopens the ledger at the path and recounts it from the files on disk; from then on
    both count in one file and the bound holds."""
    fb = ns.file_bytes
    bound = 8 * fb
    a = make_layout(max_disk_bytes=bound, rescan_interval_s=0.05, coherent_ledger=coherent)
    for i in range(3):
        a.write_block(f"a{i}".encode(), payload(f"a{i}".encode(), BLOCK))
    os.unlink(os.path.join(a.base, ".usage"))
    b = make_layout(max_disk_bytes=bound, rescan_interval_s=0.05, coherent_ledger=coherent)
    deadline = time.monotonic() + 20
    while a.stats.ledger_reattached == 0:
        assert time.monotonic() < deadline, "the evictor did not reattach the ledger"
        time.sleep(0.02)
    assert a.stats.ledger_reattached == 1 and b.stats.ledger_reattached == 0
    with a.ledger.locked():  # (a coherent ledger keeps its value in an attribute)
        assert a.ledger.get() == published_bytes(a.base) == 3 * fb
    assert b.ledger.get() == 3 * fb  # the same file (never nest two fds' flocks)
    for i in range(12):  # both write: one ledger, one bound
        for lay, tag in ((a, "a"), (b, "b")):
            k = f"{tag}-more-{i}".encode()
            lay.write_block(k, payload(k, BLOCK))
            with lay.ledger.locked():
                ledger, published = lay.ledger.get(), published_bytes(lay.base)
            assert ledger == published <= bound, (i, tag, ledger, published)
    assert a.stats.evicted_files + b.stats.evicted_files > 0


def test_namespace_whose_directory_vanishes_under_its_first_mkdir_is_made_again(
        root, ns, monkeypatch):
    """The losing side of two clients' concurrent ``mkdir`` of a new namespace on
    GlusterFS: its ``mkdir`` of the namespace "worked", then the ``mkdir`` of ``.writers``
    inside fails with ENOENT (the directory is not where its client thinks; a CI run
    lost a writer process to it). Reproduced here by removing the namespace directory
    between the two ``mkdir`` calls: the Layout makes the pair again and opens; a race
    that outlasts the retry deadline, or ENOENT that never ends, is a LayoutError naming
    the root."""
    import kvcache_core.layout as lay_mod

    real_mkdir = os.mkdir
    vanished: list[str] = []

    def racing_mkdir(path, mode=0o777, *a, **kw):
        if str(path).endswith("/.writers") and not vanished:
            os.rmdir(os.path.dirname(path))  # the other client's view wins
            vanished.append(str(path))
        return real_mkdir(path, mode, *a, **kw)

    monkeypatch.setattr(lay_mod.os, "mkdir", racing_mkdir)
    lay = Layout(root, ns)
    try:
        assert vanished and os.path.isdir(os.path.join(lay.base, ".writers"))
        assert lay.write_block(b"k", payload(b"k", BLOCK))
        assert lay.read_block(b"k") == payload(b"k", BLOCK)
    finally:
        lay.close()

    def never_there(path, mode=0o777, *a, **kw):
        if str(path).endswith("/.writers"):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        return real_mkdir(path, mode, *a, **kw)

    monkeypatch.setattr(lay_mod.os, "mkdir", never_there)
    monkeypatch.setattr(lay_mod, "MKDIR_RACE_S", 0.2)
    other = dataclasses.replace(ns, model="other/model")
    t0 = time.monotonic()
    with pytest.raises(LayoutError, match="cannot initialise namespace directory") as ei:
        Layout(root, other)
    assert ei.value.errno == errno.ENOENT and root in str(ei.value)
    assert time.monotonic() - t0 < 5


def test_ledger_reopens_a_descriptor_that_went_bad(tmp_path, monkeypatch):
    """GlusterFS: the clients of one mount that lost a concurrent ``mkdir`` of the
    namespace hold fds under a directory id the server never recorded, and about a second
    later ``flock`` on the ledger's fails with EBADFD (a CI run lost all three writers of
    a mount to it). The ledger reopens its file by name and goes on, counting in the file
    the name points to; any other error, or a descriptor still bad after the race window,
    is raised."""
    from kvcache_core import layout as L

    led = L.Ledger(str(tmp_path / ".usage"))
    try:
        led.add(100)
        real = L.fcntl.flock
        bad = {"n": 2}

        def flaky(fd, op):
            if op == L.fcntl.LOCK_EX and bad["n"]:
                bad["n"] -= 1
                raise OSError(errno.EBADFD, "File descriptor in bad state")
            return real(fd, op)

        monkeypatch.setattr(L.fcntl, "flock", flaky)
        assert led.add(5) == 105 and led.reopened == 2
        assert led.get() == 105  # the reopened descriptor counts in the same file

        def broken(fd, op):
            raise OSError(errno.EIO, "I/O error")

        monkeypatch.setattr(L.fcntl, "flock", broken)
        with pytest.raises(OSError) as ei:
            led.add(1)
        assert ei.value.errno == errno.EIO and led.reopened == 2  # not a race: raised

        def always_bad(fd, op):
            raise OSError(errno.EBADFD, "File descriptor in bad state")

        monkeypatch.setattr(L, "MKDIR_RACE_S", 0.05)
        monkeypatch.setattr(L.fcntl, "flock", always_bad)
        with pytest.raises(OSError) as ei:
            led.add(1)
        assert ei.value.errno == errno.EBADFD  # bad past the window: raised
        monkeypatch.setattr(L.fcntl, "flock", real)
        assert led.get() == 105
    finally:
        led.close()
