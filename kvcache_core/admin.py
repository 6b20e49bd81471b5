"""Read-only walks and namespace removal behind ``kvcache verify / purge / inspect``.

Nothing here opens a :class:`~kvcache_core.layout.Layout` (which creates the namespace
directory, ``meta.json``, ``.usage`` and a writer lock, and collects dead writers): the
walks only ``scandir``, ``lstat`` and open files ``O_RDONLY | O_NOFOLLOW`` (``O_NOATIME``
where allowed), so a verified or inspected root is left exactly as it was. Symbolic links
are never followed: a link where a namespace directory, shard directory, block, temp file,
ledger or writer lock belongs is reported and skipped.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .layout import (
    FORMAT_VERSION,
    HEADER_BYTES,
    HEADER_FMT,
    LEDGER_XATTR,
    TMP_PREFIX,
    CorruptBlock,
    LayoutIndex,
    Namespace,
    round_up,
    scan_dir,
)

#: name of a namespace directory: ``v<format version>-<16 hex digits of its digest>``
NS_DIR_RE = re.compile(r"v\d+-[0-9a-f]{16}")
#: prefix of a namespace directory being removed by ``kvcache purge`` (renamed first)
PURGE_PREFIX = ".kvcache-purge."
_RDONLY = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NOATIME = getattr(os, "O_NOATIME", 0)


class UsageError(Exception):
    """An operator mistake (missing root, not a cache root, unknown namespace...): the
    CLI prints it as one line and exits 2."""


# --------------------------------------------------------------------------- root


def check_root(root: str, allow_foreign_root: bool = True) -> str:
    """The absolute path of cache root ``root``, or :class:`UsageError`: missing, not a
    directory, a namespace directory given instead of its root, a non-empty directory
    without any ``v<N>-<digest>`` namespace directory (or leftover of a purge), or (unless
    ``allow_foreign_root``) owned by another user. An empty directory is an empty root."""
    path = os.path.abspath(root)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UsageError(f"{root} does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{root} is not a directory")
    if not allow_foreign_root and st.st_uid != os.geteuid():
        raise UsageError(f"root_dir '{root}' is owned by uid {st.st_uid}, not by this "
                         f"process's uid {os.geteuid()}: refusing a cache root another user "
                         "controls (--allow-foreign-root to act on it anyway)")
    names = os.listdir(path)
    if "meta.json" in names:
        raise UsageError(f"{root} is a namespace directory, not a cache root: give its "
                         f"parent and --namespace {os.path.basename(path)}")
    if names and not any(NS_DIR_RE.fullmatch(n) or n.startswith(PURGE_PREFIX)
                         for n in names):
        raise UsageError(f"{root} is not a cache root (no v<N>-<digest> namespace "
                         "directories in it)")
    return path


def namespace_entries(root: str) -> tuple[list[os.DirEntry], list[str]]:
    """(namespace directories, symbolic links) among ``root``'s entries named like a
    namespace, sorted by name. Links are reported, never followed."""
    with os.scandir(root) as it:
        entries = sorted(it, key=lambda e: e.name)
    dirs, links = [], []
    for e in entries:
        if not NS_DIR_RE.fullmatch(e.name):
            continue
        if e.is_symlink():
            links.append(e.path)
        elif e.is_dir(follow_symlinks=False):
            dirs.append(e)
    return dirs, links


def read_meta(base: str) -> tuple[dict | None, str | None]:
    """(``meta.json`` of namespace directory ``base``, None) or (None, why not)."""
    path = os.path.join(base, "meta.json")
    try:
        fd = os.open(path, _RDONLY)
    except FileNotFoundError:
        return None, "no meta.json"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None, "meta.json is a symbolic link (never followed)"
        return None, f"meta.json: {e.strerror}"
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, "meta.json is not a regular file"
        try:
            meta = json.loads(f.read(1 << 20))
        except (ValueError, OSError) as e:
            return None, f"meta.json unreadable: {e}"
    if not isinstance(meta, dict):
        return None, "meta.json is not a JSON object"
    return meta, None


def namespace_of(name: str, meta: dict) -> tuple[Namespace | None, str | None]:
    """(the :class:`Namespace` that ``meta.json`` describes, None) or (None, why it cannot
    be checked: other format version, unknown fields, another directory's namespace)."""
    if meta.get("format_version") != FORMAT_VERSION:
        return None, (f"format version {meta.get('format_version')!r} (this kvcache reads "
                      f"{FORMAT_VERSION})")
    try:
        ns = Namespace(**{k: v for k, v in meta.items() if k != "format_version"})
    except TypeError as e:
        return None, f"meta.json does not describe a namespace: {e}"
    if ns.dirname() != name:
        return None, f"meta.json describes namespace {ns.dirname()}, not {name}"
    return ns, None


# --------------------------------------------------------------------------- walks


@dataclass
class Walk:
    """What a read-only walk of one namespace directory found."""

    links: list[str] = field(default_factory=list)  # symbolic links (never followed)
    temps: list[str] = field(default_factory=list)  # temp files (writers live or dead)
    other: list[str] = field(default_factory=list)  # neither file, directory nor link


def iter_blocks(base: str, walk: Walk):
    """Yield (shard top name, shard sub name, os.DirEntry) of every regular published file
    in namespace directory ``base`` (like ``Layout._iter_files``: not following links).
    Temp files, links and odd entries are recorded in ``walk``; links and odd entries at
    the top level (``.usage``, ``.writers/*``) too."""
    for top in scan_dir(base, sort=True):
        if top.is_symlink():
            walk.links.append(top.path)
            continue
        if top.name == ".writers" and top.is_dir(follow_symlinks=False):
            with contextlib.suppress(FileNotFoundError, NotADirectoryError), \
                    os.scandir(top.path) as it:
                walk.links.extend(e.path for e in it if e.is_symlink())
            continue
        if top.name.startswith(".") or not top.is_dir(follow_symlinks=False):
            continue
        for sub in scan_dir(top.path, sort=True):
            if sub.is_symlink():
                walk.links.append(sub.path)
                continue
            if not sub.is_dir(follow_symlinks=False):
                continue
            for e in scan_dir(sub.path, sort=True):
                if e.is_symlink():
                    walk.links.append(e.path)
                elif e.is_dir(follow_symlinks=False):
                    walk.other.append(e.path)
                elif e.name.startswith(TMP_PREFIX):
                    walk.temps.append(e.path)
                elif e.is_file(follow_symlinks=False):
                    yield top.name, sub.name, e
                else:
                    walk.other.append(e.path)


def usage(base: str) -> tuple[int, int, Walk]:
    """(published files, their bytes, the walk) of namespace directory ``base``."""
    walk = Walk()
    files = nbytes = 0
    for _t, _s, e in iter_blocks(base, walk):
        try:
            nbytes += e.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
        files += 1
    return files, nbytes, walk


def read_ledger(base: str) -> int | None:
    """The ``.usage`` ledger of namespace directory ``base`` read without creating or
    changing anything (a shared lock, waited for up to a second); None if missing, a
    link or not a regular file."""
    try:
        fd = os.open(os.path.join(base, ".usage"), _RDONLY)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        locked = False
        for _ in range(100):
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                time.sleep(0.01)
        try:  # the coherent ledger of a distributed filesystem's clients (Ledger doc)
            raw = os.getxattr(fd, LEDGER_XATTR)
        except OSError:
            raw = b""
        if len(raw) != 8:
            raw = os.pread(fd, 8, 0)
        if locked:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return int.from_bytes(raw, "little", signed=True) if len(raw) == 8 else 0
    finally:
        os.close(fd)


def live_writers(base: str) -> tuple[list[str], list[str]]:
    """(live, unknown) writer entries of namespace directory ``base``: like the dead-writer
    collection (``Layout.collect_dead_writers``), an entry in ``.writers`` whose ``flock``
    cannot be taken belongs to a running writer; one that cannot be opened (another
    user's) is unknown. Nothing is removed or created."""
    live, unknown = [], []
    try:
        with os.scandir(os.path.join(base, ".writers")) as it:
            entries = sorted(it, key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return live, unknown
    for ent in entries:
        if ent.is_symlink():
            continue
        try:
            fd = os.open(ent.path, _RDONLY)
        except FileNotFoundError:
            continue
        except OSError:
            unknown.append(ent.name)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            live.append(ent.name)
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    return live, unknown


def tree_usage(path: str) -> tuple[int, int]:
    """(regular files, bytes) in the directory tree ``path``, links not followed."""
    files = nbytes = 0
    for dirpath, _dirs, names in os.walk(path, followlinks=False):
        for n in names:
            try:
                st = os.lstat(os.path.join(dirpath, n))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                files += 1
                nbytes += st.st_size
    return files, nbytes


# --------------------------------------------------------------------------- verify


def _open_ro(path: str) -> int:
    if _NOATIME:
        try:
            return os.open(path, _RDONLY | _NOATIME)
        except PermissionError:  # O_NOATIME needs the file's owner (or CAP_FOWNER)
            pass
    return os.open(path, _RDONLY)


def check_file(index: LayoutIndex, path: str, top: str, sub: str, name: str,
               buf: memoryview) -> tuple[str, str | None, int]:
    """Read one published file and validate it against namespace ``index``.

    Returns (status, reason, size): status ``ok``, ``corrupt`` (header, geometry, key,
    file name, size or payload checksum wrong), ``unreadable`` (open/read failed, not a
    regular file), ``link`` (replaced by a symbolic link meanwhile) or ``gone`` (removed
    meanwhile, e.g. evicted)."""
    try:
        fd = _open_ro(path)
    except FileNotFoundError:
        return "gone", None, 0
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "link", None, 0
        return "unreadable", e.strerror or str(e), 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "unreadable", "not a regular file", 0
        n = 0
        while n < len(buf):
            k = os.preadv(fd, [buf[n:]], n)
            if k == 0:
                break
            n += k
    except OSError as e:
        return "unreadable", e.strerror or str(e), st.st_size
    finally:
        os.close(fd)
    size = st.st_size
    if n > index.ns.file_bytes:
        return "corrupt", f"file longer than a block file ({size} > {index.ns.file_bytes})", size
    try:
        if n < HEADER_BYTES:
            raise CorruptBlock(f"truncated header ({n} bytes)")
        fields = HEADER_FMT.unpack_from(buf, 0)
        key = bytes(fields[7][: fields[6]])
        payload_len = index.check_block(buf, n, key, verify=True)
    except CorruptBlock as e:
        return "corrupt", str(e), size
    want = HEADER_BYTES + round_up(payload_len)
    if n != want:
        return "corrupt", f"file is {n} bytes, its header says {want}", size
    h = xxhash.xxh3_128_hexdigest(key)
    if h != name:
        return "corrupt", "the key in the header does not hash to the file name", size
    if (top, sub) != (h[:2], h[2:4]):
        return "corrupt", "file in the wrong shard directory", size
    return "ok", None, size


class Progress:
    """A progress line on stderr at most once a second (and a last one for a large
    root); silent when ``quiet``."""

    def __init__(self, prog: str, quiet: bool, large: int = 1000) -> None:
        self.prog, self.quiet, self.large = prog, quiet, large
        self.files = self.bytes = self.bad = 0
        self.t0 = self.last = time.monotonic()
        self.shown = False

    def add(self, size: int, bad: bool) -> None:
        self.files += 1
        self.bytes += size
        self.bad += bad
        if not self.quiet and time.monotonic() - self.last >= 1.0:
            self.show()

    def show(self) -> None:
        self.last = time.monotonic()
        self.shown = True
        print(f"{self.prog}: {self.files} files ({self.bytes / 2**30:.2f} GiB) checked, "
              f"{self.bad} bad, {self.last - self.t0:.0f} s", file=sys.stderr, flush=True)

    def done(self) -> None:
        if not self.quiet and (self.shown or self.files >= self.large):
            self.show()


def verify_namespace(entry: os.DirEntry, progress: Progress) -> dict[str, Any]:
    """Check every published file of one namespace directory (read-only)."""
    rep: dict[str, Any] = {"namespace": entry.name, "path": entry.path, "model": None,
                           "error": None, "files": 0, "bytes": 0, "ok": 0, "corrupt": [],
                           "unreadable": [], "temp_files": [], "symlinks_skipped": []}
    meta, why = read_meta(entry.path)
    ns = None
    if meta is not None:
        rep["model"] = meta.get("model")
        ns, why = namespace_of(entry.name, meta)
    rep["error"] = why
    walk = Walk()
    index = LayoutIndex(os.path.dirname(entry.path), ns) if ns is not None else None
    buf = memoryview(bytearray(ns.file_bytes + 4096)) if ns is not None else None
    for top, sub, e in iter_blocks(entry.path, walk):
        if index is None:  # cannot be checked without its namespace: counted, not read
            try:
                size = e.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
            rep["files"] += 1
            rep["bytes"] += size
            progress.add(size, False)
            continue
        status, reason, size = check_file(index, e.path, top, sub, e.name, buf)
        if status == "gone":
            continue
        if status == "link":
            walk.links.append(e.path)
            continue
        rep["files"] += 1
        rep["bytes"] += size
        if status == "ok":
            rep["ok"] += 1
        else:
            rep[status].append({"path": e.path, "reason": reason})
        progress.add(size, status != "ok")
    rep["unreadable"] += [{"path": p, "reason": "not a regular file"} for p in walk.other]
    rep["temp_files"] = walk.temps
    rep["symlinks_skipped"] = walk.links
    return rep


# --------------------------------------------------------------------------- purge


def remove_tree(root: str, entry_path: str) -> str:
    """Remove namespace directory ``entry_path`` (directly under ``root``): renamed first
    to a ``.kvcache-purge.*`` name in ``root`` (atomic: a writer starting meanwhile makes a
    fresh namespace; nothing half-deleted keeps the namespace's name), its ``meta.json``
    unlinked (a leftover is no namespace), then removed with ``shutil.rmtree``, which never
    follows a symbolic link (a link inside is unlinked itself; a link at the top is
    refused). Returns the temporary name."""
    name = os.path.basename(entry_path)
    if os.path.dirname(entry_path) != root or not (NS_DIR_RE.fullmatch(name)
                                                   or name.startswith(PURGE_PREFIX)):
        raise UsageError(f"refusing to remove {entry_path}: not a namespace directory of "
                         f"{root}")
    if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover - not on Linux
        raise UsageError("this platform's rmtree may follow symbolic links: refusing")
    if name.startswith(PURGE_PREFIX):
        tmp = entry_path
    else:
        tmp = os.path.join(root, f"{PURGE_PREFIX}{name}.{os.getpid()}")
        n = 0
        while os.path.lexists(tmp):
            n += 1
            tmp = os.path.join(root, f"{PURGE_PREFIX}{name}.{os.getpid()}.{n}")
        os.rename(entry_path, tmp)
    dfd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink("meta.json", dir_fd=dfd)
    finally:
        os.close(dfd)

    def gone_ok(_fn, _path, exc) -> None:  # a concurrent purge removed it first: fine
        e = exc if isinstance(exc, BaseException) else exc[1]
        if not isinstance(e, FileNotFoundError):
            raise e

    if sys.version_info >= (3, 12):
        shutil.rmtree(tmp, onexc=gone_ok)
    else:
        shutil.rmtree(tmp, onerror=gone_ok)
    return tmp
