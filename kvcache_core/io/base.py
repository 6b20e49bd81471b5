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
    def open(self, tag: int, path: str, flags: int, mode: int = 0o644) -> None: ...

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
