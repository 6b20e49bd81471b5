"""io_uring engine through the ``liburing`` package.

Reads/writes are ``readv``/``writev`` with an :class:`liburing.Iovec` over a memoryview of
a staging slot (zero copy); the Iovec is built once per slot (:meth:`make_iov`). Opens
(``openat``), closes and fsyncs are io_uring ops too. Completions are signalled through a
registered eventfd so that :meth:`wait` blocks in ``poll`` with the GIL released
(``io_uring_wait_cqe`` in liburing holds the GIL).
"""

from __future__ import annotations

import os
import select

import liburing as L

from .base import DEFAULT_FILE_MODE, OPEN_FLAGS, IOEngine


class UringEngine(IOEngine):
    name = "io_uring"

    def __init__(self, entries: int = 64, force_async: bool = False) -> None:
        super().__init__()
        n = 8
        while n < entries:
            n <<= 1
        self._ring = L.Ring()
        self._cqe = L.Cqe()
        rc = L.io_uring_queue_init(n, self._ring, 0)
        if rc not in (0, None):
            raise OSError(-rc, "io_uring_queue_init failed")
        self._cfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        L.io_uring_register_eventfd(self._ring, self._cfd)
        self._poll.register(self._cfd, select.POLLIN)
        self._queued = 0
        self._keep: dict[int, object] = {}  # tag -> object that must outlive the op
        self._flags = L.IOSQE_ASYNC if force_async else 0
        self._closed = False

    def make_iov(self, buf: memoryview) -> object:
        return L.Iovec([buf])

    def _sqe(self):
        sqe = L.io_uring_get_sqe(self._ring)
        if sqe is None:  # SQ full: hand what we have to the kernel and retry
            self.submit()
            sqe = L.io_uring_get_sqe(self._ring)
            if sqe is None:
                raise RuntimeError("io_uring submission queue full")
        self._queued += 1
        return sqe

    def open(self, tag: int, path: str, flags: int, mode: int = DEFAULT_FILE_MODE) -> None:
        sqe = self._sqe()
        L.io_uring_prep_open(sqe, path, flags | OPEN_FLAGS, mode)
        L.io_uring_sqe_set_data64(sqe, tag)
        self._keep[tag] = path

    def read(self, tag: int, fd: int, iov: object, offset: int = 0) -> None:
        if not isinstance(iov, L.Iovec):
            iov = L.Iovec([iov])
            self._keep[tag] = iov
        sqe = self._sqe()
        L.io_uring_prep_readv(sqe, fd, iov, offset)
        if self._flags:
            sqe.flags = self._flags
        L.io_uring_sqe_set_data64(sqe, tag)

    def write(self, tag: int, fd: int, iov: object, offset: int = 0) -> None:
        if not isinstance(iov, L.Iovec):
            iov = L.Iovec([iov])
            self._keep[tag] = iov
        sqe = self._sqe()
        L.io_uring_prep_writev(sqe, fd, iov, offset)
        if self._flags:
            sqe.flags = self._flags
        L.io_uring_sqe_set_data64(sqe, tag)

    def fsync(self, tag: int, fd: int) -> None:
        sqe = self._sqe()
        L.io_uring_prep_fsync(sqe, fd, L.IORING_FSYNC_DATASYNC)
        L.io_uring_sqe_set_data64(sqe, tag)

    def close(self, tag: int, fd: int) -> None:
        sqe = self._sqe()
        L.io_uring_prep_close(sqe, fd)
        L.io_uring_sqe_set_data64(sqe, tag)

    def pending(self) -> bool:
        return self._queued > 0

    def submit(self) -> None:
        if self._queued:
            L.io_uring_submit(self._ring)
            self._queued = 0

    def reap(self, out: list[tuple[int, int]]) -> int:
        try:
            os.eventfd_read(self._cfd)
        except BlockingIOError:
            pass
        ring, cqe = self._ring, self._cqe
        n = L.io_uring_cq_ready(ring)
        keep = self._keep
        for _ in range(n):
            L.io_uring_peek_cqe(ring, cqe)
            c = cqe[0]
            tag = c.user_data
            try:
                res = c.res
            except OSError as e:  # liburing raises for negative results
                res = -(e.errno or 5)
            L.io_uring_cqe_seen(ring, c)
            if keep:
                keep.pop(tag, None)
            out.append((tag, res))
        return n

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            L.io_uring_queue_exit(self._ring)
            os.close(self._cfd)
            super().shutdown()
