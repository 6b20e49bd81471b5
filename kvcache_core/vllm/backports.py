"""Upstream vLLM fixes that py-kvcache's plugin installs into vLLM 0.26.x.

One fix so far, to vLLM's own KV offloading (the native CPU / tiered offload that operators
run beside or instead of py-kvcache, and that our benchmarks compare against):

**Final store after request finalization (vllm-project/vllm#49635, fixed upstream by
#49671, shipped in 0.27.0).** vLLM 0.26's ``OffloadingConnectorScheduler.request_finished``
signals ``manager.on_request_finished()`` at once, but the request's last store jobs are
built from ``finished_req_ids`` in the NEXT step's ``build_connector_meta``.
``TieringOffloadingManager`` (``TieringOffloadingSpec``: CPU primary tier + FS tier)
deletes a finished request's state when none of its primary stores is pending, so that
next ``prepare_store()`` raises ``KeyError`` and EngineCore dies. It happens whenever a
request's store was refused for want of primary-tier room (``prepare_store`` returned
``None``: the chunks are retried in the next step) and the request finished before the
retry, i.e. under concurrent long requests: the GPU machine's 50-client long-document runs
and SCBench-like runs of the native tiered FS died of it, and
``tests/e2e/test_backports.py`` reproduces it on the CPU platform.

The fix keeps upstream's contract ("``prepare_store()`` of a request precedes its
``on_request_finished()``; ``complete_store()`` may follow it"): ``request_finished``
records the finish signal instead of sending it, and the next ``build_connector_meta``
sends it once it has built the finished requests' store jobs (``has_pending_push_work``
is true while a signal waits, so an engine left without requests steps once more to send
it, as it does for vLLM's own pending stores). ``reset_cache`` sends the
recorded signals before vLLM's reset, so the manager finalizes those requests there (the
pending final stores are discarded by the reset, as upstream does). Every signal is sent
exactly once, one scheduler step later than vLLM 0.26 sends it. Only schedulers whose
manager is a ``TieringOffloadingManager`` change: with any other (py-kvcache's, vLLM's
``CPUOffloadingManager``) the wrappers call vLLM's methods and nothing else.

Installed once per process by :func:`install` (from the ``vllm.general_plugins`` entry
point, :mod:`kvcache_core.vllm.plugin`) on vLLM 0.26.x only; later releases carry the fix.
``KVCACHE_VLLM_BACKPORTS=0`` in the environment leaves vLLM as released. Thread contract:
the wrappers run where vLLM calls the wrapped methods, the engine core's scheduler thread.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

log = logging.getLogger("vllm.pykvcache")

#: attribute set on our wrappers: installed at most once per process
_MARK = "_pykvcache_backport"
#: per-scheduler dict req_id -> ReqContext of the finish signals not sent yet
_DEFERRED = "_pykvcache_deferred_finish"
#: environment switch: "0" leaves vLLM as released
ENV = "KVCACHE_VLLM_BACKPORTS"


def enabled() -> bool:
    """False when ``KVCACHE_VLLM_BACKPORTS=0``."""
    return os.environ.get(ENV, "1").strip() != "0"


def install(version: str | None = None) -> bool:
    """Install the backports that apply to vLLM ``version`` (default: the installed one).

    Returns True when the final-store fix is in place after the call (installed now or
    earlier in this process). Idempotent; raises nothing the plugin does not catch."""
    if not enabled():
        return False
    if version is None:
        from .compat import VLLM_VERSION as version  # noqa: N811
    if not version.startswith("0.26."):
        return False
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler,
    )
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

    return _defer_finish_signal(OffloadingConnectorScheduler, TieringOffloadingManager)


def _defer_finish_signal(cls: type, manager_cls: type) -> bool:
    """Wrap ``request_finished``, ``build_connector_meta``, ``reset_cache`` and
    ``has_pending_push_work`` of vLLM 0.26's ``OffloadingConnectorScheduler`` (see the
    module docstring); schedulers whose manager is not a ``manager_cls`` keep vLLM's
    order."""
    if getattr(cls.request_finished, _MARK, False):
        return True
    request_finished = cls.request_finished
    build_connector_meta = cls.build_connector_meta
    reset_cache = cls.reset_cache
    has_pending_push_work = cls.has_pending_push_work

    @functools.wraps(request_finished)
    def request_finished_deferred(self: Any, request: Any) -> Any:
        if (not isinstance(self.manager, manager_cls)
                or request.request_id not in self._req_status):
            # another manager (py-kvcache's, vLLM's CPU one): nothing to fix; untracked:
            # vLLM starts and finishes it in the manager at once, and no store of it can
            # follow (no request state to build one from)
            return request_finished(self, request)
        manager = self.manager
        held: list[Any] = []
        # the one on_request_finished call vLLM makes in here is recorded, not sent (an
        # instance attribute over vLLM's plain class, removed again below)
        manager.on_request_finished = held.append
        try:
            result = request_finished(self, request)
        finally:
            del manager.on_request_finished  # the class's method again
        deferred = self.__dict__.setdefault(_DEFERRED, {})
        for req_context in held:
            deferred[req_context.req_id] = req_context
        return result

    @functools.wraps(build_connector_meta)
    def build_connector_meta_then_finish(self: Any, scheduler_output: Any) -> Any:
        meta = build_connector_meta(self, scheduler_output)
        _send_deferred(self)  # after this step's store jobs of the finished requests
        return meta

    @functools.wraps(reset_cache)
    def reset_cache_after_finish(self: Any) -> None:
        _send_deferred(self)
        reset_cache(self)

    @functools.wraps(has_pending_push_work)
    def has_pending_push_work_or_finish(self: Any) -> bool:
        # an engine with no request left still steps once more to send the signals
        return bool(self.__dict__.get(_DEFERRED)) or has_pending_push_work(self)

    for fn in (request_finished_deferred, build_connector_meta_then_finish,
               reset_cache_after_finish, has_pending_push_work_or_finish):
        setattr(fn, _MARK, True)
    cls.request_finished = request_finished_deferred
    cls.build_connector_meta = build_connector_meta_then_finish
    cls.reset_cache = reset_cache_after_finish
    cls.has_pending_push_work = has_pending_push_work_or_finish
    log.debug("py-kvcache: vLLM 0.26 offloading scheduler: finish signal after the final "
              "store (backport of vllm-project/vllm#49671)")
    return True


def _send_deferred(scheduler: Any) -> None:
    deferred = scheduler.__dict__.get(_DEFERRED)
    if not deferred:
        return
    contexts = list(deferred.values())
    deferred.clear()
    for req_context in contexts:
        scheduler.manager.on_request_finished(req_context)
