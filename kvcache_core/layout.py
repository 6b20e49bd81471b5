"""Hash-addressed file layout: one storage block = one file.

Directory structure::

    <root>/v<FORMAT>-<namespace digest>/          one namespace (model, dtype, geometry, rank)
        meta.json                                 the namespace, human readable
        .usage                                    shared byte ledger (8 bytes, flock-protected;
                                                  on FUSE in its user.py-kvcache.ledger xattr)
        .writers/<host>.<pid>                     liveness lock of every writer process
        ab/cd/<xxh3-128 of key>                   published blocks
        ab/cd/.tmp.<host>.<pid>.<n>               files being written (never read)

File format: a 4096-byte header (:data:`HEADER_FMT`: magic, format version, payload
length, block geometry, namespace digest, the full key, xxh3-64 of the payload and of
the header itself) followed by the payload, padded to 4096 bytes so that the whole file
can be read or written with O_DIRECT in one request into a staging slot.

Contracts:

* Publish is atomic: a file is written under a unique temp name in its final directory
  (``O_CREAT|O_EXCL``), optionally ``fdatasync``-ed (``durable``), then hard-linked to its
  final name (fails if the name exists: no replacement, exact accounting) and the temp
  name unlinked. A reader never sees a partial file under a final name.
  ``publish_method="rename"`` (distributed filesystems where a fresh hard link can be seen
  empty or not at all from another client, e.g. a GlusterFS distribute volume) renames the
  complete temp instead, after an existence check under the ledger lock: first writer
  wins there too (:meth:`Layout.publish`). ``"auto"`` picks rename on FUSE mounts.
* Lookup is an existence check (``access``), no open. On a distributed filesystem it
  answers from the client's metadata cache: a block another node published or evicted
  less than the cache's lifetime ago (GlusterFS: ~1 s) may be reported absent or present;
  a load of a block found present but gone is a miss (:meth:`Layout.read_block`).
* ``max_disk_bytes`` bounds the published bytes of the namespace across all processes that
  share it (ledger in ``.usage`` under ``flock``). The bound is exact: every publish checks
  ``ledger + size <= max_disk_bytes`` under the ledger lock (link/rename + add in the same
  critical section), so the published bytes never exceed it, whatever the number of
  processes, as long as they all use the same ``max_disk_bytes``. It holds across hosts
  too (one cluster-wide bound) on a shared filesystem whose ``flock`` is exclusive across
  clients, provided every client reads the ledger's last write under the lock: on FUSE
  mounts (GlusterFS) the ledger lives in an extended attribute for that (:class:`Ledger`)
  and eviction asks the server whether a file is still there before it counts its unlink
  (:meth:`Layout._removed_elsewhere`); tests/test_glusterfs_cluster.py. Temp files being
  written are not counted (at most the writers' in-flight writes, each one block). A
  store that cannot be made to fit is dropped and counted (``dropped_over_capacity``: a
  block larger than the bound; ``dropped_full``: no eviction candidate freed enough room
  within one bounded batch), never waited for. See "Eviction" below.
* Temp files of crashed writers are collected when a process opens the layout: every
  writer holds an exclusive ``flock`` on ``.writers/<host>.<pid>``; an entry whose lock can
  be taken belongs to a dead writer, whose temp files are removed. On a shared filesystem
  whose ``flock`` is exclusive across clients (GlusterFS) this holds across hosts: a live
  writer of another node is never collected, a killed one is (its client releases the
  lock when the process dies; a whole node that dies keeps its locks until the server
  drops its connection).
* A :class:`Layout` is used by one thread at a time for mutations (the reactor thread);
  :meth:`Layout.exists` and :meth:`Layout.path_for` may be called from any thread. With
  ``max_disk_bytes`` a Layout also runs its own daemon thread, the evictor (below), which
  shares only the candidate heap (own lock) and the ledger (its lock) with the caller's
  thread; :meth:`Layout.close` stops and joins it.

Eviction (global LRU with shared recency):

* Recency is the file's mtime, shared by every process: a publish sets it, every read hit
  sets it to now (:meth:`Layout.touch`, ``utime`` without following links), whichever
  process reads. Eviction removes the files of smallest mtime first, whoever published
  them. Across hosts the order is as fresh as the evicting client's view of the mtimes
  (GlusterFS with default volume options: a touch on another node shows after ~1 s, at
  once with ``features.cache-invalidation`` on) and as the hosts' clocks agree (a touch
  writes the reader's clock).
* Each Layout keeps an in-memory min-heap of candidates ``(mtime, path)``, rebuilt by
  :meth:`Layout.scan`: a ``scandir`` + ``lstat`` walk of the namespace WITHOUT the ledger
  lock (publishers of other processes are never held up by it), run at construction and
  then only on the evictor thread: every ``rescan_interval_s`` while the ledger is above
  75% of the bound, and soon (no sooner than ``MIN_RESCAN_GAP_S`` and ``SCAN_DUTY`` times
  the last scan's duration after the previous one) after an eviction found
  the heap empty or holding only files newer than the last scan (i.e. no longer a global
  order: files other processes published since are not in it). Files this Layout
  publishes are pushed on the heap at once. ``stats.rescans`` counts the walks.
* Unlinking takes the ledger lock for one batch of at most :data:`EVICT_BATCH` candidates
  (plus :data:`STALE_BATCH` found already gone, one failed ``lstat`` each): each is
  popped, ``lstat``-ed (never followed; a link, directory or vanished entry is skipped)
  and its mtime re-checked: a file touched since it was queued is pushed back with its
  new mtime instead (lazy re-ordering: a popped file whose mtime still matches is the
  least recent of all candidates), else renamed, in its directory, to a temp name of
  this writer (metadata only: ~0.02 ms where the unlink of a 28 MiB file takes ~10 ms,
  docs/results/cpu/evict-path.md) and
  its ``lstat`` size subtracted from the ledger; the evictor thread unlinks such evicted
  files later, outside the lock (:meth:`Layout._drain_evicted`), so neither the ledger
  lock nor a reactor that reserves room waits for the filesystem to free the blocks.
  Until then the disk holds more than the ledger says: the files renamed and not yet
  unlinked (not bounded by the layout; the evictor unlinks ~100 such 28 MiB files a
  second on the CPU machine, faster than the disks we measured write them); a writer
  that dies first leaves them as its temp files, collected with the rest of
  them. Temp files (``.tmp.*``) are never candidates: a live writer's temp is never
  unlinked by eviction.
* Hot path: :meth:`Layout.reserve` reads the ledger; above 95% of the bound it wakes the
  evictor thread, which evicts in the background (batches, the lock released between
  them) down to 90%; only when the block does not fit at all does the caller run ONE such
  batch itself (down to 90% of the bound minus the block); it never walks the
  namespace.
* A walk under the ledger lock (:meth:`Layout.resync`: ledger := bytes on disk) runs only
  when the ledger cannot be trusted: a replaced ``.usage`` (at open, or found by the
  evictor's per-pass check that the path still names its ledger, which it then reopens:
  :meth:`Layout._reattach_ledger`), a dead writer's collection, or on the evictor thread
  when the ledger stays over the target with no candidate left on disk (a writer killed
  between link and ledger update, a rename double count).
* Unlinking is safe for a reader that already holds the file open: on a local
  filesystem it keeps reading the unlinked inode; on a distributed filesystem whose
  clients do not keep an inode unlinked by another client alive (GlusterFS), the read
  fails (ESTALE / ENOENT) and is a miss, never a partial or wrong block.

Trust model (docs/security.md):

* Everything the layout creates is private by default: directories ``dir_mode`` (0700),
  files ``file_mode`` (0600), exactly, whatever the umask (an explicit ``chmod`` where the
  umask would strip bits). Existing directories and files keep their mode.
* Symbolic links inside the root are never followed: the namespace's files are opened
  with ``O_NOFOLLOW`` (a link where ``meta.json``, ``.usage`` or a writer lock belongs is
  replaced by a regular file, with a warning); every walk (eviction and ledger rescans,
  dead-writer collection, ``kvcache gc``/``inspect``) uses ``os.scandir`` entries without
  following links and skips a link (counted once in ``symlinks_skipped``, one warning),
  so nothing outside the root is ever entered, unlinked or touched.
* A root owned by another user is refused (:class:`LayoutError` naming ``root_dir``)
  unless ``allow_foreign_root``.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import heapq
import hmac
import itertools
import json
import logging
import os
import socket
import stat
import struct
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TypeVar

import blake3
import xxhash

from .config import check_mode
from .io.base import DEFAULT_FILE_MODE

log = logging.getLogger(__name__)
T = TypeVar("T")
FORMAT_VERSION = 1
MAGIC = b"PYKVCB\x00\x01"
ALIGN = 4096
HEADER_BYTES = 4096
MAX_KEY_BYTES = 64
# magic, version, header_bytes, payload_len, block_bytes, ns digest, key_len, key,
# payload xxh3-64, header xxh3-64 (over everything before it)
HEADER_FMT = struct.Struct(f"<8sIIQQ16sH{MAX_KEY_BYTES}sQ")
HEADER_HASH = struct.Struct("<Q")
#: byte offset of the payload checksum (the last field of HEADER_FMT)
_DIGEST_OFF = HEADER_FMT.size - 8
#: keyed integrity (``integrity_key_file``): a 32-byte keyed BLAKE3 over the header
#: fields and the payload, right after the header hash (zeros when no key is set)
MAC_OFF = HEADER_FMT.size + HEADER_HASH.size
MAC_BYTES = 32
TMP_PREFIX = ".tmp."
#: mode of every directory the layout creates unless ``dir_mode`` says otherwise
DEFAULT_DIR_MODE = 0o700
#: flags of every open of a namespace file: never through a symbolic link
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
#: most eviction candidates examined (lstat, then unlink or requeue) by one batch: bounds
#: the work of a reserve or publish on the hot path and each hold of the ledger lock
EVICT_BATCH = 32
#: most candidates found already gone (evicted by another process: one failed ``lstat``
#: each) that one batch skips on top of that
STALE_BATCH = 8 * EVICT_BATCH
#: eviction brings the ledger down to this fraction of ``max_disk_bytes`` (a reserve:
#: minus the block it makes room for)
LOW_WATER = 0.90
#: the evictor thread starts evicting in the background above this fraction
HIGH_WATER = 0.95
#: periodic candidate scans run only while the ledger is above this fraction
SCAN_WATER = 0.75
#: default period of the evictor's candidate scans (``Layout(rescan_interval_s=...)``)
RESCAN_INTERVAL_S = 2.0
#: shortest time between two candidate scans of one Layout (requested ones included)
MIN_RESCAN_GAP_S = 0.2
#: shortest gap before a store's own fallback walk (:meth:`Layout._fallback_scan`)
HOT_RESCAN_MIN_GAP_S = 0.002
#: longest a store waits for the evictor's scan in progress instead of walking itself
HOT_SCAN_WAIT_S = 0.05
#: and at least this many times the last scan's wall time: a Layout's scans take at most
#: ~1/(1+SCAN_DUTY) of its evictor thread's time; a big namespace or many processes
#: scanning on few cores (slower scans) make every process scan less often
SCAN_DUTY = 10.0


def scan_dir(path: str, sort: bool = False) -> list[os.DirEntry]:
    """Entries of directory ``path`` ([] when it vanished or is not a directory), sorted by
    name if ``sort``. Callers never follow links: they test ``is_symlink()`` /
    ``is_dir(follow_symlinks=False)`` on the entries."""
    try:
        with os.scandir(path) as it:
            entries = list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:  # removed by another client of a distributed filesystem
        if e.errno != errno.ESTALE:
            raise
        return []
    if sort:
        entries.sort(key=lambda e: e.name)
    return entries


def settled_isdir(path: str) -> bool:
    """Whether ``path`` is a directory, where a ``stat`` that races another client's
    ``mkdir`` of it on a distributed filesystem (ESTALE / ENOENT for up to about a
    second on GlusterFS) is retried (:func:`_retry_races`) before answering False."""
    try:
        return stat.S_ISDIR(_retry_races(lambda: os.stat(path)).st_mode)
    except OSError:
        return False


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class LayoutError(OSError):
    """The root directory cannot be used (missing parent, unwritable, not a directory,
    owned by another user, a symbolic link where a namespace directory belongs)."""


class CapacityExceeded(OSError):
    """A publish found the namespace full (``max_disk_bytes``) and could not evict enough
    within one bounded batch: the store is dropped (``errno`` EDQUOT, the temp file is
    already removed). Counted in ``LayoutStats.dropped_full``."""


class CorruptBlock(Exception):
    """A file's header or payload failed validation; the caller treats it as a miss."""


#: shortest accepted integrity key (bytes of ``integrity_key_file``)
MIN_KEY_BYTES = 16


def _mac_key(secret: bytes) -> bytes:
    """The 32-byte BLAKE3 key derived from an integrity secret of any length."""
    return blake3.blake3(secret, derive_key_context="py-kvcache 2026 block MAC").digest()


def integrity_key_id(secret: bytes) -> str:
    """A public 16-hex id of an integrity secret (it names the keyed namespace, so keyed
    and unkeyed instances, or two keys, never share files); reveals nothing of the key."""
    return blake3.blake3(secret, derive_key_context="py-kvcache 2026 key id").hexdigest()[:16]


def load_integrity_key(path: str) -> bytes:
    """The secret in ``integrity_key_file`` (whitespace around it stripped). Raises
    ConfigError naming the key when the file is missing, unreadable, a symbolic link,
    readable by every user (a secret it is not), or shorter than
    :data:`MIN_KEY_BYTES`."""
    from .config import ConfigError

    def bad(why: str) -> ConfigError:
        return ConfigError(f"py-kvcache config key 'integrity_key_file': {path!r} {why}")

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise bad(f"cannot be opened ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_mode & 0o004:
            raise bad("is readable by every user: chmod 0600 (or 0640 for a group that "
                      "shares the cache)")
        secret = f.read(1 << 16).strip()
    if len(secret) < MIN_KEY_BYTES:
        raise bad(f"holds {len(secret)} bytes; at least {MIN_KEY_BYTES} are needed "
                  "(e.g. head -c 32 /dev/urandom | base64 > FILE)")
    return secret


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the bytes of a block. Different namespace = different files.

    ``block_bytes`` is the payload size of one full storage block (all ranks' layouts
    included for this rank); ``block_size`` is tokens per storage block.
    """

    model: str
    dtype: str
    block_size: int
    block_bytes: int
    tp_rank: int = 0
    tp_size: int = 1
    kv_layout: str = ""

    def digest(self) -> bytes:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return xxhash.xxh3_128_digest(blob + FORMAT_VERSION.to_bytes(4, "little"))

    def dirname(self) -> str:
        return f"v{FORMAT_VERSION}-{self.digest().hex()[:16]}"

    @property
    def file_bytes(self) -> int:
        """Bytes of one file = bytes of one staging slot."""
        return HEADER_BYTES + round_up(self.block_bytes)


def current_umask() -> int:
    """The process's umask, read without changing it (``/proc/self/status``; elsewhere a
    set-and-restore, which is not thread-safe)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    m = os.umask(0o022)
    os.umask(m)
    return m


def _fix_dir_mode(path: str, mode: int, umask: int) -> None:
    """Give a just-created directory exactly ``mode`` where the umask stripped bits
    (through an ``O_NOFOLLOW`` fd: never the target of a link swapped in meanwhile)."""
    if not mode & umask:
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def make_dirs(path: str, mode: int = DEFAULT_DIR_MODE, umask: int | None = None) -> None:
    """``os.makedirs(path, exist_ok=True)`` where every directory this call creates,
    intermediate ones included, gets exactly ``mode`` whatever the umask. Existing
    directories (and symbolic links to directories among the parents: the caller's path)
    are left as they are. Raises OSError (ENOTDIR, EACCES...) like ``os.makedirs``.

    A ``mkdir`` failing with ENOENT / ESTALE under a parent that this call saw or made
    (another client of a distributed filesystem won a race for that parent: see
    :func:`_namespace_dirs`) starts the walk again, for up to :data:`MKDIR_RACE_S`."""
    umask = current_umask() if umask is None else umask
    _retry_races(lambda: _make_dirs_once(path, mode, umask))


def _make_dirs_once(path: str, mode: int, umask: int) -> None:
    """One walk of :func:`make_dirs`: the missing directories, outermost first."""
    missing: list[str] = []
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            continue  # another process made it: its creator sets its mode
        _fix_dir_mode(d, mode, umask)


#: an extended attribute that is never set: reading it asks a distributed filesystem's
#: server whether a file still exists (:meth:`Layout._removed_elsewhere`)
_PROBE_XATTR = "user.py-kvcache.probe"
#: longest a directory creation retries after losing a race with another client of a
#: distributed filesystem (:func:`_private_dir`)
MKDIR_RACE_S = 3.0
#: errors of a file or directory creation that lost a race with another client of a
#: distributed filesystem (stale entry of the losing client): worth a retry
_RACE_ERRNOS = (errno.ENOENT, errno.ESTALE)


def _retry_races(fn: Callable[[], T]) -> T:
    """``fn()``, called again while it raises OSError with an errno of
    :data:`_RACE_ERRNOS` (a create or lookup that lost a race with another client of a
    distributed filesystem), with growing pauses (10 ms doubling to 250 ms) for up to
    :data:`MKDIR_RACE_S`; then, or on any other error, the error is raised. ``fn`` must
    be safe to repeat (each call starts from what is on disk)."""
    delay, deadline = 0.01, time.monotonic() + MKDIR_RACE_S
    while True:
        try:
            return fn()
        except OSError as e:
            if e.errno not in _RACE_ERRNOS or time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.25)


def _close_quietly(fd: int) -> None:
    """Close ``fd``, ignoring the error a distributed filesystem may report when the
    file was removed by another client meanwhile (GlusterFS: ESTALE); Linux releases
    the descriptor whatever close returns."""
    with contextlib.suppress(OSError):
        os.close(fd)


def _private_dir(path: str, mode: int, umask: int) -> None:
    """Create directory ``path`` (its parent exists) with exactly ``mode``, or accept an
    existing real directory. A symbolic link (or anything else) there raises OSError
    (ELOOP / ENOTDIR): it is never followed.

    A ``mkdir`` that races another client's ``mkdir`` of the same name on a distributed
    filesystem (GlusterFS: ESTALE, or EEXIST then ENOENT / ESTALE while the other one is
    still in flight; the losing client's stale entry lasts up to about a second) is
    retried, with growing pauses, for up to :data:`MKDIR_RACE_S` before the error is
    raised."""
    delay, deadline = 0.01, time.monotonic() + MKDIR_RACE_S
    while True:
        try:
            os.mkdir(path, mode)
            break
        except FileExistsError:
            try:
                st = os.lstat(path)
            except OSError as e:
                if e.errno not in _RACE_ERRNOS or time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
                continue
        except OSError as e:
            if e.errno != errno.ESTALE or time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.25)
            continue
        if stat.S_ISDIR(st.st_mode):
            return
        if stat.S_ISLNK(st.st_mode):
            raise OSError(errno.ELOOP, f"{path} is a symbolic link (never followed)",
                          path) from None
        raise OSError(errno.ENOTDIR, f"{path} is not a directory", path) from None
    _fix_dir_mode(path, mode, umask)


def _namespace_dirs(base: str, mode: int, umask: int) -> None:
    """Create (or accept) the namespace directory ``base`` and its ``.writers`` with
    :func:`_private_dir`, retrying the pair for up to :data:`MKDIR_RACE_S` when the
    second ``mkdir`` fails with ENOENT / ESTALE.

    On GlusterFS, when clients on two mounts ``mkdir`` the same new namespace at once, the
    losing client can be told that its ``mkdir`` worked under a directory id that the
    server never recorded (brick log: "setting gfid ... failed [File exists]"); its
    ``mkdir`` of ``.writers`` inside then fails (ESTALE, or ENOENT after the kernel's
    revalidation) until its entry for ``base`` expires (about a second). Another error,
    or a race outlasting the deadline, is raised (:func:`_retry_races`)."""
    def pair() -> None:
        _private_dir(base, mode, umask)
        _private_dir(os.path.join(base, ".writers"), mode, umask)

    _retry_races(pair)


def _remove_symlink(path: str) -> None:
    """Remove the symbolic link found where a namespace file belongs (the link itself,
    never its target), with a warning; its caller then creates a regular file there."""
    log.warning("py-kvcache: %s is a symbolic link; replacing the link (its target "
                "is never followed) with a regular file", path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _open_private(path: str, flags: int, mode: int, umask: int) -> tuple[int, bool]:
    """Open (``O_CREAT`` in ``flags``: or create) a namespace file without following a
    symbolic link. A file this call creates gets exactly ``mode``; an existing file keeps
    its mode. A link found at ``path`` is removed (the link itself, never its target,
    with a warning) and a regular file created in its place.

    Returns (fd, whether a link was replaced)."""
    flags |= _NOFOLLOW
    replaced = False
    for _ in range(8):
        try:
            if flags & os.O_CREAT:
                try:
                    fd = os.open(path, flags | os.O_EXCL, mode)
                except FileExistsError:
                    fd = os.open(path, flags & ~os.O_CREAT)
                else:
                    if mode & umask:
                        os.fchmod(fd, mode)
                return fd, replaced
            return os.open(path, flags), replaced
        except FileNotFoundError:
            if not flags & os.O_CREAT:
                raise
            continue  # removed between the two opens: create it
        except OSError as e:
            if e.errno != errno.ELOOP or not flags & os.O_CREAT:
                raise
            _remove_symlink(path)
            replaced = True
    raise OSError(errno.ELOOP, f"cannot create {path} (replaced repeatedly)", path)


PUBLISH_METHODS = ("link", "rename", "auto")
#: statfs f_type of FUSE mounts (GlusterFS, 3FS, Weka's client, JuiceFS, ...)
FUSE_SUPER_MAGIC = 0x65735546


def _mountinfo_fstype(path: str) -> str | None:
    """Filesystem type of the mount holding ``path`` from /proc/self/mountinfo (longest
    mount point that contains it), e.g. ``fuse.glusterfs``; None if unreadable."""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.readlines()
    except OSError:
        return None
    best, fstype = -1, None
    for line in lines:
        left, sep, right = line.partition(" - ")
        parts = left.split()
        if not sep or len(parts) < 5 or not right.split():
            continue
        mnt = parts[4].replace("\\040", " ").replace("\\011", "\t").replace(
            "\\012", "\n").replace("\\134", "\\")
        inside = path == mnt or mnt == "/" or path.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= best:  # a later equal-length line is a mount on top
            best, fstype = len(mnt), right.split()[0]
    return fstype


def _statfs_type(path: str) -> int | None:
    """statfs(2) ``f_type`` of ``path`` (Linux, through libc), None if unavailable."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
        if libc.statfs(os.fsencode(path), buf) != 0:
            return None
        return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
    except (OSError, AttributeError, ValueError):
        return None


def is_fuse(path: str) -> bool:
    """Whether ``path`` lies on a FUSE filesystem (mountinfo fstype ``fuse*``, else the
    statfs magic)."""
    real = os.path.realpath(path)
    fstype = _mountinfo_fstype(real)
    if fstype is not None:
        return fstype.startswith("fuse")
    return _statfs_type(real) == FUSE_SUPER_MAGIC


def resolve_publish_method(method: str, root: str) -> str:
    """``"link"`` or ``"rename"`` for ``method`` (``"auto"``: rename on FUSE, else link).
    Raises :class:`~kvcache_core.config.ConfigError` naming ``publish_method``."""
    if method not in PUBLISH_METHODS:
        from .config import ConfigError

        raise ConfigError(f"py-kvcache config key 'publish_method': must be link, rename or "
                          f"auto (got {method!r})")
    if method == "auto" and root:
        return "rename" if is_fuse(root) else "link"
    return method


def _host_tag() -> str:
    h = socket.gethostname() or "host"
    return "".join(c if c.isalnum() or c == "-" else "_" for c in h)[:40]


#: extended attribute of ``.usage`` that holds the ledger in coherent mode
LEDGER_XATTR = "user.py-kvcache.ledger"


def _open_or_link(path: str, mode: int, umask: int) -> tuple[int, bool]:
    """Open the file at ``path`` or, where there is none, create it WITHOUT a create of
    ``path`` itself: a private file (unique name next to it, ``O_EXCL``) is hard-linked
    to ``path`` (first link wins; a loser opens the winner's file) and its own name
    removed. Same contract as :func:`_open_private` (never through a symbolic link, a
    link found at ``path`` is replaced, a file this call creates gets exactly ``mode``).

    Why: two GlusterFS clients creating one name at the same moment can leave one of
    them holding a file that no name points to (the brick's ``posix_create`` gave the
    second create the first one's fresh file, then the first create, failing to set its
    gfid, unlinked the name; seen in a brick log as "setting gfid on .../.usage failed
    [File exists]"). A process holding that orphan counts its updates in a ledger nobody
    else reads: the bound drifted by half. ``link`` is atomic on the brick and its
    failure never removes an entry it did not make."""
    replaced = False
    tmp = f"{path}.{_host_tag()}.{os.getpid()}.{threading.get_ident()}.new"
    for _ in range(8):
        try:
            return os.open(path, os.O_RDWR | _NOFOLLOW), replaced
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            _remove_symlink(path)
            replaced = True
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a crashed namesake's leftover (maybe a link to an old ledger)
        fd = _open_private(tmp, os.O_RDWR | os.O_CREAT, mode, umask)[0]
        try:
            os.link(tmp, path)
        except FileExistsError:
            os.close(fd)  # another process made it first: open that one
            continue
        except BaseException:
            os.close(fd)
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return fd, replaced
    raise OSError(errno.ELOOP, f"cannot create {path} (replaced repeatedly)", path)


class Ledger:
    """Bytes published in a namespace, shared by processes through a locked file.

    Every update is a read-modify-write under an exclusive ``flock`` of the file, so it
    is exact among all processes whose ``flock`` is mutually exclusive AND whose reads
    under the lock see the last write of the previous holder:

    * one host (any local filesystem: one page cache), and NFS or CephFS clients, or
      Lustre mounted with ``-o flock`` (taking a lock revalidates the client's cache):
      the value is the file's first 8 bytes, read and written with ``pread`` /
      ``pwrite``;
    * FUSE clients of a distributed filesystem (GlusterFS): ``flock`` is exclusive across
      clients, but each client reads the file's bytes through its own caches (the
      kernel's page cache, GlusterFS's quick-read) and acknowledges writes before they
      reach the server (write-behind): two mounts lost about half of each other's
      updates. ``O_DIRECT | O_DSYNC`` reads and writes were exact on one-brick and
      distribute volumes but deadlocked a ``replica 2`` volume (the synchronous write of
      the lock holder waits for the replication lock that the waiting client keeps).
      ``coherent=True`` (the Layout's choice on FUSE) therefore keeps the value in an
      extended attribute of the file (:data:`LEDGER_XATTR`, 8 bytes little-endian):
      ``fgetxattr`` of a user attribute is answered by the server (GlusterFS's metadata
      cache keeps no user attributes unless told to in ``performance.xattr-cache-list``)
      and ``fsetxattr`` returns once the server stored it, on every volume type; one
      round trip each (~0.4 ms on a loopback volume). An absent attribute starts from
      the file's bytes (a namespace used in plain mode before); :meth:`close` copies the
      value back into them. Where the filesystem
      refuses user attributes it falls back to the plain mode with a warning (the ledger
      may then be inexact across clients): :attr:`coherent` says which one is in use.
      Every client of one namespace must use the same mode (``auto`` gives every FUSE
      client the coherent one).
    """

    def __init__(self, path: str, mode: int = DEFAULT_FILE_MODE, umask: int | None = None,
                 coherent: bool = False) -> None:
        """Open or create the ledger at ``path`` (never through a symbolic link; a file
        created here gets exactly ``mode``). ``replaced``: a link found there was replaced
        by a new, zeroed ledger (the owner should resync it from disk). ``coherent``:
        keep the value in an extended attribute, for the clients of a distributed
        filesystem (class docstring)."""
        umask = current_umask() if umask is None else umask
        self._mode, self._umask, self._coherent_open = mode, umask, coherent
        self._fd, self.replaced = self._open(path)
        self.path = path
        st = os.fstat(self._fd)
        #: (st_dev, st_ino) of the file this ledger counts in (:meth:`detached`)
        self.ident = (st.st_dev, st.st_ino)
        #: whether the value lives in :data:`LEDGER_XATTR` (exact across FUSE clients)
        self.coherent = False
        self._lock = threading.RLock()
        self._depth = 0
        #: times :meth:`_lock_file` replaced a descriptor that went bad
        self.reopened = 0
        self._stale_fds: list[int] = []  # those descriptors, closed by close()
        try:
            if coherent:
                self.coherent = self._probe_xattr(path)
            #: the total this process last read or wrote (no syscall to look at it: the
            #: worker reports it as the ``disk_bytes`` gauge from vLLM's engine thread)
            self.last = self._read()
        except BaseException:
            self.close()
            raise

    def detached(self) -> bool:
        """Whether :attr:`path` no longer names the file this ledger counts in (removed
        or replaced while open: an operator's ``rm``, a distributed filesystem's lost
        create): its updates then reach no other process. One ``lstat``; an error other
        than a missing name answers False (unknown). Any thread."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return (st.st_dev, st.st_ino) != self.ident

    def _probe_xattr(self, path: str) -> bool:
        """Whether the filesystem keeps user extended attributes on the ledger (read
        one; ENODATA means yes); logs a warning when it does not."""
        try:
            os.getxattr(self._fd, LEDGER_XATTR)
        except OSError as e:
            if e.errno != errno.ENODATA:
                if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM,
                                   errno.EACCES):
                    raise
                log.warning("py-kvcache: %s: no user extended attributes here (%s); the "
                            "byte ledger is kept in the file and may be inexact across "
                            "the clients of this filesystem", path, e.strerror or e)
                return False
        return True

    def _open(self, path: str) -> tuple[int, bool]:
        if self._coherent_open:  # a distributed filesystem's clients: no concurrent create
            return _open_or_link(path, self._mode, self._umask)
        return _open_private(path, os.O_RDWR | os.O_CREAT, self._mode, self._umask)

    def _lock_file(self) -> None:
        """``flock`` the ledger. An fd that lost its file (EBADFD / ESTALE: on GlusterFS
        the clients of one mount that lost a concurrent ``mkdir`` of the namespace keep
        fds under a directory id the server never recorded, and about a second later
        every operation on them fails; a CI run lost all three writers of a mount to
        it) is replaced by the file at :attr:`path`, opened again, with growing pauses
        for up to :data:`MKDIR_RACE_S`; what this process added to the lost file is not
        carried over (the evictor's rescan recounts the files on disk). Holds
        ``self._lock``."""
        delay, deadline = 0.01, time.monotonic() + MKDIR_RACE_S
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                return
            except OSError as e:
                if (e.errno not in (errno.EBADFD, errno.ESTALE)
                        or time.monotonic() + delay > deadline):
                    raise
                bad = e
            time.sleep(delay)
            delay = min(delay * 2, 0.25)
            try:
                fd, _ = self._open(self.path)
            except OSError as e:  # the name still in the stale window: try again
                if e.errno not in _RACE_ERRNOS + (errno.EBADFD,):
                    raise
                continue
            log.warning("py-kvcache: %s: the byte ledger's file descriptor went bad (%s); "
                        "reopened it", self.path, bad.strerror or bad)
            self._stale_fds.append(self._fd)  # an unlocked peek may still hold it
            self._fd = fd
            st = os.fstat(fd)
            self.ident = (st.st_dev, st.st_ino)
            self.reopened += 1

    @contextlib.contextmanager
    def locked(self):
        """Hold the ledger lock (across processes) for a compound update, e.g. link + add
        or walk + set. Re-entrant within one thread. A descriptor gone bad is reopened
        (:meth:`_lock_file`)."""
        with self._lock:
            if self._depth == 0:
                self._lock_file()
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _read(self) -> int:
        raw = b""
        if self.coherent:
            try:
                raw = os.getxattr(self._fd, LEDGER_XATTR)
            except OSError as e:  # never set: the plain value (0 for a new ledger)
                if e.errno != errno.ENODATA:
                    raise
        if len(raw) != 8:
            raw = os.pread(self._fd, 8, 0)
        return int.from_bytes(raw, "little", signed=True) if len(raw) == 8 else 0

    def _write(self, value: int) -> None:
        """Store ``value`` (the caller holds the lock)."""
        raw = int(value).to_bytes(8, "little", signed=True)
        if self.coherent:
            os.setxattr(self._fd, LEDGER_XATTR, raw)
        else:
            os.pwrite(self._fd, raw, 0)

    def add(self, delta: int) -> int:
        """Atomically add ``delta`` (may be negative) and return the new total."""
        with self.locked():
            new = max(0, self._read() + delta)
            if delta:
                self._write(new)
            self.last = new
            return new

    def set(self, value: int) -> None:
        with self.locked():
            self._write(value)
            self.last = int(value)

    def get(self) -> int:
        return self.add(0)

    def peek(self) -> int:
        """The ledger read WITHOUT the lock (one 8-byte ``pread`` or ``fgetxattr``): a
        hint for the evictor's decisions, never a base for an update."""
        self.last = self._read()
        return self.last

    def close(self) -> None:
        """Close the file. A coherent ledger first copies its value into the file's first
        8 bytes, for readers of the plain format (``kvcache inspect``, tests): the value
        as of the last close, not kept current while processes run. Read and written
        without the lock (the attribute is read whole; a data write of ``.usage`` under
        the lock could deadlock GlusterFS's replication, see the class docstring);
        errors are ignored (a dead mount)."""
        try:
            if self.coherent:
                with contextlib.suppress(OSError):
                    value = self._read()
                    os.pwrite(self._fd, value.to_bytes(8, "little", signed=True), 0)
        finally:
            os.close(self._fd)
            for fd in self._stale_fds:
                _close_quietly(fd)
            self._stale_fds.clear()


@dataclass
class LayoutStats:
    published: int = 0
    publish_existing: int = 0
    evicted_files: int = 0
    evicted_bytes: int = 0
    temp_collected: int = 0
    dropped_over_capacity: int = 0
    unlink_errors: int = 0  # files that could not be removed (EACCES, EIO...): skipped
    symlinks_skipped: int = 0  # distinct symbolic links found in the namespace, never followed
    #: stores dropped because the bound was reached and one eviction batch did not free
    #: enough room (no candidate ready: a rescan was requested); never waited for
    dropped_full: int = 0
    #: full walks of the namespace by this Layout: candidate scans (evictor thread and
    #: construction), ledger resyncs and dead-writer collections. Never on a reserve.
    rescans: int = 0
    #: of those, walks a store ran itself (candidates exhausted by other processes
    #: before the evictor's next scan; never under the ledger lock, rate-limited)
    rescans_hot: int = 0
    #: files evicted by the evictor thread in the background (part of evicted_files)
    evicted_background: int = 0
    #: times the evictor found ``.usage`` removed or replaced under it and reopened the
    #: ledger at its path, resynced from the files on disk (Layout._reattach_ledger)
    ledger_reattached: int = 0


class LayoutIndex:
    """Read-only view of a namespace: naming, lookup and header validation, no lock, no
    writes, no I/O at construction. Safe to create anywhere (e.g. vLLM's scheduler
    process or ``kvcache verify``) and to call from any thread."""

    def __init__(self, root: str, ns: Namespace, integrity_key: bytes | None = None) -> None:
        """``integrity_key`` (``integrity_key_file``'s bytes): blocks carry a keyed
        BLAKE3 over header and payload, and a block whose MAC does not verify (forged by a
        writer without the key, or written unkeyed) is corrupt: a miss, never a hit."""
        self.root = os.path.abspath(root)
        self.ns = ns
        self.base = os.path.join(self.root, ns.dirname())
        self._ns_digest = ns.digest()
        self._base_fd = -1  # O_PATH fd of base: lookups walk 3 path components, not ~10
        if integrity_key is not None and len(integrity_key) < MIN_KEY_BYTES:
            raise ValueError(f"integrity key shorter than {MIN_KEY_BYTES} bytes")
        self._mac_key = None if integrity_key is None else _mac_key(integrity_key)

    def _mac(self, slot: memoryview, payload_len: int) -> bytes:
        """Keyed BLAKE3 of the header fields (digest included) and the payload; BLAKE3
        hashes large inputs on several threads with the GIL released."""
        h = blake3.blake3(key=self._mac_key, max_threads=blake3.blake3.AUTO)
        h.update(slot[: HEADER_FMT.size])
        h.update(slot[HEADER_BYTES: HEADER_BYTES + payload_len])
        return h.digest()

    def name_of(self, key: bytes) -> str:
        return xxhash.xxh3_128_hexdigest(key)

    def path_for(self, key: bytes) -> str:
        """Final path of ``key`` (thread-safe, no I/O)."""
        h = xxhash.xxh3_128_hexdigest(key)
        return f"{self.base}/{h[:2]}/{h[2:4]}/{h}"

    def exists(self, key: bytes) -> bool:
        """True if ``key`` is published (one ``faccessat`` relative to the namespace
        directory, no open). Thread-safe."""
        h = xxhash.xxh3_128_hexdigest(key)
        fd = self._base_fd
        if fd < 0:
            fd = self._open_base()
            if fd < 0:
                return os.access(f"{self.base}/{h[:2]}/{h[2:4]}/{h}", os.F_OK)
        return os.access(f"{h[:2]}/{h[2:4]}/{h}", os.F_OK, dir_fd=fd)

    def _open_base(self) -> int:
        try:
            fd = os.open(self.base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return -1  # not created yet (e.g. scheduler before the first worker): retry later
        if self._base_fd < 0:
            self._base_fd = fd
        else:  # another thread won the race
            os.close(fd)
        return self._base_fd

    def check_identity(self, slot: memoryview, key: bytes) -> int:
        """Whether a DRAM-tier slot holds ``key``'s block of this namespace: magic,
        version, geometry and key (not the header hash nor the payload checksum, which
        :meth:`seal_header` may be rewriting meanwhile). Returns the payload length;
        raises :class:`CorruptBlock` otherwise."""
        fields = HEADER_FMT.unpack_from(slot, 0)
        if fields[0] != MAGIC:
            raise CorruptBlock("bad magic")
        return self._check_fields(fields, key)

    def _check_fields(self, fields: tuple, key: bytes) -> int:
        """The identity checks shared by :meth:`check_identity` and :meth:`check_block`
        on an unpacked header whose magic matched. Returns the payload length."""
        _magic, ver, hdr_bytes, payload_len, block_bytes, nsd, klen, kbytes, _dg = fields
        if ver != FORMAT_VERSION or hdr_bytes != HEADER_BYTES:
            raise CorruptBlock(f"format version {ver} not supported")
        if nsd != self._ns_digest or block_bytes != self.ns.block_bytes:
            raise CorruptBlock("header geometry does not match this namespace")
        if kbytes[:klen] != key:
            raise CorruptBlock("key mismatch (hash collision or misplaced file)")
        if payload_len > self.ns.block_bytes:
            raise CorruptBlock("payload longer than a block")
        return payload_len

    def check_block(self, slot: memoryview, nread: int, key: bytes, verify: bool = True) -> int:
        """Validate a file read into ``slot`` (``nread`` bytes). Returns the payload length.

        Raises :class:`CorruptBlock` on a short file, bad magic/version/header hash,
        other namespace or geometry, other key, or (``verify``) a payload checksum mismatch.
        """
        if nread < HEADER_BYTES:
            raise CorruptBlock(f"truncated header ({nread} bytes)")
        fields = HEADER_FMT.unpack_from(slot, 0)
        if fields[0] != MAGIC:
            raise CorruptBlock("bad magic")
        (hh,) = HEADER_HASH.unpack_from(slot, HEADER_FMT.size)
        if hh != xxhash.xxh3_64_intdigest(slot[: HEADER_FMT.size]):
            raise CorruptBlock("header checksum mismatch")
        payload_len = self._check_fields(fields, key)
        digest = fields[8]
        if nread < HEADER_BYTES + payload_len:
            raise CorruptBlock(f"truncated payload ({nread - HEADER_BYTES} of {payload_len})")
        if verify and digest != xxhash.xxh3_64_intdigest(
                slot[HEADER_BYTES: HEADER_BYTES + payload_len]):
            raise CorruptBlock("payload checksum mismatch")
        if self._mac_key is not None and not hmac.compare_digest(
                bytes(slot[MAC_OFF: MAC_OFF + MAC_BYTES]), self._mac(slot, payload_len)):
            # checked whatever ``verify`` says: xxh3 guards against accidents only
            raise CorruptBlock("integrity check failed (block not written with this "
                               "integrity_key_file)")
        return payload_len

    def close_index(self) -> None:
        if self._base_fd >= 0:
            os.close(self._base_fd)
            self._base_fd = -1


def _evictor_main(ref: weakref.ReferenceType, wake: threading.Event) -> None:
    """Body of a Layout's evictor thread (daemon). Holds only a weak reference between
    passes, so an unclosed Layout can still be collected. Sleeps on ``wake``: a rescan
    request or :meth:`Layout.close` sets it. Its work is syscalls (scandir, lstat,
    unlink, flock) that release the GIL; an exception is logged, never kills it."""
    while True:
        lay = ref()
        if lay is None or lay._evictor_stop:
            return
        timeout = lay._evictor_timeout()
        del lay
        wake.wait(timeout)
        wake.clear()
        lay = ref()
        if lay is None or lay._evictor_stop:
            return
        try:
            lay._evictor_pass()
        except Exception:  # keep evicting later; a bug here must not stop the cache
            log.exception("py-kvcache: evictor pass failed in %s", lay.base)
        del lay


_instances = itertools.count()
#: guards the one-warning-per-link bookkeeping (caller's and evictor threads)
_LINK_LOCK = threading.Lock()


class Layout(LayoutIndex):
    """File naming, header, atomic publish, lookup and the capacity bound of one namespace."""

    def __init__(self, root: str, ns: Namespace, *, max_disk_bytes: int = 0,
                 durable: bool = False, collect: bool = True,
                 dir_mode: int = DEFAULT_DIR_MODE, file_mode: int = DEFAULT_FILE_MODE,
                 allow_foreign_root: bool = False, publish_method: str = "link",
                 rescan_interval_s: float = RESCAN_INTERVAL_S,
                 integrity_key: bytes | None = None,
                 coherent_ledger: bool | None = None) -> None:
        """Open (creating what is missing) namespace ``ns`` under ``root``.

        ``max_disk_bytes`` > 0 bounds the namespace's published bytes (module docstring,
        "Eviction"): the candidates are scanned once here, and a daemon evictor thread is
        started (stopped by :meth:`close`) that rescans them every ``rescan_interval_s``
        while the namespace is nearly full, and evicts in the background.

        ``publish_method``: ``"link"`` (hard link, the default), ``"rename"`` (existence
        check + rename under the ledger lock; for distributed filesystems whose hard links
        are not published atomically) or ``"auto"`` (rename when the root is on a FUSE
        filesystem, else link); the choice is in :attr:`publish_method`.

        ``coherent_ledger``: keep the ``.usage`` ledger in an extended attribute that
        the server answers, so that it stays exact across the clients of a distributed
        filesystem whose clients cache file data (:class:`Ledger`), and check with the
        server before counting an eviction's unlink (:meth:`_removed_elsewhere`); None
        (default): on FUSE mounts only (GlusterFS...), where it is needed; local
        filesystems, NFS, CephFS and Lustre (``-o flock``) keep the plain ledger
        coherent under ``flock``.

        Directories created here and later (root and missing parents, namespace, shard
        directories) get exactly ``dir_mode``, files (temp and published blocks,
        ``meta.json``, ``.usage``, writer locks) exactly ``file_mode``, whatever the
        umask; both must keep the owner's rw(x) bits (ConfigError naming the key).
        Raises :class:`LayoutError` naming ``root_dir`` when the root is not a usable
        directory, is owned by another user (unless ``allow_foreign_root``) or holds a
        symbolic link where the namespace directory or its ``.writers`` belongs.
        """
        if ns.block_bytes <= 0:
            raise ValueError("Namespace.block_bytes must be > 0")
        resolve_publish_method(publish_method, "")  # a bad value fails before any mkdir
        self.dir_mode = check_mode(dir_mode, "dir_mode", 0o700)
        self.file_mode = check_mode(file_mode, "file_mode", 0o600)
        super().__init__(root, ns, integrity_key)
        self.max_disk_bytes = max_disk_bytes
        self.durable = durable
        self.stats = LayoutStats()
        self._warned_links: set[str] = set()
        umask = self._umask = current_umask()
        # Temp files are created DEFAULT_FILE_MODE (the I/O engines' mode, see
        # io.base.DEFAULT_FILE_MODE); publish() chmods them when that is not file_mode.
        self._chmod_tmp = (DEFAULT_FILE_MODE & ~umask) != self.file_mode
        if os.path.exists(self.root) and not settled_isdir(self.root):
            raise LayoutError(errno.ENOTDIR, f"py-kvcache root_dir '{root}' is not a directory")
        try:
            make_dirs(self.root, self.dir_mode, umask)
        except OSError as e:
            raise LayoutError(e.errno, f"py-kvcache root_dir '{root}' cannot be created: "
                              f"{e.strerror}") from e
        if not settled_isdir(self.root):
            raise LayoutError(errno.ENOTDIR, f"py-kvcache root_dir '{root}' is not a directory")
        owner = os.stat(self.root).st_uid
        if owner != os.geteuid() and not allow_foreign_root:
            raise LayoutError(errno.EPERM, f"py-kvcache root_dir '{root}' is owned by uid "
                              f"{owner}, not by this process's uid {os.geteuid()}: refusing a "
                              "cache root another user controls (set allow_foreign_root: "
                              "true to share it on purpose; see docs/security.md)")
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise LayoutError(errno.EACCES, f"py-kvcache root_dir '{root}' is not writable")
        self.publish_method = resolve_publish_method(publish_method, self.root)
        self._file_bytes = ns.file_bytes
        try:
            _namespace_dirs(self.base, self.dir_mode, umask)
        except OSError as e:
            raise LayoutError(e.errno, f"py-kvcache root_dir '{root}': cannot initialise "
                              f"namespace directory: {e.strerror}") from e
        if coherent_ledger is None:
            coherent_ledger = is_fuse(self.root)
        self.ledger = Ledger(os.path.join(self.base, ".usage"), self.file_mode, umask,
                             coherent=coherent_ledger)
        #: ledgers replaced by _reattach_ledger, closed by close()
        self._old_ledgers: list[Ledger] = []
        #: a distributed filesystem's client (coherent ledger): eviction checks with the
        #: server that a file is still there before it counts its unlink
        self._check_unlink = self.ledger.coherent
        try:
            # Under the ledger lock: processes opening the namespace at the same time never
            # rename onto meta.json concurrently (two GlusterFS clients doing that on a
            # distribute volume deadlocked inside DHT's rename, for good).
            with self.ledger.locked():
                self._write_meta()
        except OSError as e:
            self.ledger.close()
            raise LayoutError(e.errno, f"py-kvcache root_dir '{root}': cannot initialise "
                              f"namespace directory: {e.strerror}") from e
        except BaseException:
            self.ledger.close()
            raise
        # One writer entry per Layout instance (several may live in one process, e.g. vLLM's
        # scheduler and worker with multiprocessing off).
        self._tag = f"{_host_tag()}.{os.getpid()}.{next(_instances)}"
        self._writer_lock_path = os.path.join(self.base, ".writers", self._tag)
        self._writer_fd, _ = _open_private(self._writer_lock_path, os.O_RDWR | os.O_CREAT,
                                           self.file_mode, umask)
        fcntl.flock(self._writer_fd, fcntl.LOCK_EX)
        self._tmp_counter = itertools.count()
        self._made_dirs: set[str] = set()
        # Eviction candidates: heap of (mtime, path), guarded by _cand_lock (the evictor
        # thread swaps in a new scan; the caller's thread pops and pushes). Lock order:
        # the ledger lock, then _cand_lock; never the other way round.
        self._lru: list[tuple[float, str]] = []
        self._cand_lock = threading.Lock()
        self._recent: list[tuple[float, str]] = []  # own publishes while a scan runs
        self._scanning = False
        self._scan_wall = 0.0  # time.time() when the last scan started
        self._scan_mono = -1e9  # time.monotonic() when the last scan ended
        self._scan_gap = MIN_RESCAN_GAP_S  # shortest wait before the next scan
        self._scan_took = 0.0  # seconds the last scan took
        self._sole_writer = False  # the last scan saw no other writer of the namespace
        self._scan_wanted = False
        self.rescan_interval_s = float(rescan_interval_s)
        self._evictor: threading.Thread | None = None
        self._evictor_stop = False
        self._wake = threading.Event()
        #: evicted files renamed to temp names, for the evictor thread to unlink
        self._evicted: collections.deque[str] = collections.deque()
        if self.ledger.replaced:  # its count is lost: resync from the files on disk
            self.resync()
        if collect:
            self.collect_dead_writers()
        if max_disk_bytes:
            if not self.ledger.replaced:
                self.scan()
            self._evictor = threading.Thread(
                target=_evictor_main, args=(weakref.ref(self), self._wake),
                name=f"kvcache-evictor-{self._tag}", daemon=True)
            self._evictor.start()

    def _write_meta(self) -> None:
        """Write ``meta.json`` unless a regular one exists: through a private temp file
        (``O_EXCL|O_NOFOLLOW``) renamed over it, so a symbolic link found there is replaced,
        never written through."""
        meta = os.path.join(self.base, "meta.json")
        try:
            st = os.lstat(meta)
        except FileNotFoundError:
            st = None
        if st is not None:
            if stat.S_ISREG(st.st_mode):
                return
            if stat.S_ISLNK(st.st_mode):
                self._skip_link(meta)  # warn (and count); then replace the link itself
        tmp = f"{meta}.{_host_tag()}.{os.getpid()}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a crashed namesake's leftover (a link: the link itself)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, self.file_mode)
        try:
            if self.file_mode & self._umask:
                os.fchmod(fd, self.file_mode)
            with open(fd, "w", closefd=False) as f:
                json.dump({"format_version": FORMAT_VERSION, **asdict(self.ns)}, f, indent=1)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, meta)

    def _skip_link(self, path: str) -> None:
        """Note a symbolic link found where a cache directory or file belongs: counted and
        warned about once per path; the caller never follows it."""
        with _LINK_LOCK:  # the evictor thread walks the namespace too
            if path in self._warned_links:
                return
            self._warned_links.add(path)
            self.stats.symlinks_skipped += 1
        log.warning("py-kvcache: %s is a symbolic link where a cache file or directory "
                    "belongs; skipped (symbolic links in the cache root are never followed)",
                    path)

    # ------------------------------------------------------------------ naming
    def temp_path_for(self, key: bytes, remake: bool = False) -> tuple[str, str]:
        """(temp path, final path) for a new file of ``key``; creates the directory.

        The shard directories are created ``dir_mode``; a symbolic link found where one
        belongs raises OSError(ELOOP) (the store fails; nothing is written through it).
        Checked once per directory per instance (then cached: no syscall)."""
        final = self.path_for(key)
        d = final[: final.rfind("/")]
        if remake:  # a create in it failed with ENOENT/ESTALE: check and make it again
            self._made_dirs.discard(d)
        if d not in self._made_dirs:
            if self.publish_method == "rename":
                # Distributed filesystem: two clients racing to mkdir the same shard
                # directory can leave one with a stale entry (GlusterFS: ESTALE, ENOENT
                # for a second; on a replica volume its later lookups there missed a
                # published name, so first-writer-wins failed). The ledger lock
                # serializes these first mkdirs across clients; once per directory.
                with self.ledger.locked():
                    self._make_shard_dir(d)
            else:
                self._make_shard_dir(d)
            self._made_dirs.add(d)
        return f"{d}/{TMP_PREFIX}{self._tag}.{next(self._tmp_counter)}", final

    def create_temp(self, key: bytes, retry_s: float = 3.0) -> tuple[int, str, str]:
        """Create (``O_CREAT|O_EXCL``, write-only) a new temp file of ``key``; returns
        (fd, temp path, final path).

        ENOENT / ESTALE on the create are retried for up to ``retry_s`` seconds (shard
        directories made again, growing pauses): on GlusterFS, a client whose ``mkdir``
        of a shard directory lost a race with another client keeps a stale entry for it
        for about a second (its entry timeout), and creates in it fail until then. (The
        reactor's stores create their temps through the I/O engine: there such a store
        fails once, counted, and the block is simply not cached.)"""
        delay, deadline = 0.02, time.monotonic() + retry_s
        final = self.path_for(key)
        while True:
            try:
                tmp, final = self.temp_path_for(key)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW,
                             DEFAULT_FILE_MODE)
            except OSError as e:
                if e.errno not in _RACE_ERRNOS or time.monotonic() + delay > deadline:
                    raise
                self._made_dirs.discard(final[: final.rfind("/")])
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
                continue
            return fd, tmp, final

    def _make_shard_dir(self, d: str) -> None:
        for p in (d[: d.rfind("/")], d):
            try:
                _private_dir(p, self.dir_mode, self._umask)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    self._skip_link(p)
                raise

    # ------------------------------------------------------------------ header
    def fill_header(self, slot: memoryview, key: bytes, payload_len: int,
                    digest: bool = True) -> int:
        """Write the header for the payload already in ``slot[HEADER_BYTES:]``.

        Returns the number of bytes to write (header + padded payload). The slot is
        owned by the caller; nothing is kept. ``digest=False`` leaves the payload checksum
        0 (a DRAM-tier slot not yet written to disk: its identity fields are final, see
        :meth:`check_identity`); :meth:`seal_header` adds it before a file is written.
        """
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(f"key longer than {MAX_KEY_BYTES} bytes")
        total = HEADER_BYTES + round_up(payload_len)
        if total > len(slot):
            raise ValueError("payload does not fit the slot")
        pad = total - HEADER_BYTES - payload_len
        if pad:
            slot[HEADER_BYTES + payload_len: total] = bytes(pad)
        dg = (xxhash.xxh3_64_intdigest(slot[HEADER_BYTES: HEADER_BYTES + payload_len])
              if digest else 0)
        HEADER_FMT.pack_into(slot, 0, MAGIC, FORMAT_VERSION, HEADER_BYTES, payload_len,
                             self.ns.block_bytes, self._ns_digest, len(key), key, dg)
        hh = xxhash.xxh3_64_intdigest(slot[: HEADER_FMT.size])
        HEADER_HASH.pack_into(slot, HEADER_FMT.size, hh)
        if self._mac_key is not None:
            slot[MAC_OFF: MAC_OFF + MAC_BYTES] = (self._mac(slot, payload_len) if digest
                                                  else bytes(MAC_BYTES))
        return total

    def seal_header(self, slot: memoryview, payload_len: int) -> None:
        """Compute the payload checksum of a header written with ``digest=False`` and
        rewrite ONLY the checksum field and the header hash (the identity fields that a
        concurrent :meth:`check_identity` reads never change)."""
        dg = xxhash.xxh3_64_intdigest(slot[HEADER_BYTES: HEADER_BYTES + payload_len])
        struct.pack_into("<Q", slot, _DIGEST_OFF, dg)
        hh = xxhash.xxh3_64_intdigest(slot[: HEADER_FMT.size])
        HEADER_HASH.pack_into(slot, HEADER_FMT.size, hh)
        if self._mac_key is not None:
            slot[MAC_OFF: MAC_OFF + MAC_BYTES] = self._mac(slot, payload_len)

    # ------------------------------------------------------------------ publish
    def reserve(self, nbytes: int) -> bool:
        """Make room for ``nbytes`` under ``max_disk_bytes`` before a store is written.

        Hot path (reactor thread): reads the ledger; only when the block does not fit,
        runs ONE eviction batch (at most :data:`EVICT_BATCH` candidates, under the ledger
        lock) toward 90% of the bound minus the block. Never walks the namespace under the
        lock and never waits for room: a rescan it needs is requested from the evictor
        thread; only when no candidate is left at all (other processes evicted them) does
        it walk once itself, unlocked and rate-limited (:meth:`_fallback_scan`), before
        dropping the store.

        Returns False when the store must be dropped: the block is larger than the bound
        (``dropped_over_capacity``) or the batch did not free enough room
        (``dropped_full``). True is not a reservation: :meth:`publish` checks the bound
        again under the lock (another process may have filled the room meanwhile).
        """
        m = self.max_disk_bytes
        if not m:
            return True
        if nbytes > m:
            self.stats.dropped_over_capacity += 1
            return False
        used = self.ledger.get()
        if used > HIGH_WATER * m:
            self._kick_evictor()  # it makes room in the background, ahead of us
        if used + nbytes <= m:
            return True
        target = max(0, int(m * LOW_WATER) - nbytes)
        with self.ledger.locked():
            used = self._evict_locked(target, EVICT_BATCH)
        if used + nbytes > m and self._fallback_scan():
            with self.ledger.locked():
                used = self._evict_locked(target, EVICT_BATCH)
        if used + nbytes <= m:
            return True
        self.stats.dropped_full += 1
        return False

    def _fallback_scan(self) -> bool:
        """A store found no room after one batch (other processes evicted the files this
        Layout knew, or touched them, before the evictor's next scan): rather than drop
        it, walk the namespace here, WITHOUT the ledger lock (other processes keep
        publishing and evicting); while the evictor is scanning it waits for that scan
        instead (at most :data:`HOT_SCAN_WAIT_S`), and it walks at most
        ~1/SCAN_DUTY of the time (a 1 ms walk may repeat after 10 ms, a 200 ms walk of a
        huge namespace after 2 s). True when it ran (counted in ``rescans_hot``)."""
        # duty-cycle bound: at most ~1/SCAN_DUTY of the time walking (a 1 ms walk may
        # repeat after 10 ms, a 200 ms walk of a huge namespace after 2 s)
        gap = max(HOT_RESCAN_MIN_GAP_S, SCAN_DUTY * self._scan_took)
        if time.monotonic() - self._scan_mono < gap:
            return False
        with self._cand_lock:
            scanning = self._scanning
        if scanning:  # the evictor is walking right now: its fresh candidates will do
            end = time.monotonic() + HOT_SCAN_WAIT_S
            while self._scanning and time.monotonic() < end:
                time.sleep(0.001)
            return not self._scanning
        self.scan()
        self.stats.rescans_hot += 1
        return True

    def _admit_locked(self, final: str, nbytes: int) -> bool:
        """Under the ledger lock, just before a publish: whether ``nbytes`` more fit the
        bound, after at most one eviction batch. True as well when ``final`` already
        exists (the publish will count ``publish_existing``, adding nothing)."""
        m = self.max_disk_bytes
        if not m or self.ledger.get() + nbytes <= m or os.path.lexists(final):
            return True
        return self._evict_locked(max(0, m - nbytes), EVICT_BATCH) + nbytes <= m

    def _drop_full(self, tmp: str, nbytes: int) -> None:
        self.stats.dropped_full += 1
        self.discard(tmp)
        raise CapacityExceeded(errno.EDQUOT, f"py-kvcache: namespace full ({nbytes} bytes "
                               f"do not fit max_disk_bytes={self.max_disk_bytes})", tmp)

    def _push_candidate(self, final: str) -> None:
        """A file this Layout just published becomes an eviction candidate at once."""
        item = (time.time(), final)
        with self._cand_lock:
            heapq.heappush(self._lru, item)
            if self._scanning:  # the scan being built may have missed it: keep it
                self._recent.append(item)

    def publish(self, tmp: str, final: str, nbytes: int) -> bool:
        """Atomically publish ``tmp`` as ``final``. The temp name is always removed.

        Returns True if this call published the file, False if ``final`` already existed
        (identical content by construction; counted in ``publish_existing``).

        With ``max_disk_bytes``, the bound is checked under the ledger lock together with
        the link/rename and the ledger update (one eviction batch at most): when the block
        does not fit, the temp is removed and :class:`CapacityExceeded` (an OSError,
        EDQUOT) is raised: the store is dropped, counted in ``dropped_full``.
        """
        if self._chmod_tmp:  # the temp was created DEFAULT_FILE_MODE (engine default)
            os.chmod(tmp, self.file_mode)
        if self.publish_method == "rename":
            return self._publish_rename(tmp, final, nbytes)
        for attempt in (0, 1):
            with self.ledger.locked():  # check + link + add atomic w.r.t. other processes
                if self._admit_locked(final, nbytes):
                    try:
                        os.link(tmp, final)
                    except FileExistsError:
                        self.stats.publish_existing += 1
                        os.unlink(tmp)
                        return False
                    self.ledger.add(nbytes)
                    break
            # no room after one batch: one unlocked fallback walk, then once more
            if attempt or not self._fallback_scan():
                self._drop_full(tmp, nbytes)
        os.unlink(tmp)
        self.stats.published += 1
        if self.max_disk_bytes:
            self._push_candidate(final)
        return True

    def _publish_rename(self, tmp: str, final: str, nbytes: int) -> bool:
        """:meth:`publish` by rename: the temp is complete (written, closed, ``durable``:
        synced) before it gets its final name, so no reader ever sees a partial file.

        First writer wins as with ``link``: when ``final`` exists the temp is discarded and
        nothing is overwritten. Check, rename and ledger update happen under the ledger's
        ``flock``, which every publisher, eviction and rescan of the namespace holds too:
        between processes whose flock is coherent (one host; GlusterFS, NFSv4, CephFS
        across clients) no second rename can slip between the check and the rename, so a
        block is counted once in ``published`` and in the ledger, and every later writer
        counts ``publish_existing``.

        Where the lock is not coherent across clients (or a stale negative lookup hides a
        just-published name), two writers may both find the name free and both rename. The
        loser then replaces the winner's file with the SAME content: blocks are content
        addressed (the name is the hash of the key, the key is the hash of the token prefix
        and the namespace, the header carries the key and the payload's checksum), so the
        replacement is the identical block, and a reader that already opened the first
        inode keeps reading a complete, valid file. Only the byte ledger can count such a
        block twice (over-count, never under-count): the next :meth:`resync` (the evictor
        finding the ledger over target with no candidate left, a dead writer's collection,
        or a reopened ``.usage``) sets it back to the bytes on disk.
        """
        for attempt in (0, 1):
            with self.ledger.locked():
                if os.path.lexists(final):
                    self.stats.publish_existing += 1
                    self.discard(tmp)
                    return False
                if self._admit_locked(final, nbytes):
                    os.rename(tmp, final)
                    self.ledger.add(nbytes)
                    break
            if attempt or not self._fallback_scan():  # as in publish()
                self._drop_full(tmp, nbytes)
        self.stats.published += 1
        if self.max_disk_bytes:
            self._push_candidate(final)
        return True

    def discard(self, tmp: str) -> None:
        """Remove an unpublished temp file (write failed or was cancelled)."""
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        except OSError as e:  # e.g. EACCES in a root shared by several users
            self.stats.unlink_errors += 1
            log.warning("py-kvcache: cannot remove %s: %s", tmp, e.strerror or e)

    def touch(self, key: bytes) -> None:
        """Mark ``key`` recently used (called after a read hit)."""
        if self.max_disk_bytes:
            # explicit fine-grained time: utime(NULL) takes the kernel's coarse clock (one
            # tick, ~4 ms), which can be EARLIER than the time.time() this process recorded
            # when it published the file, so a touch right after a publish was lost
            now = time.time()
            try:  # a symbolic link's own times, never its target's
                os.utime(self.path_for(key), (now, now), follow_symlinks=False)
            except OSError:
                pass

    def remove(self, key: bytes) -> None:
        """Remove a published file (e.g. found corrupt), keeping the ledger exact."""
        path = self.path_for(key)
        with self.ledger.locked():
            try:
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):  # never counted in the ledger: leave it
                    self._skip_link(path)
                    return
                size = st.st_size
                if self._removed_elsewhere(path):
                    return
                os.unlink(path)
            except FileNotFoundError:
                return
            except OSError as e:  # EACCES/EPERM/EIO: keep serving (the file stays a miss)
                self.stats.unlink_errors += 1
                log.warning("py-kvcache: cannot remove %s: %s", path, e.strerror or e)
                return
            self.ledger.add(-size)

    def _removed_elsewhere(self, path: str) -> bool:
        """Whether the server no longer holds ``path`` although this client's metadata
        cache still shows it (another node removed it within the cache's lifetime).
        Only on a distributed filesystem's client (``coherent_ledger``); False
        elsewhere and when the answer is unknown.

        Needed because a GlusterFS distribute volume answers SUCCESS to the unlink of a
        file that another client already removed: counting that unlink would subtract
        the file's bytes from the ledger a second time, and an undercounting ledger lets
        the published bytes exceed ``max_disk_bytes``. Checked with one ``lgetxattr`` of
        an attribute that is never set, which GlusterFS answers from the server (the
        metadata cache keeps no user attributes by default): ENODATA means the file is
        there, ENOENT / ESTALE that it is gone. The caller holds the ledger lock, under
        which every removal of a published file happens, so a file found there is still
        there at its own unlink."""
        if not self._check_unlink:
            return False
        try:
            os.getxattr(path, _PROBE_XATTR, follow_symlinks=False)
        except OSError as e:
            return e.errno in _RACE_ERRNOS
        return False

    # ------------------------------------------------------------------ eviction
    def _iter_files(self):
        """Yield os.DirEntry of every regular file (published and temp) in the namespace's
        shard directories. Never follows a symbolic link: a linked shard directory is not
        entered and a linked file not yielded (:meth:`_skip_link`)."""
        for top in scan_dir(self.base):
            if top.name.startswith("."):
                continue
            if top.is_symlink():
                self._skip_link(top.path)
                continue
            if not top.is_dir(follow_symlinks=False):
                continue
            for sub in scan_dir(top.path):
                if sub.is_symlink():
                    self._skip_link(sub.path)
                    continue
                if not sub.is_dir(follow_symlinks=False):
                    continue
                for e in scan_dir(sub.path):
                    if e.is_file(follow_symlinks=False):
                        yield e
                    elif e.is_symlink():
                        self._skip_link(e.path)

    def scan(self) -> tuple[int, int]:
        """Rebuild the eviction candidates from disk; returns (files, bytes) published.

        A ``scandir`` + ``lstat`` walk WITHOUT the ledger lock (other processes keep
        publishing and evicting meanwhile: the result is a snapshot, used only to order
        candidates, never to set the ledger; :meth:`resync` does that under the lock).
        Temp files are not candidates; links are never followed. Files this Layout
        publishes during the walk are kept. Runs at construction and on the evictor
        thread, or from tools; from a store (reserve, publish) only as
        :meth:`_fallback_scan`.
        Counted in ``stats.rescans``.
        """
        started = time.time()
        with self._cand_lock:
            self._scanning = True
        lru: list[tuple[float, str]] = []
        total = 0
        try:
            for e in self._iter_files():
                if e.name.startswith(TMP_PREFIX):
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError as err:  # removed meanwhile (ESTALE: by another client)
                    if err.errno not in _RACE_ERRNOS:
                        raise
                    continue
                lru.append((st.st_mtime, e.path))
                total += st.st_size
            n = len(lru)
            writers = len(scan_dir(os.path.join(self.base, ".writers")))
            took = time.time() - started
            heapq.heapify(lru)
        except BaseException:
            with self._cand_lock:
                self._scanning = False
                self._recent = []
            raise
        with self._cand_lock:  # one section: no publish falls between merge and swap
            self._scanning = False
            for item in self._recent:
                heapq.heappush(lru, item)
            self._recent = []
            self._lru = lru
            self._scan_wall = started
            self._sole_writer = writers <= 1
        self._scan_mono = time.monotonic()
        self._scan_took = max(0.0, took)
        self._scan_gap = max(MIN_RESCAN_GAP_S, SCAN_DUTY * self._scan_took)
        self.stats.rescans += 1
        return n, total

    def resync(self) -> int:
        """Set the ledger to the bytes of the published files on disk and rebuild the
        candidates: a walk UNDER the ledger lock (every publisher and evictor of the
        namespace waits for it). For a ledger that cannot be trusted (replaced
        ``.usage``, evictor finding it over target with nothing left to evict, tools);
        never called from :meth:`reserve`. Returns the bytes found."""
        with self.ledger.locked():
            total = self.scan()[1]
            self.ledger.set(total)
        return total

    def _evict_to(self, target: int) -> None:
        """Evict (batches, the ledger lock released between them) until the ledger is at
        most ``target`` or no candidate is left. Evictor thread or tools."""
        while True:
            with self.ledger.locked():
                used = self._evict_locked(target, EVICT_BATCH)
            self._drain_evicted()
            if used <= target or not self._lru or self._evictor_stop:
                return

    def _kick_evictor(self) -> None:
        """Wake the evictor thread for a pass now (any thread; an Event already set is
        left alone). No-op without an evictor (no bound, or closed)."""
        if self._evictor is not None and not self._wake.is_set():
            self._wake.set()

    def _drain_evicted(self) -> None:
        """Unlink the files eviction renamed away (evictor thread, tools, :meth:`close`;
        never the reactor's hot path). A name already gone (collected as a dead writer's
        temp by another process) is skipped; another error is counted and logged."""
        q = self._evicted
        while q:
            try:
                p = q.popleft()
            except IndexError:  # drained by another thread meanwhile
                return
            try:
                os.unlink(p)
            except OSError as e:
                if e.errno in _RACE_ERRNOS:
                    continue
                self.stats.unlink_errors += 1
                log.warning("py-kvcache: cannot remove evicted file %s: %s", p,
                            e.strerror or e)

    def _evict_locked(self, target: int, limit: int) -> int:
        """Under the ledger lock: pop at most ``limit`` candidates, least recent first,
        evicting (renaming away, for :meth:`_drain_evicted` to unlink) each whose mtime
        did not change since it was queued (a touched one is
        pushed back with its new mtime), until the ledger is at most ``target``. Returns
        the ledger. Requests a rescan when the heap runs out of globally ordered
        candidates."""
        used = self.ledger.get()
        lru, lock = self._lru, self._cand_lock
        examined = gone = 0
        while used > target and examined < limit and gone < STALE_BATCH:
            with lock:
                if lru is not self._lru:  # the evictor swapped in a new scan
                    lru = self._lru
                if not lru:
                    break
                mtime, path = heapq.heappop(lru)
            try:
                st = os.lstat(path)
            except OSError as err:  # evicted or removed by another process: cheap
                if err.errno not in _RACE_ERRNOS:
                    raise
                gone += 1
                continue
            examined += 1
            if not stat.S_ISREG(st.st_mode):  # replaced by a link since the scan: never ours
                if stat.S_ISLNK(st.st_mode):
                    self._skip_link(path)
                continue
            if st.st_mtime > mtime + 1e-6:  # touched since: requeue with its new age
                with lock:
                    heapq.heappush(self._lru, (st.st_mtime, path))
                continue
            if self._removed_elsewhere(path):  # another node evicted it: not ours to count
                continue
            # a temp name of this writer, same directory: the name is free at once (for
            # lookups, other evictors and a new publish of the key), the blocks are freed
            # by the evictor thread's unlink, outside the lock (module doc)
            gone_to = (f"{os.path.dirname(path)}/{TMP_PREFIX}{self._tag}."
                       f"{next(self._tmp_counter)}")
            try:
                os.rename(path, gone_to)
            except OSError as e:  # not ours to remove (another uid): skip it, keep going
                if e.errno in _RACE_ERRNOS:  # removed meanwhile
                    continue
                self.stats.unlink_errors += 1
                log.warning("py-kvcache: eviction cannot remove %s: %s", path,
                            e.strerror or e)
                continue
            self._evicted.append(gone_to)
            used = self.ledger.add(-st.st_size)
            self.stats.evicted_files += 1
            self.stats.evicted_bytes += st.st_size
            if threading.current_thread() is self._evictor:
                self.stats.evicted_background += 1
        if self._evicted:
            self._kick_evictor()  # it unlinks them
        if (examined or gone) and not self._scan_wanted and self._evictor is not None:
            with lock:
                lru = self._lru
                low = not lru or (not self._sole_writer and lru[0][0] >= self._scan_wall)
            if low:  # no global order left: the evictor rescans (never this thread)
                self._scan_wanted = True
                self._wake.set()
        return used

    # ------------------------------------------------------------------ evictor thread
    def _evictor_timeout(self) -> float:
        """Seconds the evictor sleeps before its next pass (a wanted rescan: until the
        minimum gap since the last scan has passed)."""
        if self._scan_wanted:
            return max(0.0, self._scan_mono + self._scan_gap - time.monotonic())
        return max(self.rescan_interval_s, self._scan_gap)

    def _evictor_pass(self) -> None:
        """One pass of the evictor thread: a candidate scan when one was requested or is
        due (ledger above 75% of the bound and the last one older than
        ``rescan_interval_s``), then background eviction above 95% down to 90%, and a
        ledger :meth:`resync` when it stays over that target with no candidate left."""
        self._drain_evicted()  # what a reserve evicted on its thread
        self._reattach_ledger()
        m = self.max_disk_bytes
        used = self.ledger.peek()
        now = time.monotonic()
        due = self._scan_wanted or (used >= SCAN_WATER * m and now - self._scan_mono
                                    >= max(self.rescan_interval_s, self._scan_gap))
        scanned = False
        if due and now - self._scan_mono >= self._scan_gap:
            self._scan_wanted = False
            self.scan()
            scanned = True
        if used > HIGH_WATER * m:
            target = int(LOW_WATER * m)
            self._evict_to(target)
            if self._evictor_stop:
                return
            if not self._lru and self.ledger.peek() > target:
                if not scanned:  # make sure the heap is empty because the disk is
                    self.scan()
                if not self._lru and self.ledger.peek() > target:
                    self.resync()

    def _reattach_ledger(self) -> bool:
        """When ``.usage`` no longer names the ledger this Layout counts in
        (:meth:`Ledger.detached`), open the one at the path (created if missing) and
        :meth:`resync` it from the files on disk; True when it did. Evictor thread (one
        ``lstat`` per pass) or tools. The old ledger stays open until :meth:`close`:
        another thread may be inside its lock; what it counts there is lost, and the
        resync, a walk under the new lock, counts its file instead."""
        old = self.ledger
        if not old.detached():
            return False
        new = Ledger(old.path, self.file_mode, self._umask, coherent=old.coherent)
        if new.ident == old.ident:  # the same file after all (an lstat that disagreed
            new.close()  # with fstat): two fds' flocks of one file would deadlock a thread
            return False
        log.warning("py-kvcache: %s was removed or replaced while in use; reopened the "
                    "byte ledger there, recounting it from the files on disk", old.path)
        self.ledger = new
        self._old_ledgers.append(old)
        self.stats.ledger_reattached += 1
        self.resync()
        return True

    # ------------------------------------------------------------------ crash recovery
    def collect_dead_writers(self) -> int:
        """Remove temp files of writer processes that died; returns files removed."""
        wdir = os.path.join(self.base, ".writers")
        dead: list[str] = []
        with os.scandir(wdir) as it:
            entries = list(it)
        for ent in entries:
            name = ent.name
            if name == self._tag:
                continue
            p = ent.path
            if ent.is_symlink():
                self._skip_link(p)
                continue
            try:
                fd = os.open(p, os.O_RDWR | _NOFOLLOW)
            except FileNotFoundError:
                continue
            except OSError as e:  # ELOOP (swapped for a link), EACCES (another uid's lock)
                if e.errno == errno.ELOOP:
                    self._skip_link(p)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                _close_quietly(fd)
                continue  # alive
            except OSError as e:
                _close_quietly(fd)
                if e.errno in _RACE_ERRNOS:
                    # unlinked since our open (its owner closed, or another process
                    # collected it): GlusterFS refuses a lock on a removed file
                    continue
                raise
            dead.append(name)
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile: same as above
                os.unlink(p)
            _close_quietly(fd)
        if not dead:
            return 0
        prefixes = tuple(f"{TMP_PREFIX}{d}." for d in dead)
        with self.ledger.locked():
            removed = self._collect_locked(prefixes)
        self.stats.temp_collected += removed
        return removed

    def _collect_locked(self, prefixes: tuple[str, ...]) -> int:
        removed = 0
        total = 0
        self.stats.rescans += 1
        for e in self._iter_files():
            if e.name.startswith(TMP_PREFIX):
                if e.name.startswith(prefixes):
                    try:
                        os.unlink(e.path)
                        removed += 1
                    except FileNotFoundError:
                        pass
                continue
            try:
                total += e.stat(follow_symlinks=False).st_size
            except OSError as err:  # removed meanwhile (ESTALE: by another client)
                if err.errno not in _RACE_ERRNOS:
                    raise
        # A writer killed between link and ledger update leaves the ledger low: resync.
        self.ledger.set(total)
        return removed

    def collect_stale_temps(self, max_age_s: float = 600.0) -> int:
        """Remove temp files older than ``max_age_s`` whatever their owner (``kvcache gc``)."""
        now = time.time()
        removed = 0
        for e in self._iter_files():
            if e.name.startswith(TMP_PREFIX) and not e.name.startswith(
                    f"{TMP_PREFIX}{self._tag}."):
                try:
                    if now - e.stat(follow_symlinks=False).st_mtime > max_age_s:
                        os.unlink(e.path)
                        removed += 1
                except FileNotFoundError:
                    pass
        self.stats.temp_collected += removed
        return removed

    def _stop_evictor(self, timeout: float = 30.0) -> None:
        t = self._evictor
        if t is None:
            return
        self._evictor_stop = True
        self._wake.set()
        if t is not threading.current_thread():
            t.join(timeout)
            if t.is_alive():  # a walk stuck on a hung filesystem: it is a daemon
                log.warning("py-kvcache: evictor thread of %s did not stop within %.0f s",
                            self.base, timeout)
        self._evictor = None

    # ------------------------------------------------------------------ simple sync API
    def write_block(self, key: bytes, payload: bytes | memoryview) -> bool:
        """Synchronous store (tests, tools): header + payload, atomic publish.

        Returns True if published, False if it existed or did not fit the bound
        (``dropped_over_capacity`` / ``dropped_full``).
        """
        if self.exists(key):
            return False
        buf = bytearray(self._file_bytes)
        mv = memoryview(buf)
        mv[HEADER_BYTES: HEADER_BYTES + len(payload)] = payload
        n = self.fill_header(mv, key, len(payload))
        if not self.reserve(n):
            return False
        fd, tmp, final = self.create_temp(key)
        try:
            done = os.write(fd, mv[:n])
            if done != n:  # a full filesystem shows up as a short write
                raise OSError(errno.ENOSPC, f"short write ({done} of {n} bytes)")
            if self.durable:
                os.fdatasync(fd)
        except BaseException:
            os.close(fd)
            self.discard(tmp)
            raise
        os.close(fd)
        try:
            return self.publish(tmp, final, n)
        except CapacityExceeded:  # counted in dropped_full; the temp is gone
            return False

    def read_block(self, key: bytes, verify: bool = True) -> bytes | None:
        """Synchronous load: payload bytes, or None on a miss or a corrupt file (removed).

        A file evicted by a client of another node while this one opens or reads it is a
        miss too: on GlusterFS the open or the read of a file that another client has
        unlinked fails with ESTALE (or ENOENT), where a local filesystem keeps serving
        the unlinked inode."""
        path = self.path_for(key)
        try:
            fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno in _RACE_ERRNOS:
                return None
            if e.errno != errno.ELOOP:
                raise
            self._skip_link(path)
            return None
        try:
            with open(fd, "rb") as f:
                data = f.read(self._file_bytes)
        except OSError as e:
            if e.errno in _RACE_ERRNOS:
                return None
            raise
        mv = memoryview(data)
        try:
            n = self.check_block(mv, len(data), key, verify)
        except CorruptBlock:
            self.remove(key)
            return None
        self.touch(key)
        return bytes(mv[HEADER_BYTES: HEADER_BYTES + n])

    def close(self) -> None:
        """Stop and join the evictor thread (it finishes at most its current batch or
        scan), then release the writer lock (a clean exit leaves no entry in
        ``.writers``). Call from the owner's thread, once the reactor is closed. Files
        eviction renamed away are unlinked first."""
        self._stop_evictor()
        self._drain_evicted()
        if self._writer_fd >= 0:
            try:
                os.unlink(self._writer_lock_path)
            except FileNotFoundError:
                pass
            _close_quietly(self._writer_fd)  # ESTALE on GlusterFS: the file is unlinked
            self._writer_fd = -1
            for old in self._old_ledgers:
                old.close()
            self._old_ledgers.clear()
            self.ledger.close()
            self.close_index()
