"""The reactor: ONE I/O thread that moves storage blocks between files, staging slots and
the device.

Threads and ownership
---------------------
* Client threads (vLLM's worker thread, tests, benchmarks) call :meth:`Reactor.load`,
  :meth:`Reactor.store`, :meth:`Reactor.cancel`, :meth:`Reactor.poll` and
  :meth:`Reactor.wait`. They never touch slots, fds or the allocator.
* The reactor thread owns everything else: the :class:`SlotAllocator`, every slot's bytes
  while a task holds it, every fd it opened, the I/O engine and the copier.

One task per storage block
--------------------------
Load:  [DRAM hit: pin retained slot] or open (async, <= ``lookahead`` ahead) -> slot
       (when ``io_depth`` allows) -> read whole file -> verify header + xxh3 -> joins the
       batch of this iteration -> ONE ``copier.to_device`` for the batch -> when the copy is
       done the slot is retained as DRAM cache (or freed).
Store: slot (a caller-owned DRAM-tier slot, or a staging slot taken at once) -> ONE
       ``copier.from_device_batch`` per request for all its blocks that got a slot ->
       header + checksum -> [write-back queue] -> open temp (O_EXCL) -> write ->
       [fdatasync] -> close -> atomic publish -> slot retained or freed. The device copy
       never waits for the disk: a store takes no ``io_depth`` unit until its file write
       starts, and holds one from the temp-file open to write completion (at most
       ``write_depth`` writes at once: io_depth // 2 when serving, so reads keep units). With
       ``store_policy="drop"`` a block that finds no staging slot free right now (above the
       foreground reservation) is dropped and counted (``stores_dropped_backpressure``),
       and so are the request's later staging blocks (a prefix with a hole is useless);
       with ``"wait"`` (storage benchmarks, tests) it waits for a slot in arrival order.

Priorities (R8, docs/requirements.md): ready foreground reads > new foreground loads,
store copies and
write-back > speculative loads (a freed ``io_depth`` unit goes to a ready read first). At
most ``spec_depth`` speculative loads (default ONE, the seed paper's policy; never more
than ``io_depth - 1``) are open or reading at a time, and only while no foreground file
waits for a unit; each may only take a slot above the ``io_depth`` foreground
reservation; a foreground load arriving while a speculative file is open but not yet
reading closes that fd and re-queues the preload. With ``preload_keep_s`` > 0 a preload
never reclaims the slot of another preload staged less than that long ago and not yet
claimed: when those are all it could take, it is dropped unread
(``preload_dropped_full``), so the preloads planned first (the head of vLLM's queue, the
start of a prefix) stay staged; foreground loads and stores still reclaim staged slots.

Errors never escape the reactor: a missing file is a miss, a short/corrupt/mismatched
file is a counted miss (the file is removed), ENOSPC or any write error drops the store
(counted, temp file removed). Each request completes exactly once with per-item status.
If the reactor thread itself dies (a bug), every request in flight and every later one
completes at once with its items failed (:attr:`Reactor.dead` says why): callers
recompute, nothing waits forever.
"""

from __future__ import annotations

import collections
import contextlib
import errno as _errno
import gc
import logging
import os
import queue
import resource
import sys
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .copy import Copier, NullCopier
from .flags import AFTER_LOAD, FLUSH, IN_SLOT, NO_DISK
from .io import IOEngine, make_engine, probe_direct
from .layout import HEADER_BYTES, MAX_KEY_BYTES, CapacityExceeded, CorruptBlock, Layout, round_up
from .routing import LoadRouting
from .staging import Priority, SlotAllocator, StagingPool
from .tasks import (  # noqa: F401  (states and op codes are re-exported for tests/tools)
    CLOSING,
    COPY_IN,
    COPY_OUT,
    DONE,
    JOINED,
    LOAD,
    OP_BITS,
    OP_CLOSE,
    OP_FSYNC,
    OP_MASK,
    OP_OPEN,
    OP_READ,
    OP_WCLOSE,
    OP_WOPEN,
    OP_WRITE,
    OPENED,
    OPENING,
    PREEMPTED,
    READING,
    READY,
    STORE,
    SUPERSEDED,
    SYNCING,
    W_OPENING,
    WB_QUEUED,
    WRITING,
    Item,
    Op,
    Q,
    Request,
    State,
    Task,
)

log = logging.getLogger(__name__)

class _ReqMsg(NamedTuple):
    """Inbox: a client's load or store request (:meth:`Reactor._submit`)."""

    req_id: Hashable
    kind: int  # LOAD or STORE
    items: list
    prio: Priority


class _CancelMsg(NamedTuple):
    """Inbox: cancel ``req_id`` (:meth:`Reactor.cancel`)."""

    req_id: Hashable


#: interpreter switch interval the reactor sets when the current one is larger (None: keep)
SWITCH_INTERVAL_S = 0.0005

#: process-wide holds of a lowered switch interval (``switch_interval_scope="busy"``):
#: the count of such reactors of the process with a request in flight, and the interval
#: the interpreter had before the first hold
_si_lock = threading.Lock()
_si_holds = 0
_si_saved = 0.0


def _major_faults() -> int:
    """This process's major page faults so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def _si_hold(low: float) -> None:
    """Lower the interpreter switch interval to ``low`` (if larger) for one more holder.
    Any thread; taken when a reactor goes from idle to busy, not per request or block."""
    global _si_holds, _si_saved
    with _si_lock:
        cur = sys.getswitchinterval()
        if _si_holds == 0:
            _si_saved = cur
        _si_holds += 1
        if cur > low:
            sys.setswitchinterval(low)


def _si_release() -> None:
    """End one :func:`_si_hold`; the last one restores the interval seen by the first."""
    global _si_holds
    with _si_lock:
        if _si_holds <= 0:
            return
        _si_holds -= 1
        if _si_holds == 0:
            sys.setswitchinterval(_si_saved)


@dataclass
class Completion:
    """Outcome of one request. ``ok[i]`` is the status of item ``i`` of the request
    (for a ``"store_copied"`` acknowledgement: of the items finished so far)."""

    req_id: Hashable
    kind: str  # "load", "store", or "store_copied" (early acknowledgement, see Reactor)
    ok: list[bool]
    cancelled: bool = False

    @property
    def success(self) -> bool:
        return all(self.ok) and not self.cancelled


#: Most events kept by a reactor's diagnostic trace.
TRACE_MAX = 1_000_000
#: Diagnostic trace only: a probe thread sleeps this long, again and again, and records
#: ``gil_late`` (microseconds) when it resumes more than GIL_LATE_S after it should have:
#: the time it waited for the GIL, i.e. some thread held it that long.
GIL_PROBE_S = 0.001
GIL_LATE_S = 0.003
#: trace only: sample the engine thread's stack when it has not marked a step for this
#: long (s) while requests are outstanding, at most every STALL_SAMPLE_EVERY_S
STALL_SAMPLE_S = 0.25
STALL_SAMPLE_EVERY_S = 0.1
STALL_SAMPLE_FRAMES = 10
#: trace only: how often the probe records this process's new major page faults
#: (``majflt`` events: code or data paged in from disk, e.g. a library's pages after
#: ``drop_caches``, each read queued behind the cache's own reads)
FAULT_SAMPLE_S = 0.1
#: values of ``io_async`` (see :class:`Reactor`)
IO_ASYNC = ("auto", "on", "off")
#: Longest kernel wait while only store copies are in flight (see ``_run``).
STORE_POLL_S = 0.001
#: keys remembered for ``disk_reads_repeat`` (a set cleared when full: ~100 B a key)
READ_KEYS_MAX = 1 << 16
#: The same with ``store_copy_wait="block"``: a waiter thread wakes the reactor when a
#: store copy is done, so this is only a safety net (a lost wake-up costs at most this).
STORE_SAFETY_POLL_S = 0.05
#: values of ``store_copy_wait``
STORE_COPY_WAITS = ("poll", "block")
#: How often deadlines are checked while requests are outstanding (``io_timeout_s``).
EXPIRE_POLL_S = 0.05
#: task states with a file operation in flight (the ones a deadline applies to)
_IO_STATES = frozenset((OPENING, READING, W_OPENING, WRITING, SYNCING, CLOSING))


@dataclass
class ReactorStats:
    loads_ok: int = 0
    loads_dram: int = 0
    loads_miss: int = 0
    loads_corrupt: int = 0
    loads_error: int = 0
    stores_ok: int = 0
    stores_existing: int = 0
    #: deferred write-backs (``FLUSH`` items) started from a caller-owned slot, and those
    #: refused because the slot no longer held the key's block
    stores_flushed: int = 0
    flushes_invalid: int = 0
    #: file operations that passed ``io_timeout_s``: their item failed at once (a load is a
    #: miss, vLLM recomputes; a store is dropped); the operation itself is reaped whenever
    #: the kernel finishes it
    ops_expired: int = 0
    #: queued items of requests older than twice ``io_timeout_s`` (their operations never
    #: started: the I/O units were held by stuck operations), failed the same way
    items_expired: int = 0
    stores_dropped_enospc: int = 0
    stores_dropped_capacity: int = 0
    stores_dropped_backpressure: int = 0
    #: temp-file creates retried once after ENOENT/ESTALE (shard directory made again)
    temp_reopens: int = 0
    stores_error: int = 0
    #: store/promotion tasks that found their caller-owned slot still being written from
    #: (they wait for that write; a caller that keeps such slots pinned sees 0)
    ext_slot_waits: int = 0
    spec_requeued: int = 0
    preload_staged: int = 0
    preload_claimed: int = 0
    preload_joined: int = 0
    #: preloaded blocks whose slot was reclaimed before any load claimed them
    preload_wasted: int = 0
    #: preloads dropped before reading because every reclaimable staging slot held a
    #: fresher unclaimed preload (``preload_keep_s``): a preload never evicts one
    preload_dropped_full: int = 0
    #: on-demand loads that joined another on-demand load's read of the same block (one
    #: read, one device copy each)
    loads_joined: int = 0
    #: loads (``AFTER_LOAD``) that waited for another load's read into the DRAM-tier slot
    #: they copy from (a promotion in flight): one read, one device copy each
    loads_joined_promotion: int = 0
    preload_deduped: int = 0
    bytes_read: int = 0
    #: successful disk reads of a block this reactor had already read from disk (issue 10:
    #: "each block read from disk at most once while it is in use or in the DRAM tier";
    #: counted over the last READ_KEYS_MAX distinct keys, ``read_key_epochs`` times reset)
    disk_reads_repeat: int = 0
    read_key_epochs: int = 0
    bytes_written: int = 0
    copy_batches: int = 0
    peak_busy_slots: int = 0
    pool_bytes: int = 0
    slot_bytes: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def peak_staging_bytes(self) -> int:
        return self.peak_busy_slots * self.slot_bytes

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items()}
        d["peak_staging_bytes"] = self.peak_staging_bytes
        return d


class Reactor(LoadRouting):
    """Single-thread pipeline between a :class:`Layout`, a staging pool and a copier.

    ``retain`` turns finished slots into a DRAM cache tier (``policy`` lru|arc).
    ``early_store_ack``: a store request is also reported (``Completion.kind ==
    "store_copied"``) as soon as no item reads its source any more (every device copy
    done), while files are still being written (from staging slots or from caller-owned
    slots); the usual ``"store"`` completion follows when everything is written. A
    caller-owned slot stays owned by the task writing a file from it: a later task that
    would overwrite that slot (a store or a disk load into it) waits for it. vLLM's
    offloading scheduler waits for a store job before it reuses the job's GPU blocks
    (``jobs_to_flush``), so without this a new request waited for the previous request's
    disk writes.
    ``store_policy``: ``"drop"`` (serving: a store never waits for the disk; a block with
    no free staging slot above the foreground reservation is dropped and counted) or
    ``"wait"`` (benchmarks and tests: it waits for a slot, FIFO). ``write_depth``: most
    file writes in flight (default: io_depth // 2 with "drop", io_depth with "wait").
    ``switch_interval``: the reactor lowers ``sys.setswitchinterval`` to this (process
    wide) when it is larger, because GIL handoffs with a busy host process (vLLM's engine
    loop) otherwise throttle it; ``None`` leaves the interpreter alone.
    ``switch_interval_scope``: ``"process"`` lowers it once, here, for the life of the
    process; ``"busy"`` lowers it only while this reactor has a request in flight (a load,
    or a store until its last file is written; the reactor thread holds it from the first
    request's arrival to the last one's completion) and restores the interpreter's own
    value when every such reactor of the process is idle, so that vLLM's engine loop and
    its other Python threads (output serialization, sockets) keep CPython's longer
    interval while py-kvcache has nothing to do. Stores are included because an H200
    run that lowered it for disk loads only made stores and DRAM hits slower (README).
    Items are ``(key, ref, nbytes)`` or ``(key, ref, nbytes, slot, flags)``: ``slot`` >= 0
    names an external slot (index ``n_slots + i``) owned by the caller for the whole
    request; a load with ``IN_SLOT`` takes the bytes already in that slot (no disk), a
    store with ``NO_DISK`` only fills the slot. ``ref`` is what the copier reads/writes.
    ``on_complete`` (optional) is called on the reactor thread for every completion, in
    addition to queueing it for :meth:`poll`; it must not block.
    ``writeback_defer_s`` (config key of the same name, 0 = off): no new write-back file
    starts within that many seconds of the last load or store submission or
    :meth:`note_foreground`, unless the write-back queue is past its high-water mark.
    ``spec_depth`` (config key ``preload_depth``): speculative loads open or reading at
    once, 1..64, capped at ``io_depth - 1`` (see the module doc).
    ``write_depth_reading`` (config key of the same name; None = ``write_depth``): most
    file writes in flight for a new write-back file to start while any read (foreground
    or speculative) is queued, opening or in flight; 0 starts none then. Writes already
    started are not interrupted.
    ``preload_keep_s`` (config key of the same name; default 0 = off): a staged preload
    no load has claimed is not evicted by another preload for this long (30 matches the
    scheduler's ``STAGED_TTL_S``); 0 lets any preload evict it (see the module doc).
    """

    def __init__(self, layout: Layout, *, n_slots: int, external_slots: int = 0,
                 io_depth: int = 8, lookahead: int = 8,
                 retain: bool = False, policy: str = "lru", engine: str | IOEngine = "auto",
                 direct_io: str = "auto", copier: Callable[[StagingPool, int], Copier]
                 | None = None, pin: bool | str = "auto", verify: bool = True,
                 on_complete: Callable[[Completion], None] | None = None,
                 name: str = "kvcache-reactor",
                 switch_interval: float | None = SWITCH_INTERVAL_S,
                 switch_interval_scope: str = "process",
                 trace: bool = False, early_store_ack: bool = False,
                 store_policy: str = "wait", write_depth: int | None = None,
                 io_timeout_s: float = 0.0, store_copy_wait: str = "poll",
                 writeback_defer_s: float = 0.0, spec_depth: int = 1,
                 write_depth_reading: int | None = None, io_async: str = "auto",
                 preload_keep_s: float = 0.0) -> None:
        if io_async not in IO_ASYNC:
            raise ValueError(f"io_async must be one of {IO_ASYNC}, got {io_async!r}")
        if not 1 <= spec_depth <= 64:
            raise ValueError(f"spec_depth must be in 1..64, got {spec_depth!r}")
        if not 0 <= writeback_defer_s <= 10:
            raise ValueError(f"writeback_defer_s must be in 0..10, got {writeback_defer_s!r}")
        #: config key preload_keep_s (0: off, any preload may evict a staged one)
        self.preload_keep_s = float(preload_keep_s)
        if not 0 <= self.preload_keep_s <= 3600:
            raise ValueError(f"preload_keep_s must be in 0..3600, got {preload_keep_s!r}")
        if store_copy_wait not in STORE_COPY_WAITS:
            raise ValueError(f"store_copy_wait must be one of {STORE_COPY_WAITS}, got "
                             f"{store_copy_wait!r}")
        if store_policy not in ("wait", "drop"):
            raise ValueError(f"store_policy must be 'wait' or 'drop', got {store_policy!r}")
        self.store_drop = store_policy == "drop"
        if not io_timeout_s >= 0:
            raise ValueError(f"io_timeout_s must be >= 0, got {io_timeout_s!r}")
        #: deadline of one file operation (0: none); see :meth:`_expire`
        self.io_timeout_s = float(io_timeout_s)
        self._next_expire = 0.0
        self.layout = layout
        self.slot_bytes = layout.ns.file_bytes
        if switch_interval_scope not in ("process", "busy"):
            raise ValueError("switch_interval_scope must be 'process' or 'busy', got "
                             f"{switch_interval_scope!r}")
        #: "busy" scope: the interval held while requests are in flight (None: not held)
        self._si_low = switch_interval if switch_interval_scope == "busy" else None
        self._si_held = False  # whether this reactor holds it (reactor thread only)
        if (self._si_low is None and switch_interval is not None
                and sys.getswitchinterval() > switch_interval):
            # The reactor is a Python thread: inside vLLM it shares the GIL with the engine's
            # busy loop, and every I/O completion needs the GIL back. With CPython's default
            # 5 ms switch interval that handoff dominates (scripts/bench_gil.py: 0.8 vs
            # 3.3 GB/s with a busy thread beside the reactor); 0.5 ms keeps it small.
            log.info("py-kvcache: lowering the interpreter switch interval %.4f -> %.4f s",
                     sys.getswitchinterval(), switch_interval)
            sys.setswitchinterval(switch_interval)
        self.io_depth = io_depth
        #: speculative loads open or reading at once (see the module doc): never more than
        #: io_depth - 1, so that stuck speculative reads leave on-demand loads a unit
        self.spec_depth = min(int(spec_depth), max(1, io_depth - 1))
        #: most file writes in flight at once. Serving (``store_policy="drop"``): half the
        #: io_depth, so an on-demand read can always start (writes reach most of a disk's
        #: write bandwidth at half the depth: DESIGN.md section 4, 3.5 GB/s at 4 vs 3.6
        #: at 16). ``"wait"`` (storage benchmarks): all of it, as before.
        if write_depth is None:
            write_depth = max(1, io_depth // 2) if store_policy == "drop" else io_depth
        if not 1 <= write_depth <= io_depth:
            raise ValueError(f"write_depth must be in 1..io_depth, got {write_depth}")
        self.write_depth = write_depth
        if write_depth_reading is None:
            write_depth_reading = write_depth
        if not 0 <= write_depth_reading <= io_depth:
            raise ValueError(f"write_depth_reading must be in 0..io_depth, got "
                             f"{write_depth_reading!r}")
        #: the write cap while reads wait or run (never above write_depth)
        self.write_depth_reading = min(write_depth_reading, write_depth)
        #: ``writeback_defer_s`` (config key; when 0, env ``KVCACHE_WRITEBACK_DEFER_MS`` of
        #: older runs): after any new load or store (or :meth:`note_foreground`), start no
        #: write-back file for this long, unless more than half the caller-owned slots (or
        #: 8) wait to be written. For measuring how much background writes cost foreground
        #: work (issue 9); 0 = off.
        self.writeback_defer_s = writeback_defer_s or max(0.0, float(os.environ.get(
            "KVCACHE_WRITEBACK_DEFER_MS", "0") or 0)) / 1000.0
        self._fg_stamp = 0.0
        self._defer_left: float | None = None
        self._wq_high = max(8, external_slots // 2)
        self.lookahead = max(1, lookahead)
        self.verify = verify
        if n_slots < io_depth + 1:
            raise ValueError(f"staging pool of {n_slots} slots cannot serve io_depth "
                             f"{io_depth} (need at least io_depth + 1)")
        # One allocation: reactor-managed staging slots [0, n_slots), then caller-managed
        # ("external") slots [n_slots, n_slots + external_slots), e.g. a DRAM tier whose
        # index lives in vLLM's scheduler process.
        self.n_staging = n_slots
        self.pool = StagingPool(n_slots + external_slots, self.slot_bytes, pin=pin)
        self.alloc = SlotAllocator(n_slots, reserve_foreground=io_depth, retain=retain,
                                   policy=policy)
        self.direct = probe_direct(layout.base, direct_io)
        if isinstance(engine, IOEngine):
            self.engine = engine
        else:
            entries = 2 * (io_depth + self.lookahead) + 16
            # io_async (config key, KEY_HELP): "on" = IOSQE_ASYNC on every read and write
            # (io_uring_enter, which holds the GIL, returns without doing the I/O setup);
            # "auto" = only for buffered I/O; "off" = never.
            force = io_async == "on" or (io_async == "auto" and not self.direct)
            self.engine = make_engine(engine, depth=io_depth, entries=entries,
                                      force_async=force)
        self.copier = (copier or NullCopier)(self.pool, HEADER_BYTES)
        #: ``store_copy_wait="block"`` with an asynchronous copier: store-copy handles go to
        #: a waiter thread that blocks on each one with the GIL released
        #: (:meth:`Copier.wait_store`) and wakes the reactor when it is done, instead of
        #: the reactor waking every STORE_POLL_S to poll them (each wake-up takes the GIL
        #: from vLLM's engine thread). None: polling.
        self._waitq: queue.SimpleQueue | None = None
        if store_copy_wait == "block" and self.copier.asynchronous:
            self._waitq = queue.SimpleQueue()
            self.copier.blocking_store_events = True
        self._iov = [self.engine.make_iov(v) for v in self.pool.views]
        self._slot_len = [0] * self.pool.n_slots  # payload bytes held by a retained slot
        self.stats = ReactorStats(pool_bytes=self.pool.nbytes, slot_bytes=self.slot_bytes)
        #: Diagnostics (reactor thread writes, anyone may read): seconds spent issuing
        #: device copies (loads / stores), the number of loop iterations (each one a wake-up
        #: that takes the GIL back from vLLM's engine thread), and the seconds spent in
        #: those iterations' work (``step_s``: Python under the GIL, engine waits excluded);
        #: ``copy_waits``: store copies the waiter thread saw done (it alone writes it);
        #: ``from_device_max_s``: the longest issue of one store job's copy;
        #: ``submit_s`` / ``submit_max_s``: time in the engine's submit (io_uring_enter,
        #: under the GIL: see ``io_async``), in all and the longest one.
        self.timing = {"to_device_s": 0.0, "from_device_s": 0.0, "from_device_max_s": 0.0,
                       "iterations": 0, "step_s": 0.0, "copy_waits": 0,
                       "submit_s": 0.0, "submit_max_s": 0.0}
        self.early_store_ack = early_store_ack
        #: Optional event trace (diagnostics): (time.monotonic(), event, request id, n),
        #: appended by the reactor thread, read after :meth:`close`. Bounded.
        self.trace: list[tuple[float, str, Any, int]] | None = [] if trace else None
        self._on_complete = on_complete
        #: None while the reactor thread serves; the reason once it died (every request
        #: then completes at once with its items failed: callers recompute)
        self.dead: str | None = None
        #: time.monotonic() of the loop's last iteration (read by the worker's watchdog)
        self.heartbeat = time.monotonic()
        #: time.monotonic() when the reactor last went from no request outstanding to one
        #: (set by the submitting thread): an idle reactor sleeps without a heartbeat, so
        #: the watchdog counts a stall from the later of the two (:meth:`stalled_for`)
        self.busy_since = self.heartbeat
        #: held while deciding to issue a device copy and issuing it, and by
        #: :meth:`declare_stalled` while it marks the reactor dead: no copy is issued after
        #: a caller gave the reactor's requests up (vLLM may already reuse those GPU blocks)
        self._copy_gate = threading.Lock()
        self._rflags = os.O_RDONLY | (os.O_DIRECT if self.direct else 0)
        self._wflags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct else 0)
        # client -> reactor
        self._inbox: collections.deque = collections.deque()
        # reactor state
        self._tasks: dict[int, Task] = {}
        self._free_tasks: list[Task] = []
        self._next_tid = 1
        self._new_fg: collections.deque[Task] = collections.deque()  # foreground loads
        self._new_store: collections.deque[Task] = collections.deque()  # stores, no slot yet
        self._wq: collections.deque[Task] = collections.deque()  # copied, file not started
        #: completion handler per Op (index = the op code; CLOSE needs none)
        self._handlers: tuple[Callable[[Task, int], None] | None, ...] = (
            self._on_open, self._on_read, self._on_wopen, self._on_write, self._on_fsync,
            None, self._on_wclose)
        assert all((h is None) == (op == Op.CLOSE) for op, h in zip(Op, self._handlers,
                                                                     strict=True))
        self._new_spec: collections.deque[Task] = collections.deque()
        self._opened_fg: collections.deque[Task] = collections.deque()
        self._opened_spec: collections.deque[Task] = collections.deque()
        self._ready: list[Task] = []          # reads done this iteration -> one batch
        self._verify: list[Task] = []         # reads completed, header/checksum not checked
        self._copies: collections.deque = collections.deque()  # (handle, [tasks])
        self._store_copies: list[tuple[Any, list[Task]]] = []  # (handle, tasks) batches
        self._sb_tasks: dict[Any, list[Task]] = {}  # per-iteration store batches (scratch)
        self._opening = 0
        self._io_inflight = 0
        self._writes_inflight = 0  # file writes holding an io_depth unit (<= write_depth)
        # speculative loads opening, open or reading (at most ``spec_depth``)
        self._spec_live: set[Task] = set()
        self._read_keys: set[bytes] = set()  # disk_reads_repeat (reactor thread only)
        self._spec_by_key: dict[bytes, Task] = {}  # preloads not yet staged
        self._joiners: dict[bytes, list[Task]] = {}  # loads waiting on a preload's read
        # on-demand loads reading a block into a staging slot (the first of their key),
        # and the loads of the same key that wait for that read instead of their own
        self._fg_by_key: dict[bytes, Task] = {}
        self._fg_joiners: dict[bytes, list[Task]] = {}
        # Caller-owned (external) slots: the task that currently writes the slot or writes
        # a file FROM it; later tasks that would overwrite the slot wait here, in order.
        # (An early-acknowledged store may still be writing its file from the slot when
        # the caller reuses the slot for another key.)
        self._ext_owner: dict[int, int] = {}
        self._ext_wait: dict[int, collections.deque] = {}
        # key a preload staged in a slot, until a load claims it (stale once reclaimed:
        # compared with the claiming key, so a reused slot never counts)
        self._staged: list[bytes | None] = [None] * self.pool.n_slots
        self._staged_at = [0.0] * self.pool.n_slots  # when it was staged (monotonic)
        self._spec_now = 0.0  # the time _spec_evictable compares with (reactor thread)
        # preload_keep_s > 0: the predicate a speculative acquire passes, bound once (None:
        # off, the allocator's own rule)
        self._spec_evictable = self._not_fresh_staged if self.preload_keep_s > 0 else None
        self._reqs: dict[Hashable, Request] = {}
        self._cqes: list[tuple[int, int]] = []
        self._b_slots: list[int] = []
        self._b_dests: list[Any] = []
        self._b_nbytes: list[int] = []
        # reactor -> client
        self._done: collections.deque[Completion] = collections.deque()
        self._cv = threading.Condition()
        self._outstanding = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._gc_cb: Callable[[str, dict], None] | None = None
        self._gc_t0: float | None = None
        #: the engine thread's last step mark (``trace_event``), for the stall sampler
        self._step_t = 0.0
        self._step_thread: int | None = None
        if self.trace is not None:
            threading.Thread(target=self._gil_probe, name=f"{name}-gil-probe",
                             daemon=True).start()
            self._gc_cb = self._gc_trace
            gc.callbacks.append(self._gc_cb)
        self._waiter: threading.Thread | None = None
        if self._waitq is not None:
            self._waiter = threading.Thread(target=self._wait_store_copies,
                                            name=name + "-copywait", daemon=True)
            self._waiter.start()

    # ================================================================ client API
    def load(self, req_id: Hashable, items: Sequence[Item | tuple],
             priority: Priority = Priority.FOREGROUND) -> None:
        """Queue a load of ``items`` (:class:`~kvcache_core.tasks.Item`, or tuples
        (key, dest, nbytes[, slot, flags])); completes via :meth:`poll`."""
        self._submit(req_id, LOAD, items, priority)

    def store(self, req_id: Hashable, items: Sequence[Item | tuple]) -> None:
        """Queue a store of ``items`` = [(key, src, nbytes)] (src: what the copier reads),
        or [(key, src, nbytes, external slot, flags)] to store into a caller-owned slot
        (``NO_DISK``: fill the slot, write no file; ``FLUSH``: src None, nbytes 0, the
        block is in the slot already from an earlier ``NO_DISK`` store: write its file
        only, the caller keeps the slot unchanged until this completes)."""
        self._submit(req_id, STORE, items, Priority.FOREGROUND)

    @property
    def healthy(self) -> bool:
        """False once the reactor thread has died (see :attr:`dead`)."""
        return self.dead is None

    @property
    def outstanding(self) -> int:
        """Requests submitted and not completed (any thread)."""
        return self._outstanding

    def stalled_for(self) -> float:
        """Seconds the reactor has had requests outstanding without its loop turning
        (0.0 when none is outstanding). Any thread; the worker's watchdog reads it. A
        reactor that slept through an idle period and was just handed a request has not
        stalled: it is counted from the submission, not from its last turn."""
        if not self._outstanding:
            return 0.0
        return time.monotonic() - max(self.heartbeat, self.busy_since)

    def declare_stalled(self, reason: str, timeout: float = 5.0) -> bool:
        """Give the reactor up from another thread (the worker's watchdog): the reactor
        thread is alive but stuck (a synchronous syscall on a hung filesystem). After this
        returns True, the reactor never issues another device copy, every device copy
        issued before has finished, and new submissions fail at once; the caller reports
        the requests still in flight as failed itself. False if a device copy being issued
        kept the gate for ``timeout`` seconds (then it is not stuck: try again later)."""
        if not self._copy_gate.acquire(timeout=timeout):
            return False
        try:
            if self.dead is None:
                self.dead = reason
                log.error("py-kvcache: %s; the engine runs recompute-only from now on", reason)
        finally:
            self._copy_gate.release()
        self.copier.sync_all()
        return True

    def cancel(self, req_id: Hashable) -> None:
        """Cancel a request: tasks not yet reading/writing are dropped (completion says so)."""
        self._inbox.append(_CancelMsg(req_id))
        self.engine.wake()

    def _submit(self, req_id, kind, items, prio) -> None:
        items = list(items)
        limit = self.layout.ns.block_bytes
        n_pool = self.pool.n_slots
        for item in items:  # reject bad input here, in the caller's thread, with a clear error
            key, nbytes = item[0], item[2]
            if not isinstance(key, (bytes, bytearray)) or not 0 < len(key) <= MAX_KEY_BYTES:
                raise ValueError(f"py-kvcache: key must be 1..{MAX_KEY_BYTES} bytes")
            flush = kind == STORE and len(item) > 4 and item[4] & FLUSH
            if flush and not (item[3] >= 0 and nbytes == 0):
                raise ValueError("py-kvcache: a FLUSH item names its external slot and "
                                 "nbytes 0 (the length comes from the slot's header)")
            if not 0 <= nbytes <= limit or (kind == STORE and nbytes == 0 and not flush):
                raise ValueError(f"py-kvcache: nbytes {nbytes} outside 1..{limit} (block size)")
            if len(item) > 3 and item[3] >= 0 and not self.n_staging <= item[3] < n_pool:
                raise ValueError(f"py-kvcache: slot {item[3]} is not an external slot "
                                 f"({self.n_staging}..{n_pool - 1})")
        if self.writeback_defer_s and prio == Priority.FOREGROUND:
            self._fg_stamp = time.monotonic()
        with self._cv:
            if not self._outstanding:
                self.busy_since = time.monotonic()
            self._outstanding += 1
        self._inbox.append(_ReqMsg(req_id, kind, items, prio))
        if self.dead is not None:  # nobody will serve it: fail it now (recompute)
            self._fail_inbox()
            return
        self.engine.wake()

    def poll(self) -> list[Completion]:
        """Completions finished since the last call (any client thread)."""
        out = []
        done = self._done
        while done:
            out.append(done.popleft())
        return out

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted request has completed. Returns False on timeout."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._outstanding:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self) -> None:
        """Stop the thread (in-flight I/O is finished first) and free the pool."""
        if not self._running:
            return
        self.wait(timeout=60)
        self._running = False
        if self._gc_cb is not None:
            with contextlib.suppress(ValueError):
                gc.callbacks.remove(self._gc_cb)
            self._gc_cb = None
        self.engine.wake()
        self._thread.join(timeout=30)
        if self._waiter is not None:
            assert self._waitq is not None
            self._waitq.put(None)
            self._waiter.join(timeout=30)
        if self._si_held and not self._thread.is_alive():  # requests never completed
            self._si_held = False
            _si_release()
        self.engine.shutdown()
        self.pool.close()

    def snapshot(self) -> dict[str, Any]:
        self.stats.peak_busy_slots = self.alloc.peak_busy
        d = self.stats.as_dict()
        d.update(engine=self.engine.name, direct_io=self.direct, cached_slots=self.alloc.cached,
                 layout=dict(self.layout.stats.__dict__))
        return d

    # ================================================================ reactor thread
    def _run(self) -> None:
        try:
            timing = self.timing
            while self._running or self._inbox:
                timing["iterations"] += 1
                self.heartbeat = t0 = time.monotonic()
                worked = self._step()
                timing["step_s"] += time.monotonic() - t0
                if not worked:
                    # Device copies in flight (CUDA events) wake nobody: poll them. LOAD
                    # copies are on a request's critical path: poll with a zero timeout
                    # (measured on the H200, docs/results/h200/longdoc-*: napping 200 us
                    # there made 64k disk hits 1.36x slower). STORE copies are not (vLLM
                    # defers them): wait up to STORE_POLL_S in the kernel with the GIL
                    # released, instead of spinning against vLLM's model-runner thread
                    # while a long prefill is being stored.
                    timeout = (0.0 if self._copies else
                               (STORE_POLL_S if self._waitq is None else STORE_SAFETY_POLL_S)
                               if self._store_copies else
                               self._defer_left if self._wq else None)
                    if self.io_timeout_s and self._reqs and (timeout is None
                                                             or timeout > EXPIRE_POLL_S):
                        timeout = EXPIRE_POLL_S  # deadlines need a clock, not only CQEs
                    self.engine.wait(timeout if self._running else 0.01)
        except BaseException as e:  # a bug: make it visible, fail everything, stay failed
            log.exception("py-kvcache reactor crashed")
            self.dead = f"{type(e).__name__}: {e}"
            self._fail_everything()

    def _step(self) -> bool:
        worked = False
        inbox = self._inbox
        while inbox:
            self._handle_msg(inbox.popleft())
            worked = True
        cq = self._cqes
        if self.engine.reap(cq):
            worked = True
            for tag, res in cq:
                self._on_cqe(tag, res)
            cq.clear()
        if self._copies and self._poll_copies():
            worked = True
        if self._store_copies and self._poll_store_copies():
            worked = True
        if self._schedule():
            worked = True
        if self._verify:
            self.engine.submit()  # new reads reach the disk before we hash finished ones
            self._verify_reads()
            worked = True
        if self._ready:
            self._flush_batch()
            worked = True
        if self.io_timeout_s and self._reqs:
            now = time.monotonic()
            if now >= self._next_expire:
                self._next_expire = now + EXPIRE_POLL_S
                if self._expire(now):
                    worked = True
        if self.engine.pending():
            t0 = time.perf_counter()
            self.engine.submit()
            dt = time.perf_counter() - t0
            timing = self.timing
            timing["submit_s"] += dt
            if dt > timing["submit_max_s"]:
                timing["submit_max_s"] = dt
        return worked

    # ---------------------------------------------------------------- inbox
    def _handle_msg(self, msg: _ReqMsg | _CancelMsg) -> None:
        if type(msg) is _CancelMsg:
            self._cancel(msg.req_id)
            return
        req_id, kind, items, prio = msg
        req = Request(req_id, kind, len(items), prio)
        if self.trace is not None:
            self._trace("load" if kind == LOAD else "store", req_id, len(items))
        if not items:
            self._complete(req)
            return
        self._reqs[req_id] = req
        if self._si_low is not None and not self._si_held:
            self._si_held = True
            _si_hold(self._si_low)
        for i, item in enumerate(items):
            t = self._new_task()
            t.kind, t.key, t.ref, t.nbytes = kind, item[0], item[1], item[2]
            t.req, t.idx, t.prio = req, i, prio
            if kind == STORE:
                if len(item) > 4 and item[4] & FLUSH:
                    t.copied = True  # its bytes are in the slot already: no source to wait
                else:
                    req.hold += 1
            if len(item) > 3 and item[3] >= 0:
                t.slot, t.ext, t.flags = item[3], True, item[4]
                if kind == LOAD and t.flags & IN_SLOT:  # DRAM tier owned by the caller
                    if not t.flags & AFTER_LOAD:  # a DRAM-tier hit: copy it now
                        t.state = READY
                        self.stats.loads_dram += 1
                        self._ready.append(t)
                        continue
                    # it copies from a slot that a promotion of its key fills: it owns
                    # the slot like any task, so it waits while the promotion (or an
                    # earlier such load) owns it, and a later task reusing the slot
                    # waits for its copy
                    self.stats.loads_joined_promotion += 1
                t.xslot = t.slot
                if t.slot in self._ext_owner:  # still in use by an earlier task: wait
                    if not t.flags & AFTER_LOAD:
                        self.stats.ext_slot_waits += 1
                    self._ext_wait.setdefault(t.slot, collections.deque()).append(t)
                    continue
                self._ext_owner[t.slot] = t.tid
            self._route(t)

    def _route(self, t: Task) -> None:
        if t.kind == LOAD:
            if t.flags & IN_SLOT:  # AFTER_LOAD, owning its slot: the read is done (or
                t.state = READY    # failed, its header zeroed: _void_for_waiters)
                self._ready.append(t)
                return
            self._route_load(t)
        elif t.flags & FLUSH:
            self._start_flush(t)
        else:
            self._new_store.append(t)

    def _start_flush(self, t: Task) -> None:
        """A deferred write-back: the block is in ``t``'s caller-owned slot already (an
        earlier store kept it there without a file), so it joins the write-back queue as
        if just copied. A slot that does not hold the key fails the item, writes nothing."""
        view = self.pool.views[t.slot]
        try:
            n = self.layout.check_identity(view, t.key)
        except CorruptBlock as e:
            log.warning("py-kvcache: flush of a slot that does not hold its key: %s", e)
            self.stats.flushes_invalid += 1
            self._finish(t, False)
            return
        if self.layout.exists(t.key):  # written meanwhile (another instance)
            self.stats.stores_existing += 1
            self._finish(t, True)
            return
        self.stats.stores_flushed += 1
        t.nbytes = n
        t.wlen = HEADER_BYTES + round_up(n)
        t.state = WB_QUEUED
        self._wq.append(t)

    def _new_task(self) -> Task:
        t = self._free_tasks.pop() if self._free_tasks else Task()
        t.reset()
        t.tid = self._next_tid
        t.tag = t.tid << OP_BITS  # an I/O's tag is t.tag | Op
        self._next_tid += 1
        self._tasks[t.tid] = t
        return t

    def _cancel(self, req_id) -> None:
        req = self._reqs.get(req_id)
        if req is None:
            return
        req.cancelled = True
        for dq in (self._new_fg, self._new_store, self._new_spec, self._opened_fg,
                   self._opened_spec, *self._ext_wait.values()):
            for t in [t for t in dq if t.req is req]:
                if t not in dq:  # a waiting task started meanwhile (slot released)
                    continue
                dq.remove(t)
                if t.fd >= 0:
                    self.engine.close(t.tag | OP_CLOSE, t.fd)
                    t.fd = -1
                self._finish(t, False)  # leaves _spec_live too (_report)

    # ---------------------------------------------------------------- scheduling
    def _schedule(self) -> bool:
        worked = False
        eng = self.engine
        # 1. ready foreground reads
        while self._opened_fg and self._io_inflight < self.io_depth:
            t = self._opened_fg[0]
            slot = t.slot if t.ext else self._acquire(t.tid, Priority.FOREGROUND)
            if slot < 0:
                break
            self._opened_fg.popleft()
            self._start_read(t, slot)
            worked = True
        # 2. new stores: a slot now (or drop / wait, see store_policy), device copies
        #    issued as one batch per request; no io_depth unit is taken here
        if self._new_store and self._start_stores():
            worked = True
        # 3. new foreground loads: open ahead
        while self._new_fg:
            if self._opening + len(self._opened_fg) >= self.lookahead:
                break
            t = self._new_fg.popleft()
            t.state = OPENING
            t.t_op = time.monotonic()
            self._opening += 1
            eng.open(t.tag | OP_OPEN, self.layout.path_for(t.key), self._rflags)
            worked = True
        # 4. write-back: copied blocks whose file is not started, while io_depth allows
        #    (after step 1, so a freed unit goes to a ready foreground read first), at
        #    most ``write_depth`` files at once so that reads always keep units
        if self._wq and self.writeback_defer_s and self._deferring():
            pass  # foreground work just arrived: let it have the machine (diagnostic knob)
        elif self._wq:
            wd = self.write_depth
            if wd > self.write_depth_reading and (
                    self._new_fg or self._opened_fg or self._opening or self._new_spec
                    or self._opened_spec or self._io_inflight > self._writes_inflight):
                wd = self.write_depth_reading  # reads first (write_depth_reading)
            while (self._wq and self._io_inflight < self.io_depth
                   and self._writes_inflight < wd):
                self._start_write(self._wq.popleft())
                worked = True
        # 5. speculative: up to spec_depth at a time, above the foreground reservation
        while (len(self._spec_live) < self.spec_depth and self._new_spec
               and not self._opened_fg):
            t = self._new_spec.popleft()
            self._spec_live.add(t)
            t.state = OPENING
            t.t_op = time.monotonic()
            self._opening += 1
            eng.open(t.tag | OP_OPEN, self.layout.path_for(t.key), self._rflags)
            worked = True
        while self._opened_spec and not self._opened_fg and self._io_inflight < self.io_depth:
            t = self._opened_spec[0]
            if t.ext:
                slot = t.slot
            else:
                keep = self._spec_evictable
                if keep is not None:
                    self._spec_now = time.monotonic()
                slot = self._acquire(t.tid, Priority.SPECULATIVE, keep)
                if (slot < 0 and keep is not None
                        and self.alloc.available(Priority.SPECULATIVE)):
                    # slots above the reservation exist, but each holds a preload staged
                    # less than preload_keep_s ago that no load has claimed yet: a preload
                    # planned later (for a request further back in vLLM's queue, or more
                    # of one request than staging holds) does not evict it; it is dropped
                    # (its request reads the block on demand)
                    self._opened_spec.popleft()
                    self.engine.close(t.tag | OP_CLOSE, t.fd)
                    t.fd = -1
                    self.stats.preload_dropped_full += 1
                    self._finish(t, False)
                    worked = True
                    continue
            if slot < 0:
                break
            self._opened_spec.popleft()
            self._start_read(t, slot)
            worked = True
        return worked

    def _not_fresh_staged(self, key: Hashable) -> bool:
        """Whether a speculative read may reclaim the cached staging slot of ``key``: not
        while it holds an unclaimed preload staged less than ``preload_keep_s`` ago."""
        slot = self.alloc.index[key]
        return not (self._staged[slot] == key
                    and self._spec_now - self._staged_at[slot] < self.preload_keep_s)

    def note_foreground(self) -> None:
        """Foreground work is happening now (any thread; a plain float store): with
        ``writeback_defer_s`` set, no new write-back file starts for that long."""
        self._fg_stamp = time.monotonic()

    def _deferring(self) -> bool:
        """Whether write-back waits for foreground work (``writeback_defer_s`` after the
        last :meth:`note_foreground`), unless its queue is past the high-water mark."""
        if len(self._wq) >= self._wq_high:
            self._defer_left = None
            return False
        left = self._fg_stamp + self.writeback_defer_s - time.monotonic()
        if left <= 0:
            self._defer_left = None
            return False
        self._defer_left = left
        return True

    def _start_stores(self) -> bool:
        """Give each new store a slot now and issue the device copies, one batch per
        request. Caller-owned slots need nothing; a staging slot comes from the allocator
        above the foreground reservation (``"drop"``: none free -> the block and the
        request's later staging blocks are dropped; ``"wait"``: the queue waits, FIFO)."""
        q = self._new_store
        batches = self._sb_tasks
        prio = Priority.SPECULATIVE if self.store_drop else Priority.FOREGROUND
        worked = False
        while q:
            t = q[0]
            if not t.ext:
                if t.req.dropping:
                    q.popleft()
                    self.stats.stores_dropped_backpressure += 1
                    self._finish(t, False)
                    worked = True
                    continue
                if self.layout.exists(t.key):  # already stored: nothing to do
                    q.popleft()
                    self.stats.stores_existing += 1
                    self._finish(t, True)
                    worked = True
                    continue
                slot = self._acquire(t.tid, prio)
                if slot < 0:
                    if not self.store_drop:
                        break
                    q.popleft()
                    t.req.dropping = True
                    self.stats.stores_dropped_backpressure += 1
                    self._finish(t, False)
                    worked = True
                    continue
                t.slot = slot
            q.popleft()
            t.state = COPY_IN
            b = batches.get(t.req)
            if b is None:
                batches[t.req] = [t]
            else:
                b.append(t)
            worked = True
        if batches:
            for tasks in batches.values():
                self._copy_in(tasks)
            batches.clear()
        return worked

    def _copy_in(self, tasks: list[Task]) -> None:
        """ONE device -> host copy for ``tasks`` (blocks of one store request)."""
        try:
            c0 = time.perf_counter()
            with self._copy_gate:
                if self.dead is not None:  # given up: the GPU blocks may be reused already
                    raise RuntimeError(f"reactor given up ({self.dead})")
                handle = self.copier.from_device_batch([t.slot for t in tasks],
                                                       [t.ref for t in tasks],
                                                       [t.nbytes for t in tasks])
            dt = time.perf_counter() - c0
            self.timing["from_device_s"] += dt
            if dt > self.timing["from_device_max_s"]:
                self.timing["from_device_max_s"] = dt
        except Exception as e:  # bad source: fail these items, keep serving
            log.error("py-kvcache: store copy of %d blocks failed: %s", len(tasks), e)
            for t in tasks:
                self._store_failed(t, "copy", -_errno.EINVAL)
            return
        for t in tasks:
            t.ref = None
        self._store_copies.append((handle, tasks))
        if self._waitq is not None:
            self._waitq.put(handle)

    def _wait_store_copies(self) -> None:
        """Waiter thread (``store_copy_wait="block"``): block on each store copy in issue
        order with the GIL released, then wake the reactor, which finds it done in
        :meth:`_poll_store_copies`. One GIL acquisition per store job instead of one per
        STORE_POLL_S while copies are in flight. Never touches reactor state."""
        q, copier, wake = self._waitq, self.copier, self.engine.wake
        assert q is not None
        while True:
            handle = q.get()
            if handle is None:
                return
            try:
                copier.wait_store(handle)
            except Exception as e:  # the reactor's own poll still sees it (done or not)
                log.warning("py-kvcache: waiting for a store copy failed: %s", e)
            self.timing["copy_waits"] += 1
            wake()

    def _start_write(self, t: Task) -> None:
        """Write-back of a copied block: checksum, capacity, temp file, one ``io_depth``
        unit."""
        if self.trace is not None:
            self._trace("write_start", None, t.nbytes)
        self.layout.seal_header(self.pool.views[t.slot], t.nbytes)
        if not self.layout.reserve(t.wlen):
            self.stats.stores_dropped_capacity += 1
            self._drop_slot(t)
            self._finish(t, False)
            return
        try:
            t.tmp, t.final = self.layout.temp_path_for(t.key)
        except OSError as e:
            self._store_failed(t, "mkdir", -(e.errno or _errno.EIO))
            return
        t.state = W_OPENING
        t.t_op = time.monotonic()
        t.depth = True
        self._io_inflight += 1
        self._writes_inflight += 1
        self.engine.open(t.tag | OP_WOPEN, t.tmp, self._wflags)

    def _start_read(self, t: Task, slot: int) -> None:
        t.slot = slot
        t.state = READING
        t.t_op = time.monotonic()
        self._io_inflight += 1
        self.engine.read(t.tag | OP_READ, t.fd, self._iov[slot], 0)
        if self.trace is not None:  # per block: the order the disk is asked to read in
            self._trace("read_start", t.req.req_id, t.idx)

    # ---------------------------------------------------------------- completions
    def _on_cqe(self, tag: int, res: int) -> None:
        """One completion: its task (the tag's high bits) and its operation's handler (the
        low bits). A task already expired only gives its resources back (:meth:`_reap`);
        a plain close needs nothing."""
        op = tag & OP_MASK
        t = self._tasks.get(tag >> OP_BITS)
        if op == OP_CLOSE or t is None:
            return
        if t.expired:  # already reported failed: only give its resources back
            self._reap(t, op, res)
            return
        self._handlers[op](t, res)

    def _on_open(self, t: Task, res: int) -> None:
        """A read-side open completed (``res``: the fd or -errno)."""
        self._opening -= 1
        if t.req.cancelled:
            if res >= 0:
                self.engine.close(t.tag | OP_CLOSE, res)
            self._finish(t, False)
            return
        if res < 0:
            if res in (-_errno.ENOENT, -_errno.ESTALE):  # ESTALE: evicted by another
                self.stats.loads_miss += 1               # client of a network filesystem
            else:
                self._count_error("open", res)
                self.stats.loads_error += 1
            self._finish(t, False)
            return
        if t.flags & (SUPERSEDED | PREEMPTED):
            self.engine.close(t.tag | OP_CLOSE, res)
            self._spec_live.discard(t)
            if t.flags & SUPERSEDED:
                self._finish(t, True)
            else:
                t.flags &= ~PREEMPTED
                t.state = Q
                self._new_spec.appendleft(t)
                self.stats.spec_requeued += 1
            return
        t.fd = res
        t.state = OPENED
        (self._opened_spec if t.prio == Priority.SPECULATIVE else self._opened_fg).append(t)

    def _on_read(self, t: Task, res: int) -> None:
        """A block's read completed (``res``: bytes read or -errno)."""
        self._io_inflight -= 1
        if self.trace is not None:
            self._trace("read_done", t.req.req_id, t.idx)
        self.engine.close(t.tag | OP_CLOSE, t.fd)
        t.fd = -1
        self._spec_live.discard(t)
        if res < 0:
            if res == -_errno.ESTALE:  # evicted by another client of a network filesystem
                self.stats.loads_miss += 1
            else:
                self._count_error("read", res)
                self.stats.loads_error += 1
            self._drop_slot(t)
            self._finish(t, False)
            return
        # Verified after this iteration's new reads are submitted (see _step): the disk
        # gets its next requests before we spend ~1 ms hashing 28 MiB.
        t.nread = res
        self._verify.append(t)

    def _on_wopen(self, t: Task, res: int) -> None:
        """A temp-file create completed (``res``: the fd or -errno)."""
        if res in (-_errno.ENOENT, -_errno.ESTALE) and not t.reopened:
            # The shard directory is gone or stale: removed by `kvcache purge`/gc, or
            # a mkdir race between two clients of a distributed filesystem (GlusterFS
            # keeps a stale entry for about a second). Make it again, retry once.
            t.reopened = True
            self.stats.temp_reopens += 1
            try:
                t.tmp, t.final = self.layout.temp_path_for(t.key, remake=True)
            except OSError as e:
                self._store_failed(t, "mkdir", -(e.errno or _errno.EIO))
                return
            t.t_op = time.monotonic()
            self.engine.open(t.tag | OP_WOPEN, t.tmp, self._wflags)
            return
        if res < 0:
            self._store_failed(t, "open", res)
            return
        t.fd = res
        t.state = WRITING
        t.t_op = time.monotonic()
        self.engine.write(t.tag | OP_WRITE, res, self._write_iov(t), 0)

    def _on_write(self, t: Task, res: int) -> None:
        """A block file's write completed (``res``: bytes written or -errno)."""
        if res != t.wlen:  # a short write is how a full filesystem answers (tmpfs)
            self._store_failed(t, "write", res if res < 0 else -_errno.ENOSPC)
            return
        self._io_inflight -= 1
        self._writes_inflight -= 1
        t.depth = False
        self.stats.bytes_written += res
        t.t_op = time.monotonic()
        if self.layout.durable:
            t.state = SYNCING
            self.engine.fsync(t.tag | OP_FSYNC, t.fd)
        else:
            t.state = CLOSING
            self.engine.close(t.tag | OP_WCLOSE, t.fd)

    def _on_fsync(self, t: Task, res: int) -> None:
        """``durable``: a block file's fdatasync completed."""
        if res < 0:
            self._store_failed(t, "fsync", res)
            return
        t.state = CLOSING
        t.t_op = time.monotonic()
        self.engine.close(t.tag | OP_WCLOSE, t.fd)

    def _on_wclose(self, t: Task, res: int) -> None:
        """A written temp file was closed: publish it under its final name."""
        t.fd = -1
        if res < 0:  # close reports a deferred write error (NFS, FUSE): not complete
            self._store_failed(t, "close", res)
            return
        try:
            published = self.layout.publish(t.tmp, t.final, t.wlen)
        except OSError as e:
            self.layout.discard(t.tmp)
            if isinstance(e, CapacityExceeded):  # max_disk_bytes, checked at publish
                self.stats.stores_dropped_capacity += 1
            elif e.errno in (_errno.ENOSPC, _errno.EDQUOT):
                self.stats.stores_dropped_enospc += 1
            else:
                self._count_error("publish", -(e.errno or _errno.EIO))
                self.stats.stores_error += 1
            self._drop_slot(t)
            self._finish(t, False)
            return
        if self.trace is not None:
            self._trace("write_done", None, t.nbytes)
        if published:
            self.stats.stores_ok += 1
        else:
            self.stats.stores_existing += 1
        if not t.ext:
            self._slot_len[t.slot] = t.nbytes
            self.alloc.release(t.slot, t.key)
        t.slot = -1
        self._finish(t, True)

    def _acquire(self, tid: int, prio: Priority,
                 evictable: Callable[[Hashable], bool] | None = None) -> int:
        """A staging slot for task ``tid`` (-1: none; ``evictable`` as for
        :meth:`SlotAllocator.acquire`). A slot that still held a preloaded block no load
        claimed counts that preload as wasted."""
        slot = self.alloc.acquire(tid, prio, evictable)
        if slot >= 0 and self._staged[slot] is not None:
            self._staged[slot] = None
            self.stats.preload_wasted += 1
        return slot

    def _verify_reads(self) -> None:
        verify = self._verify
        for t in verify:
            res = t.nread
            try:
                n = self.layout.check_block(self.pool.views[t.slot], res, t.key, self.verify)
            except CorruptBlock as e:
                log.warning("py-kvcache: %s: %s; treated as a miss and removed",
                            self.layout.path_for(t.key), e)
                self.stats.loads_corrupt += 1
                self.layout.remove(t.key)
                self._drop_slot(t)
                self._finish(t, False)
                continue
            self.stats.bytes_read += res
            rk = self._read_keys
            if t.key in rk:
                self.stats.disk_reads_repeat += 1
            else:
                if len(rk) >= READ_KEYS_MAX:
                    rk.clear()
                    self.stats.read_key_epochs += 1
                rk.add(t.key)
            t.payload = n
            t.nbytes = min(t.nbytes, n) if t.nbytes else n
            if t.prio == Priority.SPECULATIVE and t.ref is None and not t.ext:
                self._stage(t)
                continue
            if self._fg_by_key and self._fg_by_key.get(t.key) is t:
                if t.key in self._fg_joiners:
                    self._share(t)
                    continue
                del self._fg_by_key[t.key]  # read done: later loads of it read again
            t.state = READY
            self._ready.append(t)
        verify.clear()

    def _write_iov(self, t: Task):
        if t.wlen == self.slot_bytes:
            return self._iov[t.slot]
        return self.pool.views[t.slot][:t.wlen]

    def _poll_store_copies(self) -> bool:
        progressed = False
        keep = []
        for handle, tasks in self._store_copies:
            if not self.copier.store_done(handle):
                keep.append((handle, tasks))
                continue
            progressed = True
            # The acknowledgement first (the device copy is all the job waited for) ...
            for t in tasks:
                if self.trace is not None:
                    self._trace("store_copied", t.req.req_id, t.idx)
                self._source_done(t, finishing=False)
            # ... then the headers: identity fields now, so a retained slot is always
            # self-describing; the payload checksum (~3 ms per 28 MiB) only when a file
            # is written, in _start_write, off the acknowledgement path.
            for t in tasks:
                view = self.pool.views[t.slot]
                t.wlen = self.layout.fill_header(view, t.key, t.nbytes, digest=False)
                if t.ext and (t.flags & NO_DISK or self.layout.exists(t.key)):
                    self.stats.stores_existing += not (t.flags & NO_DISK)
                    self._finish(t, True)
                    continue
                t.state = WB_QUEUED
                self._wq.append(t)
        self._store_copies = keep
        return progressed

    def _store_cleanup(self, t: Task) -> None:
        """Give back what a store's file write holds: I/O unit, fd, temp file, slot."""
        if t.depth:
            t.depth = False
            self._io_inflight -= 1
            self._writes_inflight -= 1
        if t.fd >= 0:
            self.engine.close(t.tag | OP_CLOSE, t.fd)
            t.fd = -1
        if t.tmp:
            self.layout.discard(t.tmp)
            t.tmp = None
        self._drop_slot(t)

    def _store_failed(self, t: Task, what: str, res: int) -> None:
        self._store_cleanup(t)
        if res in (-_errno.ENOSPC, -_errno.EDQUOT):
            self.stats.stores_dropped_enospc += 1
        else:
            self._count_error(what, res)
            self.stats.stores_error += 1
        self._finish(t, False)

    # ---------------------------------------------------------------- device copies
    def _flush_batch(self) -> None:
        slots, dests, nbytes = self._b_slots, self._b_dests, self._b_nbytes
        batch = self._ready
        for t in batch:
            slots.append(t.slot)
            dests.append(t.ref)
            nbytes.append(t.nbytes)
            t.state = COPY_OUT
        try:
            c0 = time.perf_counter()
            with self._copy_gate:
                if self.dead is not None:  # given up by the watchdog: never write the GPU
                    raise RuntimeError(f"reactor given up ({self.dead})")
                handle = self.copier.to_device(slots, dests, nbytes)
            self.timing["to_device_s"] += time.perf_counter() - c0
        except Exception as e:  # bad destination: fail the batch's items, keep serving
            log.error("py-kvcache: device copy of %d blocks failed: %s", len(batch), e)
            slots.clear()
            dests.clear()
            nbytes.clear()
            self._ready = []
            for t in batch:
                if t.cached:
                    self.alloc.unpin(t.slot)
                else:
                    self._drop_slot(t)
                t.slot = -1
                self.stats.loads_error += 1
                self._finish(t, False)
            return
        self.stats.copy_batches += 1
        slots.clear()
        dests.clear()
        nbytes.clear()
        self._ready = []
        self._copies.append((handle, batch))
        self._poll_copies()

    def _poll_copies(self) -> bool:
        progressed = False
        copies = self._copies
        while copies and self.copier.done(copies[0][0]):
            _, batch = copies.popleft()
            progressed = True
            if self.trace is not None:
                self._trace("load_copied", None, len(batch))
            for t in batch:
                if t.cached:
                    self.alloc.unpin(t.slot)
                elif not t.ext:
                    self._slot_len[t.slot] = t.payload
                    self.alloc.release(t.slot, t.key)
                # every hit refreshes the file's recency, DRAM and preload hits too: the
                # disk's LRU is shared by all processes (a no-op without max_disk_bytes)
                self.layout.touch(t.key)
                t.slot = -1
                self.stats.loads_ok += 1
                self._finish(t, True)
        return progressed

    # ---------------------------------------------------------------- bookkeeping
    def _drop_slot(self, t: Task) -> None:
        if t.slot >= 0 and not t.ext:
            self.alloc.release(t.slot)
            t.slot = -1

    def _count_error(self, what: str, res: int) -> None:
        name = f"{what}:{_errno.errorcode.get(-res, str(-res))}"
        self.stats.errors[name] = self.stats.errors.get(name, 0) + 1

    def _source_done(self, t: Task, finishing: bool) -> None:
        """A store item no longer reads its source (copied, or ``finishing`` before it
        was copied). The early acknowledgement goes out only while items are left to
        write (the last one finishing brings the usual completion instead)."""
        if not t.copied:
            t.copied = True
            req = t.req
            req.hold -= 1
            if req.hold == 0 and req.remaining > finishing:
                self._early_ack(req)

    def _early_ack(self, req: Request) -> None:
        """Every item of a store request has left its source: with ``early_store_ack``
        the request is reported now, as ``kind == "store_copied"``, while files are still
        being written; the final ``"store"`` completion follows as usual."""
        if not self.early_store_ack or req.acked:
            return
        req.acked = True
        if self.trace is not None:
            self._trace("ack_store", req.req_id, req.remaining)
        self._publish(Completion(req.req_id, "store_copied", list(req.ok), req.cancelled))

    def _finish(self, t: Task, ok: bool) -> None:
        ext_slot = t.xslot if t.xslot >= 0 and self._ext_owner.get(t.xslot) == t.tid else -1
        if not ok:
            self._void_for_waiters(t, ext_slot)
        self._report(t, ok)
        self._free(t, ext_slot)

    def _report(self, t: Task, ok: bool) -> None:
        """Count ``t``'s item as done (``ok``) in its request; complete the request when it
        was the last. The task itself is not freed (see :meth:`_free`)."""
        if t.kind == STORE:
            self._source_done(t, finishing=True)
        self._spec_live.discard(t)
        if t.prio == Priority.SPECULATIVE and self._spec_by_key.get(t.key) is t:
            del self._spec_by_key[t.key]
            if not ok:  # the shared read failed: so do the loads that joined it
                for j in self._joiners.pop(t.key, ()):
                    self._finish(j, False)
        elif self._fg_by_key and self._fg_by_key.get(t.key) is t:
            # a load that others joined ended without sharing its read (it failed, was
            # cancelled or expired; a success shares first): so do the joined loads
            del self._fg_by_key[t.key]
            for j in self._fg_joiners.pop(t.key, ()):
                self._finish(j, False)
        req = t.req
        req.ok[t.idx] = ok
        req.remaining -= 1
        if req.remaining == 0:
            self._reqs.pop(req.req_id, None)
            self._idle_check()
            self._complete(req)

    def _idle_check(self) -> None:
        """A request left ``_reqs``: when none is left, this reactor ends its hold on the
        lowered switch interval (``switch_interval_scope="busy"``)."""
        if self._si_held and not self._reqs:
            self._si_held = False
            _si_release()

    def _free(self, t: Task, ext_slot: int) -> None:
        """Recycle a finished task and hand its caller-owned slot (``ext_slot`` >= 0) to
        the next task waiting for it."""
        t.state = DONE
        del self._tasks[t.tid]
        t.reset()
        self._free_tasks.append(t)
        if ext_slot >= 0:
            self._release_ext(ext_slot)

    # ---------------------------------------------------------------- deadlines
    def _expire(self, now: float) -> bool:
        """Deadlines (``io_timeout_s``): a file operation in flight for longer fails its
        item now (:meth:`_expire_task`); a request older than twice that fails its items
        that never started (queued behind stuck operations), as a cancel does. Nothing
        here waits: a stuck operation keeps its slot and I/O unit until the kernel
        completes it (:meth:`_reap`), so the bounds of the pool still hold. Returns
        whether anything expired."""
        limit = self.io_timeout_s
        hit = False
        for t in [t for t in self._tasks.values()
                  if not t.expired and t.state in _IO_STATES and now - t.t_op > limit]:
            self._expire_task(t)
            hit = True
        for req in [r for r in self._reqs.values() if now - r.t0 > 2 * limit]:
            n0 = req.remaining
            self._cancel(req.req_id)
            if req.remaining < n0:
                self.stats.items_expired += n0 - req.remaining
                hit = True
            if req.remaining:  # the rest is in flight: those expire with their operations
                for t in [t for t in self._tasks.values()
                          if t.req is req and not t.expired and t.state in _IO_STATES]:
                    self._expire_task(t)
        return hit

    def _expire_task(self, t: Task) -> None:
        """``t``'s file operation passed its deadline: fail its item now (a load is a miss,
        a store is dropped) and keep the task, its fd, slot and I/O unit until the
        operation completes (the kernel may still be reading into or writing from the
        slot)."""
        self.stats.ops_expired += 1
        if self.stats.ops_expired == 1 or self.stats.ops_expired % 100 == 0:
            log.error("py-kvcache: a file operation on %s took longer than io_timeout_s=%.1f "
                      "s; its block is treated as a miss (loads are recomputed, stores "
                      "dropped); %d so far. Is the cache filesystem hung?",
                      self.layout.path_for(t.key), self.io_timeout_s, self.stats.ops_expired)
        t.expired = True
        self._report(t, False)

    def _reap(self, t: Task, op: int, res: int) -> None:
        """The operation of an expired task completed: release what it held, publish
        nothing, copy nothing."""
        if op == OP_OPEN:
            self._opening -= 1
            if res >= 0:
                self.engine.close(t.tag | OP_CLOSE, res)
        elif op == OP_READ:
            self._io_inflight -= 1
            self.engine.close(t.tag | OP_CLOSE, t.fd)
            t.fd = -1
            self._drop_slot(t)
        else:  # a store's open / write / fsync / close
            if op == OP_WOPEN and res >= 0:
                t.fd = res
            elif op == OP_WCLOSE:
                t.fd = -1
            self._store_cleanup(t)
        ext_slot = t.xslot if t.xslot >= 0 and self._ext_owner.get(t.xslot) == t.tid else -1
        self._void_for_waiters(t, ext_slot)  # what the late read left is not a block
        self._free(t, ext_slot)

    def _void_for_waiters(self, t: Task, ext_slot: int) -> None:
        """Promotion ``t`` (a disk read into caller-owned ``ext_slot``, which it owns)
        failed, was cancelled or expired: zero the slot's header, so that loads that copy
        from the slot (``AFTER_LOAD``) fail their header check instead of copying what
        the read left there, whether they already wait for the slot or arrive after the
        failure (a load submitted right behind the promotion can reach the reactor after
        a missing file's open has already failed)."""
        if ext_slot >= 0 and t.kind == LOAD and not t.flags & IN_SLOT:
            self.pool.views[ext_slot][:8] = bytes(8)

    def _release_ext(self, slot: int) -> None:
        """The owner of caller-owned ``slot`` finished: start the next task waiting for it."""
        del self._ext_owner[slot]
        waiting = self._ext_wait.get(slot)
        if not waiting:
            return
        nxt = waiting.popleft()
        if not waiting:
            del self._ext_wait[slot]
        self._ext_owner[slot] = nxt.tid
        self._route(nxt)

    def trace_event(self, event: str, req_id: Any = None, n: int = 0) -> None:
        """Add an event of the caller's to the diagnostic trace (any thread; a no-op when
        tracing is off). The vLLM worker marks its engine steps with it (``fwd_start`` /
        ``fwd_end``): the thread that does is the one the stall sampler watches."""
        if self.trace is not None:
            if event in ("fwd_start", "fwd_end"):
                self._step_t = time.monotonic()
                self._step_thread = threading.get_ident()
            self._trace(event, req_id, n)

    def _gc_trace(self, phase: str, info: dict) -> None:
        """Diagnostic trace only (``gc.callbacks``, in whichever thread collects): each
        garbage collection as a ``gc`` event, request id = generation, n = microseconds
        (the collecting thread holds the GIL throughout)."""
        if phase == "start":
            self._gc_t0 = time.monotonic()
        elif self._gc_t0 is not None:
            self._trace("gc", info.get("generation"),
                        int((time.monotonic() - self._gc_t0) * 1e6))
            self._gc_t0 = None

    def _gil_probe(self) -> None:
        """Diagnostic trace only (its own thread, while the reactor runs): a 1 ms sleep
        that resumes late means the GIL was held by another thread (vLLM's engine thread,
        the reactor, a C extension that keeps it) for about that long. Every
        FAULT_SAMPLE_S it also records the process's new major page faults (``majflt``),
        and it samples the engine thread's stack when that stopped marking steps
        (:meth:`_sample_stalled`)."""
        mono, sleep = time.monotonic, time.sleep
        next_sample = next_faults = 0.0
        faults = _major_faults()
        while self._running:
            t = mono()
            sleep(GIL_PROBE_S)
            now = mono()
            late = now - t - GIL_PROBE_S
            if late > GIL_LATE_S:
                self._trace("gil_late", None, int(late * 1e6))
            if now >= next_faults:  # this process's major page faults (file reads)
                next_faults = now + FAULT_SAMPLE_S
                f = _major_faults()
                if f > faults:
                    self._trace("majflt", None, f - faults)
                faults = f
            if (now >= next_sample and self._step_thread is not None and self._outstanding
                    and now - self._step_t > STALL_SAMPLE_S):
                next_sample = now + STALL_SAMPLE_EVERY_S
                self._sample_stalled(now)

    def _sample_stalled(self, now: float) -> None:
        """Diagnostic trace only (the probe thread): the engine thread has not marked a
        step for STALL_SAMPLE_S while requests are outstanding: record where it is (its
        innermost Python frames, ``file:line function`` joined by `` <- ``) as a
        ``stall_stack`` event, n = milliseconds since its last step mark. A thread blocked
        in a system call or a wait has released the GIL, so this sees it there; one that
        holds the GIL in C code delays this sample instead (``gil_late``)."""
        frame = sys._current_frames().get(self._step_thread)
        if frame is None:
            return
        parts = []
        while frame is not None and len(parts) < STALL_SAMPLE_FRAMES:
            co = frame.f_code
            parts.append(f"{os.path.basename(co.co_filename)}:{frame.f_lineno} {co.co_name}")
            frame = frame.f_back
        self._trace("stall_stack", " <- ".join(parts), int((now - self._step_t) * 1e3))

    def _trace(self, event: str, req_id: Any, n: int) -> None:
        tr = self.trace
        if tr is not None and len(tr) < TRACE_MAX:
            tr.append((time.monotonic(), event, req_id, n))

    def _publish(self, c: Completion) -> None:
        """Hand a completion to the clients: :meth:`poll` and the ``on_complete`` hook."""
        self._done.append(c)
        if self._on_complete is not None:
            try:
                self._on_complete(c)
            except Exception:  # pragma: no cover - callback bug must not kill the reactor
                log.exception("py-kvcache: completion callback failed")

    def _complete(self, req: Request) -> None:
        c = Completion(req.req_id, "load" if req.kind == LOAD else "store", req.ok,
                       req.cancelled)
        if self.trace is not None:
            self._trace("done_" + c.kind, req.req_id, len(req.ok))
        self._publish(c)
        with self._cv:
            self._outstanding -= 1
            self._cv.notify_all()

    def _fail_everything(self) -> None:
        """After the reactor thread died: complete every request in flight and every one
        still in the inbox (items not finished are False). Runs on the dying reactor
        thread; :meth:`_fail_inbox` also on client threads for later submissions."""
        reqs = list(self._reqs.values())
        self._reqs.clear()
        self._idle_check()
        for req in reqs:
            req.remaining = 0
            self._complete(req)
        self._fail_inbox()

    def _fail_inbox(self) -> None:
        inbox = self._inbox
        while True:
            try:
                msg = inbox.popleft()
            except IndexError:
                return
            if type(msg) is not _ReqMsg:
                continue
            req_id, kind, items, prio = msg
            req = Request(req_id, kind, len(items), prio)
            req.remaining = 0
            self._complete(req)
