"""Device copiers: move a block between a staging slot's payload and its device location.

The reactor thread is the only caller. ``to_device`` receives ALL load blocks that became
ready in one reactor iteration and must issue them as ONE batched operation;
``from_device`` copies one block for a store and ``from_device_batch`` all blocks of one
store request (polled with :meth:`store_done`). Each returns a handle that is polled;
the reactor frees (or retains) the slot only once the copy is done.

* :class:`NullCopier` - no device (storage benchmarks measure disk <-> staging only).
* :class:`TimedCopier` - no device, but every copy "takes" a fixed time and completes
  asynchronously (benchmarks of the reactor's own scheduling, e.g. GIL contention).
* :class:`MemcpyCopier` - CPU-only machines and CI: destinations/sources are writable
  buffers (memoryview, bytearray, numpy array or CPU tensor); copies are synchronous.
* The CUDA copier of the vLLM integration (:class:`kvcache_core.vllm.transfer.KVCopier`):
  batched descriptors, one ``swap_blocks_batch`` per batch, CUDA events as handles.

The payload of slot ``s`` is ``pool.views[s][offset:offset + nbytes]``; ``offset`` is the
file header size so that header + payload are read/written in one I/O.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

from .staging import StagingPool


class Copier(ABC):
    #: True if :meth:`done` may return False (the reactor then polls with a short timeout).
    asynchronous = False
    #: Set by the reactor before any copy when a waiter thread blocks on store copies
    #: (``store_copy_wait="block"``): a copier whose handles can be waited on without
    #: spinning (CUDA: events created with blocking sync) should make store handles so.
    blocking_store_events = False

    def __init__(self, pool: StagingPool, offset: int) -> None:
        self.pool = pool
        self.offset = offset

    @abstractmethod
    def to_device(self, slots: list[int], dests: list[Any], nbytes: list[int]) -> Any:
        """Copy each slot's payload to its destination, as one batch. Returns a handle."""

    @abstractmethod
    def from_device(self, slot: int, src: Any, nbytes: int) -> Any:
        """Copy ``nbytes`` from ``src`` into the slot's payload. Returns a handle."""

    def from_device_batch(self, slots: list[int], srcs: list[Any], nbytes: list[int]) -> Any:
        """Copy several blocks of ONE store request into their slots (same producer).
        Returns one handle for :meth:`store_done`. Default: one :meth:`from_device` per
        block (a copier with a batched device path overrides this)."""
        return [self.from_device(s, r, n) for s, r, n in zip(slots, srcs, nbytes, strict=True)]

    def wait_store(self, handle: Any) -> None:
        """Block until :meth:`store_done` is true for ``handle`` (the reactor's store-copy
        waiter thread; must not hold the GIL while it waits for long). Default: check
        every 0.5 ms with the GIL released in between."""
        while not self.store_done(handle):
            time.sleep(0.0005)

    def store_done(self, handle: Any) -> bool:
        """Whether every copy of a :meth:`from_device_batch` handle is done."""
        if isinstance(handle, list):
            return all(self.done(h) for h in handle)
        return self.done(handle)

    def done(self, handle: Any) -> bool:
        return True

    def sync_all(self) -> None:
        """Block until every copy issued so far has finished (any thread). Synchronous
        copiers have nothing in flight."""
        return None


class NullCopier(Copier):
    """No device: the slot payload is the destination (storage benchmark)."""

    def to_device(self, slots, dests, nbytes):
        return None

    def from_device(self, slot, src, nbytes):
        return None


class TimedCopier(Copier):
    """No device; a batch completes ``COPY_S`` per block after it was issued, a store copy
    ``COPY_S`` after it was issued (handles are deadlines on ``time.perf_counter``)."""

    asynchronous = True
    COPY_S = 0.0005

    def to_device(self, slots, dests, nbytes):
        return time.perf_counter() + self.COPY_S * len(slots)

    def from_device(self, slot, src, nbytes):
        return time.perf_counter() + self.COPY_S

    def done(self, handle):
        return handle is None or time.perf_counter() >= handle

    def wait_store(self, handle):
        if handle is not None:
            time.sleep(max(0.0, handle - time.perf_counter()))


class MemcpyCopier(Copier):
    """Synchronous copies between slot payloads and CPU buffers (CI, CPU platform)."""

    def to_device(self, slots, dests, nbytes):
        views, off = self.pool.views, self.offset
        for s, d, n in zip(slots, dests, nbytes, strict=False):
            if d is None:
                continue
            _as_view(d)[:n] = views[s][off:off + n]
        return None

    def from_device(self, slot, src, nbytes):
        if src is not None:
            self.pool.views[slot][self.offset:self.offset + nbytes] = _as_view(src)[:nbytes]
        return None


def _as_view(buf: Any) -> memoryview:
    if isinstance(buf, memoryview):
        return buf.cast("B") if buf.format != "B" else buf
    if hasattr(buf, "numpy"):  # torch CPU tensor
        return memoryview(buf.view(-1).numpy().view("uint8"))
    return memoryview(buf).cast("B")
