"""Load routing of the I/O reactor: where a new load goes, and how preloads (speculative
reads) and on-demand loads of the same block share one read.

:class:`LoadRouting` is a mixin of :class:`kvcache_core.reactor.Reactor`; its methods run
on the reactor thread only and use the reactor's state (named in the class doc). The
rules:

* a block already in a retained or staged slot is served from there (no read);
* a preload of a key that is cached, staged or being preloaded is dropped (deduplicated);
* an on-demand load of a key whose preload is READING joins that read; one whose preload
  has not started reading supersedes it (the preload is dropped, the load reads);
* an on-demand load of a key another on-demand load is reading joins it (one read, one
  device copy each, see :meth:`LoadRouting._share`);
* a new on-demand load preempts the one speculative file that is open but not reading
  (closed and re-queued): speculative work never delays an on-demand read.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .layout import HEADER_BYTES
from .staging import Priority
from .tasks import JOINED, OP_CLOSE, OPENED, OPENING, PREEMPTED, READING, READY, SUPERSEDED, Q

if TYPE_CHECKING:
    from .tasks import Task


class LoadRouting:
    """Mixin of the reactor. Uses (owned by the reactor): ``alloc`` (slot allocator),
    ``pool`` (slot views), ``engine``, ``stats``, ``_slot_len`` / ``_staged`` /
    ``_staged_at`` (per slot: payload length, key of an unclaimed preload, when it was
    staged), ``_spec_by_key`` / ``_joiners`` (preloads by key, loads joined to them),
    ``_fg_by_key`` / ``_fg_joiners`` (on-demand reads by key, loads joined to them), the
    queues ``_new_spec``, ``_opened_spec``, ``_new_fg``, ``_ready``, ``_spec_live``
    (speculative loads opening, open or reading), ``trace`` / ``_trace`` and
    ``_finish``."""

    def _route_load(self, t: Task) -> None:
        """Where a new load goes: retained/staged slot, join an in-flight preload, queue."""
        key = t.key
        spec = t.prio == Priority.SPECULATIVE
        slot = self.alloc.pin(key)
        if slot >= 0:  # DRAM tier hit or a staged preload
            if spec:  # nothing to preload: already here
                self.alloc.unpin(slot)
                self.stats.preload_deduped += 1
                self._finish(t, True)
                return
            self._claim(t, slot)
            return
        sp = self._spec_by_key.get(key)
        if sp is not None:
            if spec:  # same prefix asked again: share the one read
                self.stats.preload_deduped += 1
                self._finish(t, True)
                return
            if sp.state == READING:  # join the read in flight instead of reading again
                t.state = JOINED
                self._joiners.setdefault(key, []).append(t)
                self.stats.preload_joined += 1
                return
            self._supersede(sp)  # not reading yet: the foreground load does the read
        if spec:
            self._spec_by_key[key] = t
            self._new_spec.append(t)
            return
        fg = self._fg_by_key.get(key)
        if fg is not None:  # another request reads this block now: one read for both
            t.state = JOINED
            self._fg_joiners.setdefault(key, []).append(t)
            self.stats.loads_joined += 1
            return
        if not t.ext:
            self._fg_by_key[key] = t
        self._preempt_spec()
        self._new_fg.append(t)

    def _claim(self, t: Task, slot: int, shared: bool = False) -> None:
        """Serve load ``t`` from the pinned retained/staged ``slot`` (no disk read;
        ``shared``: the slot holds a read this load made or joined, not a cache hit)."""
        held = self._slot_len[slot]
        t.nbytes = min(t.nbytes, held) if t.nbytes else held
        if not shared:
            if self._staged[slot] == t.key:  # first use of a preloaded block
                self._staged[slot] = None
                self.stats.preload_claimed += 1
            else:
                self.stats.loads_dram += 1
        if t.ext:  # the caller wants the block in its own slot (its DRAM tier): copy it
            # over with the GIL released (a promotion claiming a preload or a shared read:
            # a whole block, ~5 ms of memcpy that vLLM's engine thread would wait out)
            c0 = time.perf_counter() if self.trace is not None else 0.0
            self.pool.copy_slot(t.slot, slot, HEADER_BYTES + held)
            if self.trace is not None:  # diagnostics: trace_report's ``claim ms``
                self._trace("claim_copy", t.req.req_id,
                            int((time.perf_counter() - c0) * 1e6))
            self.alloc.unpin(slot)
        else:
            t.slot, t.cached = slot, True
        t.state = READY
        self._ready.append(t)

    def _supersede(self, sp: Task) -> None:
        """A foreground load for the key of a preload that has not started reading: the
        preload is dropped (counted as deduplicated) and its fd closed."""
        self.stats.preload_deduped += 1
        if sp.state == Q:
            self._new_spec.remove(sp)
            self._finish(sp, True)
        elif sp.state == OPENED:
            self._opened_spec.remove(sp)
            self.engine.close(sp.tag | OP_CLOSE, sp.fd)
            sp.fd = -1
            self._finish(sp, True)
        else:  # OPENING: finished when its open completes
            sp.flags |= SUPERSEDED
            del self._spec_by_key[sp.key]

    def _preempt_spec(self) -> None:
        """A foreground load arrived: stop every speculative file that is open (or being
        opened), not reading: close its fd and re-queue the preload (in its order)."""
        if not self._spec_live:
            return
        requeue = []
        for t in list(self._spec_live):
            if t.state == OPENING:
                t.flags |= PREEMPTED  # closed and re-queued when the open completes
            elif t.state == OPENED:
                self._opened_spec.remove(t)
                self.engine.close(t.tag | OP_CLOSE, t.fd)
                t.fd = -1
                t.state = Q
                self._spec_live.discard(t)
                requeue.append(t)
                self.stats.spec_requeued += 1
        for t in sorted(requeue, key=lambda x: x.tid, reverse=True):
            self._new_spec.appendleft(t)

    def _stage(self, t: Task) -> None:
        """A preload's read finished: keep the slot (reclaimable by foreground work) and
        hand it to the loads that joined the read."""
        key, slot = t.key, t.slot
        self._slot_len[slot] = t.payload
        self.alloc.release(slot, key, force=True)
        t.slot = -1
        self._staged[slot] = key
        self._staged_at[slot] = time.monotonic()
        self.stats.preload_staged += 1
        self._finish(t, True)
        for j in self._joiners.pop(key, ()):
            s = self.alloc.pin(key)
            self._claim(j, s)

    def _share(self, t: Task) -> None:
        """On-demand load ``t`` read its block into a staging slot and other loads joined
        it: the slot becomes a retained one (reclaimable once unpinned) that ``t`` and
        every joiner pin and copy from, so the block was read once."""
        key, slot = t.key, t.slot
        del self._fg_by_key[key]
        joiners = self._fg_joiners.pop(key)
        self._slot_len[slot] = t.payload
        self._staged[slot] = None
        self.alloc.release(slot, key, force=True)
        t.slot = -1
        for x in (t, *joiners):
            self._claim(x, self.alloc.pin(key), shared=True)
