"""I/O engines and the probes that choose them.

:func:`make_engine` returns an io_uring engine when the kernel allows it (and liburing
runs here: probed in a child process first), else the POSIX fallback with ONE warning.
:func:`probe_direct` decides per root whether O_DIRECT works.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

from .base import IOEngine
from .posix import PosixEngine

log = logging.getLogger("kvcache_core.io")
_warned = threading.Event()


#: The probe, run in a child process first: a liburing build that cannot run on this
#: machine kills the process that calls it (seen: liburing 2026.3.x dies with SIGILL in
#: ``Ring()`` on a 6.18 Firecracker kernel), and that must never be the vLLM worker.
_PROBE = """
import liburing as L
ring = L.Ring()
rc = L.io_uring_queue_init(2, ring, 0)
if rc not in (0, None):
    raise SystemExit(f"io_uring_queue_init returned {rc}")
sqe = L.io_uring_get_sqe(ring)
L.io_uring_prep_nop(sqe)
L.io_uring_submit(ring)
cqe = L.Cqe()
L.io_uring_wait_cqe(ring, cqe)
L.io_uring_cqe_seen(ring, cqe[0])
L.io_uring_queue_exit(ring)
"""
#: Environment variable that carries the child probe's verdict to this process's
#: children (vLLM workers, test helpers): ``ok`` or the reason it failed.
PROBE_ENV = "KVCACHE_URING_PROBE"
_probe_lock = threading.Lock()


def _child_probe() -> tuple[bool, str]:
    """Run :data:`_PROBE` in a child process once per process tree (cached in
    :data:`PROBE_ENV`). Returns (ok, reason)."""
    cached = os.environ.get(PROBE_ENV)
    if cached is not None:
        return cached == "ok", cached
    with _probe_lock:
        cached = os.environ.get(PROBE_ENV)
        if cached is not None:
            return cached == "ok", cached
        try:
            p = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True,
                               timeout=30, text=True)
            if p.returncode == 0:
                why = "ok"
            elif p.returncode < 0:
                try:
                    sig = signal.Signals(-p.returncode).name
                except ValueError:
                    sig = str(-p.returncode)
                why = (f"the io_uring probe process was killed by {sig} inside liburing "
                       f"{_liburing_version()} (kernel {os.uname().release})")
            else:
                last = (p.stderr.strip().splitlines() or ["no output"])[-1]
                why = f"the io_uring probe process failed: {last}"
        except (OSError, subprocess.SubprocessError) as e:
            why = f"the io_uring probe process could not run: {e}"
        os.environ[PROBE_ENV] = why
        return why == "ok", why


def _liburing_version() -> str:
    try:
        from importlib.metadata import version

        return version("liburing")
    except Exception:  # pragma: no cover - metadata missing
        return "?"


def uring_available() -> tuple[bool, str]:
    """Probe io_uring: set up a ring and run one NOP in a child process (a liburing that
    cannot run here kills only that child), once per process tree. Returns (ok, reason);
    the reason names the refusal (the child's last error line or the signal)."""
    try:
        import liburing  # noqa: F401
    except Exception as e:  # pragma: no cover - import failure is environment specific
        return False, f"liburing not importable: {e}"
    if os.environ.get("KVCACHE_DISABLE_IO_URING") == "1":
        return False, "disabled by KVCACHE_DISABLE_IO_URING=1"
    return _child_probe()


def make_engine(kind: str = "auto", depth: int = 8, entries: int = 64,
                force_async: bool = False) -> IOEngine:
    """Create an engine. ``kind``: ``auto``, ``io_uring`` (required) or ``posix``."""
    if kind == "posix":
        return PosixEngine(depth)
    ok, why = uring_available()
    if ok:
        from .uring import UringEngine

        return UringEngine(entries, force_async=force_async)
    if kind == "io_uring":
        raise RuntimeError(f"py-kvcache: engine 'io_uring' requested but unavailable: {why}")
    if not _warned.is_set():
        _warned.set()
        log.warning("py-kvcache: io_uring unavailable (%s); using the POSIX thread-pool "
                    "fallback (preadv/pwritev, %d threads)", why, depth)
    return PosixEngine(depth)


def probe_direct(directory: str, mode: str = "auto") -> bool:
    """Whether files in ``directory`` can be opened with O_DIRECT (``mode``: auto/on/off).

    The probe file is created 0600 with ``O_EXCL|O_NOFOLLOW`` (never through a symbolic
    link) and removed at once."""
    if mode == "off" or not hasattr(os, "O_DIRECT"):
        if mode == "on":
            raise RuntimeError("py-kvcache: direct_io 'on' but O_DIRECT is not supported here")
        return False
    path = os.path.join(directory, f".odirect-probe.{os.getpid()}.{threading.get_ident()}")
    try:  # a crashed namesake's leftover (or a link: the link itself, never its target)
        os.unlink(path)
    except OSError:
        pass
    try:  # private, never through a symbolic link
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                     | os.O_DIRECT, 0o600)
    except OSError as e:
        if mode == "on":
            raise RuntimeError(f"py-kvcache: direct_io 'on' but {directory} refuses O_DIRECT: "
                               f"{e.strerror}") from e
        return False
    os.close(fd)
    os.unlink(path)
    return True


__all__ = ["IOEngine", "PosixEngine", "make_engine", "probe_direct", "uring_available"]
