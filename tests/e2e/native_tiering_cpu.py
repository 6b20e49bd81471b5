"""vLLM 0.26's native tiered offloading (``TieringOffloadingSpec``: CPU primary tier + FS
secondary tier) on the CPU platform, for the scheduler-side tests.

vLLM's GPU<->CPU transfer worker needs CUDA (``CPUOffloadingSpec.get_worker`` refuses
other platforms), so :class:`CPUPlatformTieringSpec` replaces that one piece with
:class:`InstantTransferWorker`, which reports every GPU<->CPU job done at once without
copying. Everything else is vLLM's own and real: the scheduler, the
``OffloadingConnectorScheduler``, the ``TieringOffloadingManager`` with its CPU primary
tier and the FS tier writing files under ``root_dir``. On the GPU machine the native_fs
configurations of the benchmarks run the same scheduler side with the real worker.

Use: ``kv_connector_extra_config={"spec_name": "CPUPlatformTieringSpec",
"spec_module_path": "tests.e2e.native_tiering_cpu", ...}`` with vLLM's
``OffloadingConnector``.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class InstantTransferWorker(OffloadingWorker):
    """Completes every submitted GPU<->CPU job at the next ``get_finished`` (no copy).

    Worker thread only (vLLM's connector worker calls it from the model runner)."""

    def __init__(self) -> None:
        self._done: list[TransferResult] = []

    def submit_store(self, job_id, src_spec, dst_spec) -> bool:  # noqa: ANN001
        self._done.append(TransferResult(job_id=job_id, success=True))
        return True

    def submit_load(self, job_id, src_spec, dst_spec) -> bool:  # noqa: ANN001
        self._done.append(TransferResult(job_id=job_id, success=True))
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return


class CPUPlatformTieringSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` with :class:`InstantTransferWorker` as its worker."""

    def get_worker(self, kv_caches):  # noqa: ANN001, ANN201
        if not self._worker:
            self._worker = InstantTransferWorker()
        return self._worker


def main() -> int:
    """``python -m tests.e2e.native_tiering_cpu MODEL_DIR ROOT OUT_JSON``: three rounds of
    the prompts A, B and C submitted at once (one output token each) through vLLM's
    ``OffloadingConnector`` with this spec, a CPU primary tier of 4 chunks (less than two
    requests' 3 chunks each, so stores are refused and retried) and an FS tier under
    ROOT. Writes ``{"rounds": n completed, "error": repr or null, "late_stores": [req ids
    whose prepare_store came after their on_request_finished], "finished": n signals sent,
    "waiting_signals": n recorded not sent yet, "pending_push_work": bool}``."""
    import json
    import os
    import sys

    from tests.e2e import helpers as H

    for k, v in H.ENV.items():
        os.environ.setdefault(k, v)
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

    model_dir, root, out = sys.argv[1:4]
    finished: set[str] = set()
    late: list[str] = []
    prepare_store = TieringOffloadingManager.prepare_store
    on_request_finished = TieringOffloadingManager.on_request_finished

    def prepare_store_logged(self, keys, req_context):  # noqa: ANN001, ANN202
        if req_context.req_id in finished:
            late.append(req_context.req_id)
        return prepare_store(self, keys, req_context)

    def on_request_finished_logged(self, req_context, **kw):  # noqa: ANN001, ANN202
        finished.add(req_context.req_id)
        return on_request_finished(self, req_context, **kw)

    TieringOffloadingManager.prepare_store = prepare_store_logged
    TieringOffloadingManager.on_request_finished = on_request_finished_logged
    ktc = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both",
        kv_connector_extra_config={
            "block_size": H.CHUNK, "spec_name": "CPUPlatformTieringSpec",
            "spec_module_path": "tests.e2e.native_tiering_cpu",
            "cpu_bytes_to_use": 4 * 2 * H.GPU_BLOCK_BYTES,
            "secondary_tiers": [{"type": "fs", "root_dir": root}]})
    res: dict = {"rounds": 0, "error": None}
    try:
        llm = H.make_llm(model_dir, None, kv_transfer_config=ktc)
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for _ in range(3):
            llm.generate([{"prompt_token_ids": H.PROMPTS[n]} for n in "ABC"], sp,
                         use_tqdm=False)
            res["rounds"] += 1
        # an in-process engine steps only inside generate(): the last round's signals
        # wait for a next step (a server's busy loop takes it at once, through
        # has_pending_push_work); count them here
        conn = H.scheduler_connector(llm).connector_scheduler
        res["waiting_signals"] = len(conn.__dict__.get("_pykvcache_deferred_finish", {}))
        res["pending_push_work"] = conn.has_pending_push_work()
    except Exception as e:  # the engine's death is the result under test
        res["error"] = repr(e)
    res["late_stores"] = late
    res["finished"] = len(finished)
    with open(out, "w") as f:
        json.dump(res, f)
    os._exit(0)  # an engine that died may leave threads behind


if __name__ == "__main__":
    raise SystemExit(main())
