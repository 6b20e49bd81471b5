"""Start-up warm-up of the cache directory's metadata (``disk_warm_start``).

A lookup asks whether a block's file exists (one ``faccessat`` per rank, see
:meth:`~kvcache_core.layout.LayoutIndex.exists`). While the kernel has the directory
entries and inodes of the cache in memory that costs microseconds; after a restart,
a reboot or ``drop_caches`` each check reads directory and inode blocks from the disk,
behind whatever KV reads are queued there. On an H100 (thirty-seventh and
thirty-eighth sessions, every block on disk, a fresh engine after ``drop_caches``)
single checks took up to 54-310 ms, one request's lookup up to 5.9 s, and the
scheduler thread spent up to 14 s of a 65 s run in file checks, the engine running no
step meanwhile.

:class:`DirWarmer` reads that metadata once, at start-up, when the disk is idle: a
daemon thread lists every namespace directory (``<base>/xx/yy/``) on a few worker
threads and ``lstat``\\ s each file, so the kernel caches the entries and inodes the
lookups will ask for. It changes no answer: a lookup still asks the filesystem, which
stays the only authority (other processes publish and evict files). Nothing here runs
on the engine's threads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from .layout import scan_dir

log = logging.getLogger("vllm.pykvcache")

#: worker threads listing top-level directories at once (a few requests in the disk's
#: queue; the warm-up runs before the KV reads that would otherwise queue behind it)
WARM_THREADS = 4
#: seconds the warm-up waits for a rank's namespace directory to appear (the workers
#: create it) before it skips that rank
WARM_WAIT_S = 60.0
#: files stat'ed at most (a cache of 29 MB blocks holds about 35,000 files per TB); the
#: walk stops there and says so
WARM_MAX_FILES = 4_000_000


class DirWarmer:
    """Walks the namespace directories ``bases`` once on a daemon thread (started here),
    so that their directory entries and file inodes are in the kernel's caches.

    Contract: the constructor returns at once; the walk never raises (an unreadable
    directory is counted in ``errors`` and skipped, a file removed meanwhile is ignored);
    ``done(files, dirs, errors, us)`` is called once, on the warm-up thread, when the
    walk ends, is stopped or gives up (a base that does not appear within
    :data:`WARM_WAIT_S`). :meth:`close` (any thread) stops the walk within one
    directory per worker and waits for it; :attr:`finished` is set after ``done``.
    ``files`` counts what was stat'ed so far (read by any thread; approximate while the
    walk runs)."""

    def __init__(self, bases: Sequence[str],
                 done: Callable[[int, int, int, int], None] | None = None,
                 threads: int = WARM_THREADS, max_files: int = WARM_MAX_FILES,
                 wait_s: float = WARM_WAIT_S) -> None:
        self._bases = list(bases)
        self._done = done
        self._threads = max(1, threads)
        self._max_files = max_files
        self._wait_s = wait_s
        self._stop = threading.Event()
        self.finished = threading.Event()
        self.files = 0
        self.dirs = 0
        self.errors = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="pykvcache-warm",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            for base in self._bases:
                if not self._wait_for(base, t0 + self._wait_s):
                    continue
                try:
                    tops = [e.path for e in scan_dir(base)
                            if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
                except OSError:
                    self._add(0, 0, 1)
                    continue
                self._add(0, 1, 0)
                with ThreadPoolExecutor(self._threads,
                                        thread_name_prefix="pykvcache-warm") as ex:
                    for _ in ex.map(self._walk, tops):
                        pass
                if self._stop.is_set():
                    break
        except Exception:  # never take the engine down for a warm-up
            log.exception("py-kvcache: the cache directory warm-up failed")
        finally:
            us = int((time.monotonic() - t0) * 1e6)
            if self._done is not None:
                try:
                    self._done(self.files, self.dirs, self.errors, us)
                except Exception:
                    log.exception("py-kvcache: warm-up callback failed")
            self.finished.set()

    def _wait_for(self, base: str, deadline: float) -> bool:
        """Whether ``base`` exists, polled until ``deadline`` or :meth:`close`."""
        while not os.path.isdir(base):
            if time.monotonic() >= deadline or self._stop.wait(0.1):
                return False
        return True

    def _add(self, files: int, dirs: int, errors: int) -> None:
        with self._lock:
            self.files += files
            self.dirs += dirs
            self.errors += errors

    def _walk(self, top: str) -> None:
        """One top-level directory: its leaf directories listed, their files stat'ed."""
        if self._stop.is_set() or self.files >= self._max_files:
            return
        try:
            leaves = [e.path for e in scan_dir(top) if e.is_dir(follow_symlinks=False)]
        except OSError:
            self._add(0, 0, 1)
            return
        self._add(0, 1, 0)
        for leaf in leaves:
            if self._stop.is_set() or self.files >= self._max_files:
                return
            n = 0
            try:
                for e in scan_dir(leaf):
                    try:
                        e.stat(follow_symlinks=False)  # the inode into the cache
                        n += 1
                    except FileNotFoundError:
                        pass  # evicted or renamed meanwhile
            except OSError:
                self._add(n, 0, 1)
                continue
            self._add(n, 1, 0)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the walk and wait for it (at most ``timeout`` s). Any thread."""
        self._stop.set()
        self._thread.join(timeout=timeout)
