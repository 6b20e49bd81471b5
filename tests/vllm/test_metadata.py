"""Fast tests of :mod:`kvcache_core.vllm.metadata` (what the connector's roles send
each other) and of the job specs that travel inside it: pickling and aggregation."""

from __future__ import annotations

import pickle

from helpers.vllm_units import key

from kvcache_core.reactor import IN_SLOT


def test_specs_and_metadata_pickle_and_aggregate(vllm_available):
    from kvcache_core.vllm import PyKVCacheWorkerMetadata
    from kvcache_core.vllm.job_specs import PyKVLoadSpec, PyKVStoreSpec

    ls = pickle.loads(pickle.dumps(PyKVLoadSpec([key(1)], [3], [IN_SLOT])))
    assert ls.keys == [key(1)] and ls.dram_slots == [3] and ls.flags == [IN_SLOT]
    ss = pickle.loads(pickle.dumps(PyKVStoreSpec([key(2)], [-1])))
    assert ss.keys == [key(2)] and ss.dram_slots == [-1]
    a = PyKVCacheWorkerMetadata(completed_jobs={1: 1}, failed_keys={key(1)},
                                counters={"files_corrupt": 1}, staged={key(3): 1},
                                written={key(5): 1}, observations={"store": [0.1]},
                                sync_done={9: 1})
    b = PyKVCacheWorkerMetadata(completed_jobs={1: 1, 2: 1}, failed_keys={key(2)},
                                counters={"files_corrupt": 2, "bytes_read": 5},
                                staged={key(3): 1, key(4): 1}, written={key(5): 1},
                                observations={"store": [0.2], "load_dram": [0.3]},
                                sync_done={9: 1, 10: 1})
    c = pickle.loads(pickle.dumps(a.aggregate(b)))
    assert isinstance(c, PyKVCacheWorkerMetadata)
    assert c.completed_jobs == {1: 2, 2: 1} and c.failed_keys == {key(1), key(2)}
    assert c.counters == {"files_corrupt": 3, "bytes_read": 5}
    assert c.staged == {key(3): 2, key(4): 1}  # ranks that staged each key
    assert c.written == {key(5): 2}  # ranks that wrote each key
    assert c.sync_done == {9: 2, 10: 1}  # ranks that finished each synchronous load
    assert c.observations == {"store": [0.1, 0.2], "load_dram": [0.3]}  # every rank's
    assert a.observations == {"store": [0.1]}  # the inputs are not modified


def test_connector_metadata_extends_vllms_and_pickles(vllm_available):
    """The scheduler -> worker metadata keeps every field of vLLM's metadata (the job dicts
    themselves, not copies), adds the preloads and flushes, and pickles (multiprocess
    mode), as sent: not started yet."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
        TransferJob,
    )

    from kvcache_core.vllm.metadata import PyKVCacheConnectorMetadata

    base = OffloadingConnectorMetadata(load_jobs={1: TransferJob("r", None, None)},
                                       store_jobs={}, jobs_to_flush={3})
    m = PyKVCacheConnectorMetadata.extend(base, [key(1)], [(key(2), 5)])
    assert isinstance(m, OffloadingConnectorMetadata)
    assert m.load_jobs is base.load_jobs and m.store_jobs is base.store_jobs
    assert m.jobs_to_flush == {3}
    c = pickle.loads(pickle.dumps(m))
    assert type(c) is PyKVCacheConnectorMetadata and not c.preloads_started
    assert c.load_jobs.keys() == {1} and c.jobs_to_flush == {3}
    assert c.preload == [key(1)] and c.flush == [(key(2), 5)] and c.sync_loads == []
    s = pickle.loads(pickle.dumps(PyKVCacheConnectorMetadata.extend(base, [], [], [1])))
    assert s.sync_loads == [1] and s.load_jobs.keys() == {1}
