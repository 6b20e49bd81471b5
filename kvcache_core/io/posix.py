"""POSIX fallback engine: preadv/pwritev on a small pool of threads.

Used only where io_uring is refused (seccomp, old kernels). ``depth`` worker threads take
operations from a queue; the GIL is released inside the syscalls, so up to ``depth``
operations are in flight. Completions are handed back through a deque + eventfd.
"""

from __future__ import annotations

import collections
import os
import queue
import select
import threading

from .base import DEFAULT_FILE_MODE, OPEN_FLAGS, IOEngine

_OPEN, _READ, _WRITE, _FSYNC, _CLOSE, _STOP = range(6)


class PosixEngine(IOEngine):
    name = "posix"

    def __init__(self, depth: int = 8) -> None:
        super().__init__()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: list[tuple] = []
        self._done: collections.deque[tuple[int, int]] = collections.deque()
        self._dfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poll.register(self._dfd, select.POLLIN)
        self._threads = [threading.Thread(target=self._work, name=f"kvcache-posix-{i}",
                                          daemon=True) for i in range(max(1, depth))]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        q, done, dfd = self._q, self._done, self._dfd
        while True:
            op, tag, a, b, c = q.get()
            if op == _STOP:
                return
            try:
                if op == _READ:
                    res = os.preadv(a, [b], c)
                elif op == _WRITE:
                    res = os.pwritev(a, [b], c)
                elif op == _OPEN:
                    res = os.open(a, b | OPEN_FLAGS, c)
                elif op == _FSYNC:
                    os.fdatasync(a)
                    res = 0
                else:
                    os.close(a)
                    res = 0
            except OSError as e:
                res = -(e.errno or 5)
            done.append((tag, res))
            os.eventfd_write(dfd, 1)

    def open(self, tag: int, path: str, flags: int, mode: int = DEFAULT_FILE_MODE) -> None:
        self._pending.append((_OPEN, tag, path, flags, mode))

    def read(self, tag: int, fd: int, iov: object, offset: int = 0) -> None:
        self._pending.append((_READ, tag, fd, iov, offset))

    def write(self, tag: int, fd: int, iov: object, offset: int = 0) -> None:
        self._pending.append((_WRITE, tag, fd, iov, offset))

    def fsync(self, tag: int, fd: int) -> None:
        self._pending.append((_FSYNC, tag, fd, None, None))

    def close(self, tag: int, fd: int) -> None:
        self._pending.append((_CLOSE, tag, fd, None, None))

    def pending(self) -> bool:
        return bool(self._pending)

    def submit(self) -> None:
        for op in self._pending:
            self._q.put(op)
        self._pending.clear()

    def reap(self, out: list[tuple[int, int]]) -> int:
        try:
            os.eventfd_read(self._dfd)
        except BlockingIOError:
            pass
        n = 0
        done = self._done
        while done:
            out.append(done.popleft())
            n += 1
        return n

    def shutdown(self) -> None:
        for _ in self._threads:
            self._q.put((_STOP, 0, None, None, None))
        for t in self._threads:
            t.join(timeout=5)
        os.close(self._dfd)
        super().shutdown()
