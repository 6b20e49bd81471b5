"""Task bookkeeping of the I/O reactor (:mod:`kvcache_core.reactor`), shared with its load
routing (:mod:`kvcache_core.routing`): request kinds, internal item flags, task states
and I/O op codes, and the per-block :class:`Task` / per-request :class:`Request` records.

Only the reactor thread touches tasks and requests (created from inbox messages, freed
when done); nothing here does I/O.
"""

from __future__ import annotations

import enum
import time
from typing import Any, NamedTuple

#: request kinds
LOAD, STORE = 0, 1


class Item(NamedTuple):
    """One block of a load or store request (:meth:`kvcache_core.reactor.Reactor.load` /
    ``store``). Plain tuples of the first 3 or all 5 fields are accepted too.

    ``ref``: what the copier copies to (load) or from (store); None for a preload or a
    ``FLUSH``. ``slot`` >= 0: the caller-owned (DRAM-tier) pool slot the block goes
    through, with ``flags`` from :mod:`kvcache_core.flags` (``IN_SLOT``, ``NO_DISK``,
    ``FLUSH``)."""

    key: bytes
    ref: Any
    nbytes: int
    slot: int = -1
    flags: int = 0
# item flags (public ones in kvcache_core.flags, shared with the vLLM glue)
SUPERSEDED = 1 << 8  # (internal) preload replaced by a foreground load of its key
PREEMPTED = 1 << 9   # (internal) preload to close and re-queue when its open completes


class State(enum.IntEnum):
    """Where a task is. Loads: Q -> OPENING -> OPENED -> READING -> READY -> COPY_OUT ->
    DONE (JOINED: riding another load's read of the same key). Stores: Q -> COPY_IN ->
    WB_QUEUED -> W_OPENING -> WRITING (-> SYNCING) -> CLOSING -> DONE."""

    Q = 0
    OPENING = 1
    OPENED = 2
    READING = 3
    READY = 4
    COPY_OUT = 5
    COPY_IN = 6
    W_OPENING = 7
    WRITING = 8
    SYNCING = 9
    CLOSING = 10
    DONE = 11
    JOINED = 12
    WB_QUEUED = 13


class Op(enum.IntEnum):
    """The file operation of an I/O tag (its low ``OP_BITS`` bits; the task id above them,
    see ``Task.tag``). One completion handler per value (``Reactor._on_cqe``)."""

    OPEN = 0     # open for reading (load)
    READ = 1
    WOPEN = 2    # temp-file create (store)
    WRITE = 3
    FSYNC = 4
    CLOSE = 5    # close after a read or an abandoned open: nothing to do on completion
    WCLOSE = 6   # close of a written temp file: publish it


OP_BITS = 3
OP_MASK = (1 << OP_BITS) - 1
assert max(Op) <= OP_MASK
# module aliases of the members (plain global loads on the reactor's hot path)
(Q, OPENING, OPENED, READING, READY, COPY_OUT, COPY_IN, W_OPENING, WRITING, SYNCING,
 CLOSING, DONE, JOINED, WB_QUEUED) = tuple(State)
OP_OPEN, OP_READ, OP_WOPEN, OP_WRITE, OP_FSYNC, OP_CLOSE, OP_WCLOSE = tuple(Op)


class Task:
    __slots__ = ("tid", "kind", "key", "ref", "nbytes", "req", "idx", "prio", "state",
                 "slot", "fd", "tmp", "final", "cached", "handle", "wlen", "ext", "flags",
                 "payload", "nread", "copied", "xslot", "depth", "t_op", "expired",
                 "reopened", "tag")

    def reset(self) -> None:
        self.ref = None
        self.req = None
        self.slot = -1
        self.fd = -1
        self.tmp = self.final = None
        self.cached = False
        self.ext = False
        self.copied = False
        self.xslot = -1  # the caller-owned slot this task owns (see Reactor._ext_owner)
        self.flags = 0
        self.depth = False  # holds one io_depth unit (a read or a file write in flight)
        self.payload = 0
        self.handle = None
        self.state = Q
        self.t_op = 0.0  # time.monotonic() when its current file operation was submitted
        self.expired = False  # reported failed; waits for its operation's completion
        self.reopened = False  # its temp-file create was retried once (shard dir made again)


class Request:
    __slots__ = ("req_id", "kind", "ok", "remaining", "cancelled", "prio", "hold", "acked",
                 "dropping", "t0")

    def __init__(self, req_id, kind, n, prio):
        self.req_id = req_id
        self.kind = kind
        self.t0 = time.monotonic()
        self.ok = [False] * n
        self.remaining = n
        self.cancelled = False
        self.prio = prio
        #: store: items still reading their source (device copy not done); at 0 the
        #: early acknowledgement may go out (see Reactor doc)
        self.hold = 0
        self.acked = False
        #: store, ``store_policy="drop"``: a block was dropped for back-pressure, so the
        #: later staging blocks of this request are dropped too
        self.dropping = False
