"""I/O engine interface used by the reactor.

An engine queues operations tagged with an integer ``tag`` and reports ``(tag, result)``
completions, ``result`` being the syscall's return value (bytes moved, a new fd, 0) or a
negative errno. All methods except :meth:`IOEngine.wake` must be called from ONE thread
(the reactor thread). Buffers passed to :meth:`read`/:meth:`write` are owned by the caller
and must stay untouched until the op's completion is reaped.
"""

from __future__ import annotations

import os
import select
from abc import ABC, abstractmethod

#: Mode of a file an engine creates (:meth:`IOEngine.open` with ``O_CREAT``) unless the
#: caller passes one: private to the owner (the layout chmods a temp file to its
#: ``file_mode`` before publishing it when that differs; docs/security.md).
DEFAULT_FILE_MODE = 0o600
#: Flags every engine adds to every open: close-on-exec, and never through a symbolic
#: link in the last path component (a link in the cache root is never followed).
OPEN_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW


class IOEngine(ABC):
    name = "base"

    def __init__(self) -> None:
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poll = select.poll()
        self._poll.register(self._wake_fd, select.POLLIN)

    # -- buffers --------------------------------------------------------------------
    def make_iov(self, buf: memoryview) -> object:
        """Prepare a long-lived handle for ``buf`` (built once per staging slot)."""
        return buf

    # -- operations (reactor thread only) ---------------------------------------------
    @abstractmethod
    def open(self, tag: int, path: str, flags: int, mode: int = DEFAULT_FILE_MODE) -> None:
        """Queue ``openat(path, flags | OPEN_FLAGS, mode)``: the result is the new fd, or
        ``-ELOOP`` when ``path`` is a symbolic link (never followed)."""

    @abstractmethod
    def read(self, tag: int, fd: int, iov: object, offset: int = 0) -> None: ...

    @abstractmethod
    def write(self, tag: int, fd: int, iov: object, offset: int = 0) -> None: ...

    @abstractmethod
    def fsync(self, tag: int, fd: int) -> None: ...

    @abstractmethod
    def close(self, tag: int, fd: int) -> None: ...

    @abstractmethod
    def submit(self) -> None:
        """Hand queued operations to the kernel / workers."""

    def pending(self) -> bool:
        """Whether operations are queued for the next :meth:`submit` (the reactor times
        only submits that do something). Engines that cannot tell say True."""
        return True

    @abstractmethod
    def reap(self, out: list[tuple[int, int]]) -> int:
        """Append finished ``(tag, result)`` pairs to ``out`` without blocking; return count."""

    def wait(self, timeout_s: float | None) -> None:
        """Block (GIL released) until a completion may be ready, :meth:`wake`, or timeout."""
        self._poll.poll(None if timeout_s is None else max(0, int(timeout_s * 1000)))
        try:
            os.eventfd_read(self._wake_fd)
        except BlockingIOError:
            pass

    def wake(self) -> None:
        """Interrupt :meth:`wait` (any thread)."""
        os.eventfd_write(self._wake_fd, 1)

    def shutdown(self) -> None:
        os.close(self._wake_fd)
